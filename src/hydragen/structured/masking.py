"""Grammar masks for a whole decode batch: filled in parallel by llguidance, applied as one tensor op.

llguidance's executor computes every constrained row's allowed-token bitmask on its own threads with
the GIL released (one Python call per step, not per row); rows without a grammar keep all bits set.
The bits are then expanded and applied to the logits with one ``masked_fill_`` over the batch, before
the sampler: each row's result depends on its own mask only, so seeded sampling stays batch-invariant.
"""

from __future__ import annotations

import time
from collections import deque

import numpy
import torch

TIMED_STEPS = 100_000


class BatchMasker:
    def __init__(self, vocab_size: int, threads: int | None = None):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._threads = threads
        self._executor = None
        self._bits = torch.empty(0, self.words, dtype=torch.int32)
        self.reset_timings()

    def reset_timings(self) -> None:
        """Per masked step (the last TIMED_STEPS, so a server never grows them without bound): time to
        fill and apply the masks, the grammar engine's part alone, and the constrained rows."""
        self.seconds: deque[float] = deque(maxlen=TIMED_STEPS)
        self.fill_seconds: deque[float] = deque(maxlen=TIMED_STEPS)
        self.row_counts: deque[int] = deque(maxlen=TIMED_STEPS)

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bits.shape[0] < rows:
            self._bits = torch.empty(rows, self.words, dtype=torch.int32)
        return self._bits[:rows]

    def apply(
        self, logits: torch.Tensor, matchers: list[tuple[object, int]], extra: list[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """Mask ``logits`` [B, V] in place: row i keeps only the tokens its matcher allows, for every
        (matcher, i) given, and the tokens ``extra`` names for it ((row, token) pairs); other rows are
        untouched."""
        import llguidance
        import llguidance.torch as lt

        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        rows = logits.shape[0]
        bits = self._buffer(rows)
        bits.fill_(-1)
        lt.fill_next_token_bitmask_par(self._executor, matchers, bits)
        if extra:
            words = bits.numpy().view(numpy.uint32)
            for row, token in extra:
                words[row, token >> 5] |= numpy.uint32(1 << (token & 31))
        self.fill_seconds.append(time.perf_counter() - t0)
        with torch.inference_mode():  # the logits are an inference tensor (the forward ran in that mode)
            # Set bits of the inverted words are the blocked tokens; words are little-endian, so byte k
            # of a row holds tokens 8k .. 8k + 7, lowest bit first (numpy's unpack runs at memory speed).
            inverted = torch.bitwise_not(bits).numpy().view(numpy.uint8)
            blocked = numpy.unpackbits(inverted, axis=1, bitorder="little")[:, : logits.shape[1]]
            logits.masked_fill_(torch.from_numpy(blocked).view(torch.bool).to(logits.device), float("-inf"))
        self.seconds.append(time.perf_counter() - t0)
        self.row_counts.append(len(matchers))
        return logits
