"""The scheduling plug point: each step, which requests run and how many new tokens each gets.

Policies (`schedulers/`) are pure (no clock, model or tensors), so the simulator runs them as they
are; out of memory, they preempt by recompute, the last admitted first (as in vLLM).
"""

from __future__ import annotations

from abc import ABC
from collections import deque
from typing import ClassVar, Iterator, Protocol

from mypy_extensions import i64, mypyc_attr

from varlen.kv.base import KVAllocator
from varlen.promises import keeps_promise
from varlen.request import Request, Status

#: Methods whose override below the declaring class voids `repeats_decode_batches` (varlen/promises.py).
DECODE_PROMISE_BEHAVIOUR = ("schedule", "_schedule_running", "_admit_waiting", "_grant", "_preempt", "waiting_order",
                            "victim_order", "_may_admit", "_rest_fits", "next_decode_batch", "add", "remove",
                            "has_work")


class WaitingQueue(Protocol):
    """What a policy's waiting queue offers: a deque (FCFS) or one kept in another order
    (schedulers/priority.py). Iteration order is admission order; [0] is the next to admit."""

    def append(self, req: Request) -> None: ...

    def appendleft(self, req: Request) -> None: ...

    def remove(self, req: Request) -> None: ...

    def popleft(self) -> Request: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def __getitem__(self, i: int) -> Request: ...

    def __contains__(self, req: object) -> bool: ...


class SchedulerOutput:
    """A step's batch: `scheduled`, (request, new tokens) in batch order, and the requests preempted.

    A shipped policy may hand its leading decodes over in bulk (`decodes`, each granted one token,
    ahead of the entries appended since) while no one holds the list: reading `scheduled` puts them
    into it, so every reader of `scheduled` sees the whole batch, the same list object from then on."""

    preempted: list[Request]

    def __init__(self, scheduled: list[tuple[Request, int]] | None = None, preempted: list[Request] | None = None) -> None:
        self._entries: list[tuple[Request, int]] = [] if scheduled is None else scheduled  # after `decodes`
        self.decodes: list[Request] | None = None  # leading one-token grants not in _entries yet
        self.handed_out = scheduled is not None  # whether a caller holds _entries (then no bulk decodes)
        self.preempted = [] if preempted is None else preempted

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        entries = self._entries
        self.handed_out = True
        decodes = self.decodes
        if decodes is not None:
            self.decodes = None
            entries[0:0] = [(r, 1) for r in decodes]  # in place: a list read before stays the batch's
        return entries

    @scheduled.setter
    def scheduled(self, value: list[tuple[Request, int]]) -> None:
        self._entries = value
        self.decodes = None
        self.handed_out = True

    def add(self, req: Request, n: int) -> None:
        """Append (req, n) to the batch (no copy of the bulk decodes)."""
        self._entries.append((req, n))

    def rest(self) -> list[tuple[Request, int]]:
        """The entries after `decodes` (the whole batch where decodes is None)."""
        return self._entries

    @property
    def num_tokens(self) -> int:
        d = self.decodes
        return (0 if d is None else len(d)) + sum(n for _, n in self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries) or bool(self.decodes)

    def __repr__(self) -> str:
        return f"SchedulerOutput(scheduled={self.scheduled!r}, preempted={self.preempted!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return self.scheduled == other.scheduled and self.preempted == other.preempted


