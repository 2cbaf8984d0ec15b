"""Shortest job first, with aging; otherwise `chunked`. Rank = prompt_len + aging_rate * arrival,
fixed at queueing (no clock read); `aging_rate: 0` is pure shortest-first, which can starve.
"""

from __future__ import annotations

import math
from schedulers.chunked import ChunkedPolicy
from schedulers.priority import RankedQueue
from varlen.request import Request


class ShortestFirstQueue(RankedQueue):
    """The waiting queue (the priority policy's RankedQueue) in shortest-first order with aging."""

    def __init__(self, aging_rate: float) -> None:
        super().__init__()
        self.aging_rate = aging_rate

    def rank(self, req: Request) -> tuple[float, float]:
        """Lower goes first: arrival + prompt_len / aging_rate, or (prompt_len, arrival) without aging."""
        if self.aging_rate > 0:
            return req.arrival + req.num_prompt_tokens / self.aging_rate, 0.0
        return float(req.num_prompt_tokens), req.arrival


class SJFPolicy(ChunkedPolicy):
    # Kept: only the waiting order differs, and a decode run needs an empty waiting queue.
    repeats_decode_batches = True

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, aging_rate: float = 100.0):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        if isinstance(aging_rate, bool) or not isinstance(aging_rate, (int, float)) or \
                not math.isfinite(aging_rate) or aging_rate < 0:
            raise ValueError(f"aging_rate={aging_rate!r}: must be a number >= 0 (prompt tokens forgiven per "
                             f"second of waiting; 0: no aging)")
        self.aging_rate = float(aging_rate)
        self.waiting = ShortestFirstQueue(self.aging_rate)  # iterates in rank order: the base admits from its head
