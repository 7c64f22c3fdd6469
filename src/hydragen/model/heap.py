"""Giving a load's freed heap memory back to the operating system."""

from __future__ import annotations


def release_freed_memory() -> None:
    """Hand the load's freed temporaries back to the OS. glibc keeps freed heap memory mapped, and the
    reads and repacking of a load leave holes between the weights that stay: resident memory would count
    them as the model's (on the embedded model, ~90 MB over its 96 MB of weights)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
