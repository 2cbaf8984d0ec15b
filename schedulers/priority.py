"""Priority scheduling: admit by (priority, arrival); out of memory, preempt the least important
running request first (lower `priority` = more important). Queues stay sorted: O(log n) each.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Iterator

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.request import Request
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy


def _rank(r: Request) -> tuple[int, float]:
    """Most important first: lower priority value, then earlier arrival."""
    return r.priority, r.arrival


@mypyc_attr(allow_interpreted_subclasses=True)
class RankedQueue:
    """Waiting requests in rank order (`rank`, here (priority, arrival)), ties as a deque would hold
    them (preempted ones at the front): a stable sort of that deque, kept sorted by bisection."""

    def __init__(self) -> None:
        self._keys: list[tuple[float, float, int]] = []
        self._reqs: list[Request] = []
        self._key_of: dict[int, tuple[float, float, int]] = {}
        self._seq = 0

    def rank(self, req: Request) -> tuple[float, float]:
        """Lower goes first; fixed while the request waits (it is read once, at insertion)."""
        return float(req.priority), req.arrival

    def _insert(self, req: Request, seq: int) -> None:
        r = self.rank(req)
        key = (r[0], r[1], seq)
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


@mypyc_attr(allow_interpreted_subclasses=True)
class PriorityPolicy(SchedulerPolicy):
    chunked_prefill = True
    repeats_decode_batches = True  # the running order is a stable sort on fixed keys

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        self.waiting = RankedQueue()  # iterates in rank order: the base admits from its head

    def _admit_waiting(self, kv: KVAllocator, out: SchedulerOutput, budget: int,
                       limit: int | None = None) -> int:
        # Admissions join `running` at their rank (after equals), which keeps it sorted.
        n = len(self.running)
        budget = super()._admit_waiting(kv, out, budget, limit)
        if len(self.running) > n:
            new = self.running[n:]
            del self.running[n:]
            for r in new:
                insort(self.running, r, key=_rank)
        return budget

    def victim_order(self) -> list[Request]:
        return sorted(self.running, key=_rank, reverse=True)
