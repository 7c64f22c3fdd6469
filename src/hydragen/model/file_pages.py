"""Taking a memory-mapped file's pages out of this process once their bytes have been read.

A GGUF's weights are read through a memory map, and every page a load touches stays in the process's
resident set (VmRSS, and so its peak VmHWM: both count file-backed pages) until the map is unmapped, which
is only once the last tensor read from it is gone. Every quantized matrix is copied out of the map into its
packed tiles, so without dropping the pages a load holds the file twice at its end: the packed copy and the
mapped pages (a peak of 2.0-2.4x the file). ``MADV_DONTNEED`` takes pages out of this process; they stay in
the page cache, and a later read faults them back in: dropping too early is never wrong, only slower.
"""

from __future__ import annotations

import mmap

import numpy as np

FOLIO_BYTES = 2 << 20  # the largest folio the page cache maps at once (a PMD's span on x86-64 and arm64)


class FileMap:
    """A read-only memory map of a whole file, whose pages can be dropped by byte range."""

    def __init__(self, file_map: mmap.mmap | None) -> None:
        self._map = file_map

    @classmethod
    def of(cls, array: np.ndarray) -> FileMap:
        """The map under ``array``, a ``np.memmap`` of a whole file or a view of one (no map: dropping does
        nothing)."""
        while array is not None and not isinstance(array, np.memmap):
            array = array.base if isinstance(array.base, np.ndarray) else None
        file_map = getattr(array, "_mmap", None) if array is not None and array.offset == 0 else None
        return cls(file_map if isinstance(file_map, mmap.mmap) else None)

    def drop(self, offset: int, nbytes: int) -> None:
        """Takes the pages around bytes [offset, offset + nbytes) out of this process: the range grows to
        whole 2 MiB blocks of the file. The page cache holds a file in folios of up to 2 MiB, and a read fault
        maps a whole folio (Linux 6.18 on ext4 here), so reading a tensor also maps the ends of its
        neighbours: dropping only the tensor's own pages left half of the embedded model's file mapped. A
        neighbour still to be read faults its block back in."""
        if self._map is None or nbytes <= 0 or self._map.closed or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = offset - offset % FOLIO_BYTES
        end = min(-(-(offset + nbytes) // FOLIO_BYTES) * FOLIO_BYTES, len(self._map))
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
