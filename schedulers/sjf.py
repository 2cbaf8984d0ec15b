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
from bisect import bisect_left, bisect_right
from typing import Iterator

from schedulers.chunked import ChunkedPolicy
from varlen.request import Request


class ShortestFirstQueue:
    """The waiting queue (schedulers.base.WaitingQueue) in rank order, kept sorted as requests
    come and go; ties in the order a deque would hold them (a preempted request put back goes
    before its equals)."""

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate
        self._keys: list[tuple[float, float, int]] = []
        self._reqs: list[Request] = []
        self._key_of: dict[int, tuple[float, float, int]] = {}
        self._seq = 0

    def rank(self, req: Request) -> tuple[float, float]:
        """Lower goes first: arrival + prompt_len / aging_rate (seconds: the order of prompt_len -
        aging_rate * waited), or (prompt_len, arrival) without aging."""
        if self.aging_rate > 0:
            return req.arrival + req.num_prompt_tokens / self.aging_rate, 0.0
        return float(req.num_prompt_tokens), req.arrival

    def _insert(self, req: Request, seq: int) -> None:
        key = (*self.rank(req), seq)
        i = bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)
        self._key_of[id(req)] = key

    def append(self, req: Request) -> None:
        self._seq += 1
        self._insert(req, self._seq)

    def appendleft(self, req: Request) -> None:
        self._seq += 1
        self._insert(req, -self._seq)

    def remove(self, req: Request) -> None:
        key = self._key_of.pop(id(req), None)
        if key is None:
            raise ValueError(f"request {req.req_id!r} is not waiting")
        i = bisect_left(self._keys, key)
        del self._keys[i]
        del self._reqs[i]

    def popleft(self) -> Request:
        req = self._reqs.pop(0)
        del self._keys[0]
        del self._key_of[id(req)]
        return req

    def clear(self) -> None:
        self._keys.clear()
        self._reqs.clear()
        self._key_of.clear()

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def __contains__(self, req: object) -> bool:
        return id(req) in self._key_of


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
