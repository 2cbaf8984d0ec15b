"""Shortest job first, with aging: waiting requests are admitted shortest prompt first, so short
requests are not stuck behind long prompts (lower mean TTFT), and aging keeps a long prompt from
waiting forever behind a steady stream of short ones. Otherwise it is `chunked` (vLLM V1):
one token budget per step, running requests first, prompts split to fit.

A waiting request's priority is its prompt length less `aging_rate` tokens per second it has
waited: prompt_len - aging_rate * (now - arrival). `now` is the same for every request, so the
order is that of prompt_len + aging_rate * arrival, fixed when the request is queued: the queue is
kept sorted (O(log n) comparisons per insertion), and the policy reads no clock (it stays pure,
and the simulator's decode fast-forward still applies).

The bound: a request that arrives more than (P - 1) / aging_rate seconds after a waiting request
with a P-token prompt ranks behind it (its prompt has at least one token), so only the finitely
many that came earlier can pass it. `aging_rate: 0` is pure shortest-first (ties by arrival),
which can starve a long prompt under load.
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
        """Lower goes first: arrival + prompt_len / aging_rate (seconds: the order of prompt_len -
        aging_rate * waited), or (prompt_len, arrival) without aging."""
        if self.aging_rate > 0:
            return req.arrival + req.num_prompt_tokens / self.aging_rate, 0.0
        return float(req.num_prompt_tokens), req.arrival


class SJFPolicy(ChunkedPolicy):
    # Declared here too, though nothing it promises about is overridden: only the waiting queue's
    # order differs from chunked's, and a decode run needs an empty waiting queue.
    repeats_decode_batches = True

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, aging_rate: float = 100.0):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        if isinstance(aging_rate, bool) or not isinstance(aging_rate, (int, float)) or \
                not math.isfinite(aging_rate) or aging_rate < 0:
            raise ValueError(f"aging_rate={aging_rate!r}: must be a number >= 0 (prompt tokens forgiven per "
                             f"second of waiting; 0: no aging)")
        self.aging_rate = float(aging_rate)
        self.waiting = ShortestFirstQueue(self.aging_rate)  # iterates in rank order: the base admits from its head