@mypyc_attr(allow_interpreted_subclasses=True)
class SchedulerPolicy(ABC):
    """Base with the shared mechanics; a policy decides *order* and *admission* only."""

    #: False: a prompt is computed in one step (so it must fit the token budget whole).
    chunked_prefill: ClassVar[bool] = False

    #: Opt-in promise (next_decode_batch): with nothing to admit and every running request needing one
    #: token, schedule every running request for one token until an arrival or a failed allocation.
    repeats_decode_batches: ClassVar[bool] = False

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: WaitingQueue = deque()
        self.running: list[Request] = []
        self._repeats = -1  # whether repeats_decode_batches is my class's own promise (-1: not checked yet)
        self._own_grant = -1  # whether _grant is this class's (-1: not checked yet): decodes then granted in bulk
        self._own_order = -1  # whether waiting_order is this class's (-1: not checked yet): FCFS, a prefix copied

    @property
    def name(self) -> str:
        return type(self).__name__

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """The request finished or was aborted; forget it (the engine frees its blocks)."""
        running = self.running
        # By identity, as `in` and list.remove find a Request (eq=False), without a call per entry.
        for i in range(len(running)):
            if running[i] is req:
                del running[i]
                return
        if req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, kv: KVAllocator) -> SchedulerOutput:
        """Choose this step's batch: running requests first, then admissions from the waiting queue
        (a whole-prompt policy admits with the full budget, a chunked one shares it)."""
        out = SchedulerOutput()
        budget = self._schedule_running(kv, out, self.max_num_batched_tokens)
        self._admit_waiting(kv, out, budget if self.chunked_prefill else self.max_num_batched_tokens)
        return out

    def next_decode_batch(self) -> list[Request] | None:
        """My next batch if it is certainly a pure decode of every running request, else None."""
        running = self.running
        if self._repeats < 0:  # checked on first use: a real run, which never asks, says nothing
            self._repeats = int(self.repeats_decode_batches and keeps_promise(
                self, "repeats_decode_batches", DECODE_PROMISE_BEHAVIOUR, SchedulerPolicy))
        if (not self._repeats or self._may_admit() or not running
                or len(running) > self.max_num_batched_tokens):
            return None
        # Newest first: a prompt still being chunked in was admitted last (same answer, shorter scan).
        # (i64: asked several times a step of every running request; compiled, no tagged arithmetic.)
        i: i64 = len(running) - 1
        while i >= 0:
            r = running[i]
            c: i64 = r.num_computed_tokens
            if r.num_prompt_tokens + len(r.output_token_ids) - c != 1:
                return None
            i -= 1
        return list(running)

    def _may_admit(self) -> bool:
        """Whether my next schedule may admit a waiting request (then no decode run is promised)."""
        return bool(self.waiting)

    def waiting_order(self) -> list[Request]:
        """Order in which waiting requests are considered (FCFS unless overridden)."""
        return list(self.waiting)

    def victim_order(self) -> list[Request]:
        """Running requests, most preemptible first."""
        return self.running[::-1]

    def _grant(self, req: Request, budget: int) -> int:
        pending = req.num_prompt_tokens + len(req.output_token_ids) - req.num_computed_tokens
        return min(pending, budget) if self.chunked_prefill else (pending if pending <= budget else 0)

    def _schedule_running(self, kv: KVAllocator, out: SchedulerOutput, budget: int) -> int:
        """Give every running request its next tokens, preempting when the pool is full."""
        running = self.running
        first = 0
        refused: Request | None = None  # its allocation failed in bulk: not asked again before a preemption
        if not out.preempted and budget > 0 and isinstance(kv, KVAllocator):
            if self._own_grant < 0:
                self._own_grant = int(type(self)._grant is SchedulerPolicy._grant)
            if self._own_grant:
                # The leading decodes, while the budget lasts, each granted one token (as _grant does) and
                # allocated in bulk, in order, up to the first allocation that fails (the loop preempts).
                first, failed = kv._allocate_leading_decodes(running, min(len(running), budget))
                if failed:
                    refused = running[first]
                if first or failed:
                    if not out.handed_out and out.decodes is None and not out.rest():
                        out.decodes = running[:first]  # one slice, not a (request, 1) tuple each
                    else:
                        for p in range(first):
                            out.add(running[p], 1)
                    budget -= first
        for req in running[first:] if first else list(running):
            # Preempted as a victim earlier in this loop (out.preempted is short; `running` is not).
            if out.preempted and req in out.preempted:
                continue
            n = self._grant(req, budget)
            if n == 0:
                continue
            failed = req is refused
            while failed or not kv.allocate(req, req.num_computed_tokens + n):
                failed = False
                victim = next(v for v in self.victim_order() if v not in (r for r, _ in out.scheduled))
                self._preempt(victim, kv, out)
                if victim is req:
                    break
            else:
                out.add(req, n)
                budget -= n
        return budget

    def _preempt(self, victim: Request, kv: KVAllocator, out: SchedulerOutput) -> None:
        kv.free(victim)
        self.running.remove(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _rest_fits(self, kv: KVAllocator, req: Request, hit: int) -> bool:
        """Whether the free KV blocks hold all of `req`'s tokens past its `hit` cached ones (a chunked
        admission would otherwise preempt itself chunk after chunk)."""
        bs = kv.block_size
        return -(-(req.num_prompt_tokens + len(req.output_token_ids)) // bs) - hit // bs <= kv.usage().free_slots // bs

    def _admit_waiting(self, kv: KVAllocator, out: SchedulerOutput, budget: int,
                       limit: int | None = None) -> int:
        """Admit waiting requests in order while seats, budget and memory last; no overtaking."""
        seats = self.max_num_seqs - len(self.running)
        if limit is not None:
            seats = min(seats, limit)
        if seats <= 0 or budget <= 0 or not self.waiting:
            return budget
        preempted = set(map(id, out.preempted)) if out.preempted else None
        if self._own_order < 0:
            self._own_order = int(type(self).waiting_order is SchedulerPolicy.waiting_order)
        # FCFS: the queue's head each time, no copy (each admission removes the head; the first refusal
        # ends the loop), the order waiting_order's copy would give.
        order: list[Request] | None = None if self._own_order else self.waiting_order()
        i = 0
        while True:
            if order is None:
                if not self.waiting:
                    break
                req = self.waiting[0]
            elif i < len(order):
                req = order[i]
                i += 1
            else:
                break
            if seats <= 0 or budget <= 0 or (preempted is not None and id(req) in preempted):
                break
            hit = kv.match_prefix(req)
            req.num_computed_tokens = hit
            n = self._grant(req, budget)
            if n == 0 or (n < req.num_prompt_tokens + len(req.output_token_ids) - hit
                          and not self._rest_fits(kv, req, hit)) or not kv.allocate(req, hit + n):
                req.num_computed_tokens = 0
                break
            req.num_prefix_hit_tokens = hit
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.add(req, n)
            budget -= n
            seats -= 1
        return budget
