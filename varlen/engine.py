"""The engine loop: schedule → execute → update, the same object in a real run and in the simulator.
Only the executor and the clock differ, so the simulator's decisions are the engine's. No torch.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from typing import Callable, Final, Iterable, Sequence

from mypy_extensions import mypyc_attr

from varlen.clock import SimClock, WallClock
from varlen.kv.base import KVAllocator
from varlen.request import FinishReason, Request, Status, prompt_problem
from varlen.scheduler_api import SchedulerOutput, SchedulerPolicy
from varlen.steplog import StepLog, StepRecord


@mypyc_attr(allow_interpreted_subclasses=True)
class Executor(ABC):
    """Runs one step's batch and returns a sampled token for each request whose step reaches the
    end of its known tokens (None for a prefill chunk that does not)."""

    @abstractmethod
    def execute(self, scheduled: Sequence[tuple[Request, int]], kv: KVAllocator) -> list[int | None]: ...

    def release(self, req: Request) -> None:
        """Forget per-request state: the request finished, was aborted or was preempted."""


@mypyc_attr(allow_interpreted_subclasses=True)
class Engine:
    def __init__(self, policy: SchedulerPolicy, kv: KVAllocator, executor: Executor, clock=None,
                 max_model_len: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 vocab_size: int | None = None):
        """`eos_token_id`: one id or several; `vocab_size`: rejects token ids outside it (None: no check)."""
        self.policy, self.kv, self.executor = policy, kv, executor
        self.clock = WallClock() if clock is None else clock
        # The clock read natively while it is this very SimClock (the simulator's): a call through
        # Python costs more than the step's arithmetic around it.
        self._sim_clock: SimClock | None = self.clock if type(self.clock) is SimClock else None
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1 (or None: what the KV pool holds)")
        cap = kv.max_request_tokens()
        self.max_model_len = cap if max_model_len is None else min(max_model_len, cap)
        self.eos_token_ids: tuple[int, ...] = () if eos_token_id is None else \
            (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(int(t) for t in eos_token_id)
        self.vocab_size = vocab_size
        if not policy.chunked_prefill and policy.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler {policy.name} computes a prompt in one step, so max_num_batched_tokens "
                f"({policy.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                f"raise it, lower max_model_len, or use the chunked scheduler")
        # Unfinished requests only: a long-lived engine holds only what it serves.
        self.requests: dict[str, Request] = {}
        self.steps = StepLog()
        self.num_preemptions = 0
        self.timings: dict[str, float] = defaultdict(float)  # wall seconds per phase of step()
        self._batch: SchedulerOutput | None = None  # the step's batch while it runs (ended aborted if it raises)
        # stream_token_times: where the gaps go (None: each request keeps its token_times), the gaps not
        # handed over yet (equal neighbours as one value and its count), and the equal gaps being counted.
        self._gap_sink: Callable[[list[float], list[int]], None] | None = None
        self._gap_values: list[float] = []
        self._gap_counts: list[int] = []
        self._gap_last = 0.0
        self._gap_run = 0

    def stream_token_times(self, sink: Callable[[list[float], list[int]], None]) -> None:
        """From now on requests added keep no token_times list: each keeps its first and last token time,
        its count and its longest gap (num_token_times, first_token_time, last_token_time, max_token_gap),
        and every inter-token gap goes to sink(values, counts) in batches (flush_token_gaps hands over the
        rest). The sink counts finished requests' gaps only, and a streamed gap cannot be taken back, so a
        request that could outgrow the whole KV pool (prompt + max_tokens, within max_model_len, over
        kv.capacity_tokens: preempted alone, it can never be re-admitted and is aborted) keeps its list;
        aborting a streamed request that has gaps (a policy leaving a request that fits unscheduled on an
        idle engine, or abort()) raises instead."""
        self._gap_sink = sink

    def flush_token_gaps(self) -> None:
        """Hand the gaps counted so far to the stream_token_times sink."""
        if self._gap_run:
            self._gap_values.append(self._gap_last)
            self._gap_counts.append(self._gap_run)
            self._gap_run = 0
        sink = self._gap_sink
        if sink is not None and self._gap_values:
            values, counts = self._gap_values, self._gap_counts
            self._gap_values, self._gap_counts = [], []
            sink(values, counts)

    def _count_gap(self, gap: float, n: int) -> None:
        """`n` gaps of `gap` seconds (streaming): a batch's gaps mostly equal their neighbours'."""
        if gap == self._gap_last:  # also where no run is open (count 0): it opens with this value
            self._gap_run += n
            return
        if self._gap_run:
            values = self._gap_values
            values.append(self._gap_last)
            self._gap_counts.append(self._gap_run)
            if len(values) >= GAP_BATCH:
                self._gap_run = 0
                self.flush_token_gaps()
        self._gap_last, self._gap_run = gap, n

    def _stream_time(self, r: Request, end: float) -> None:
        """Request `r` sampled a token at `end` (streaming): its figures, and its gap counted."""
        n = r.num_token_times
        if n:
            gap = end - r.last_token_time  # np.diff's subtraction
            if gap > r.max_token_gap:
                r.max_token_gap = gap
            self._count_gap(gap, 1)
        else:
            r.first_token_time = end
        r.last_token_time = end
        r.num_token_times = n + 1

    def _check_unstreamed(self, req: Request, why: str) -> None:
        """Refuse to abort a request whose gaps were already handed to the stream_token_times sink."""
        if req.streams_token_times and req.num_token_times > 1:
            raise RuntimeError(
                f"request {req.req_id!r} would end aborted ({why}) after {req.num_token_times} tokens whose gaps "
                f"the run's gap table already counts (token times are streamed); rerun with token-level output "
                f"(sim.run: output.token_times=true) to keep each request's token times")

    def add_request(self, req: Request, now: float | None = None) -> None:
        """Queue `req`, or end it `rejected` (with the reason) if it can never run. An arrival of
        0 means `now` (run() passes the instant it polled arrivals), else the clock's."""
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r} (an unfinished request has it)")
        if not req.arrival:
            req.arrival = self.clock.now() if now is None else now
        problem = self._reject_reason(req)
        if problem:
            req.finish(FinishReason.REJECTED, max(req.arrival, self.clock.now()), f"request {req.req_id!r}: {problem}")
            return
        # Streamed unless it could outgrow the whole pool: then it may end aborted (Engine._unstick), and an
        # aborted request's gaps must stay out of the gap table, so it keeps its token times. Shipped pools
        # cap max_model_len at their capacity (kv.max_request_tokens); a plug-in pool may claim more.
        req.streams_token_times = self._gap_sink is not None and \
            min(req.num_prompt_tokens + req.sampling.max_tokens, self.max_model_len) <= self.kv.capacity_tokens
        self.requests[req.req_id] = req
        self.policy.add(req)

    def _reject_reason(self, req: Request) -> str:
        sp = req.sampling
        problem = sp.problem()
        if problem:
            return f"sampling {problem}"
        vocab = self.vocab_size
        if vocab is not None:
            problem = prompt_problem(req.prompt_token_ids, vocab)
            if problem:
                return problem
            for t in sp.stop_token_ids:
                if t >= vocab:
                    return (f"sampling stop_token_ids={list(sp.stop_token_ids)}: {t} is outside the vocabulary "
                            f"[0, {vocab})")
        n = req.num_prompt_tokens
        if n == 0:
            return "empty prompt: a request needs at least one prompt token"
        if n > self.kv.capacity_tokens:
            return f"prompt of {n} tokens is longer than the whole KV pool ({self.kv.capacity_tokens} slots)"
        if n > self.max_model_len:
            return f"prompt of {n} tokens is longer than max_model_len ({self.max_model_len} tokens)"
        return ""

    def abort(self, req_id: str, message: str = "aborted by the caller") -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        self._check_unstreamed(req, f"abort(): {message}")
        self._finish(req, FinishReason.ABORTED, message)

    def _now(self) -> float:
        """self.clock.now()."""
        c = self._sim_clock
        if c is not None and c is self.clock:
            return c.now()
        t: float = self.clock.now()
        return t

    def _finish(self, req: Request, reason: FinishReason, message: str = "", failed: bool = False) -> None:
        """End `req`; `failed`: its step raised, so its newest KV may be unwritten (kv.discard)."""
        req.finish(reason, self._now(), message)
        requests = self.requests
        if req.req_id in requests:  # compiled: two native lookups, where pop(key, None) is a method call
            del requests[req.req_id]
        self.policy.remove(req)
        if failed:
            self.kv.discard(req, req.num_computed_tokens)
        else:
            self.kv.free(req)
        self.executor.release(req)

    def has_unfinished(self) -> bool:
        return self.policy.has_work()

    def step(self, start: float | None = None) -> list[Request]:
        """Run one step; return the requests that finished in it. If it raises, the step's requests end
        `aborted`, queues and KV pool stay consistent, and the error propagates."""
        if start is None:
            start = self.clock.now()
        # Not assigned here: mypy would narrow _batch to None in `except`.
        try:
            return self._step(start)
        except BaseException as err:
            batch = self._batch
            if batch is not None:
                self._fail([r for r, _ in batch.scheduled], err, f"step {len(self.steps)} failed")
            else:
                self._fail(list(self.requests.values()), err,
                           f"step {len(self.steps)} failed before its batch was decided")
            raise
        finally:
            self._batch = None

    def _fail(self, reqs: list[Request], err: BaseException, what: str) -> None:
        message = _error_message(what, err)
        for r in reqs:
            if not r.is_finished:
                self._finish(r, FinishReason.ABORTED, message, failed=True)

    def _step(self, start: float) -> list[Request]:
        t0 = time.perf_counter()
        out = self.policy.schedule(self.kv)
        for r in out.preempted:
            self.executor.release(r)
        self.num_preemptions += len(out.preempted)
        if not out:
            return self._unstick()
        self._batch = out
        scheduled = out.scheduled
        cached = []
        for r, n in scheduled:
            c = r.num_computed_tokens
            # A wrong grant would compute past the request's tokens or nothing, step after step.
            if n < 1 or c + n > r.num_tokens:
                raise ValueError(grant_problem(self.policy, r, n))
            cached.append(c)
            if r.first_scheduled is None:
                r.first_scheduled = start
        t1 = time.perf_counter()
        tokens = self.executor.execute(scheduled, self.kv)
        if len(tokens) != len(scheduled):
            raise RuntimeError(f"{type(self.executor).__name__}.execute returned {len(tokens)} tokens for a batch "
                               f"of {len(scheduled)} requests (one entry each, None for a prefill chunk)")
        t2 = time.perf_counter()
        end = self.clock.now()
        finished = []
        sampled = 0
        for (r, n), tok in zip(scheduled, tokens):
            r.num_computed_tokens += n
            if tok is None:
                continue
            sampled += 1
            r.output_token_ids.append(tok)
            if r.streams_token_times:
                self._stream_time(r, end)
            else:
                r.token_times.append(end)
            reason = self._stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        usage = self.kv.usage()
        rec = StepRecord(
            len(self.steps), start, end - start, [r.req_id for r, _ in scheduled],
            [n for _, n in scheduled], cached, len(out.preempted), usage.reserved_slots,
            usage.live_tokens, len(self.policy.waiting), sampled, len(self.policy.running))
        self.steps.append(rec)
        timings = self.timings
        timings["schedule"] += t1 - t0
        timings["execute"] += t2 - t1
        timings["update"] += time.perf_counter() - t2
        return finished

    def _is_stop_token(self, r: Request, tok: int) -> bool:
        return tok in r.sampling.stop_token_ids or (not r.sampling.ignore_eos and tok in self.eos_token_ids)

    def _stop_reason(self, r: Request, tok: int) -> FinishReason | None:
        if self._is_stop_token(r, tok):
            return FinishReason.STOP
        sp = r.sampling
        n_out = len(r.output_token_ids)
        if n_out >= sp.max_tokens or r.num_prompt_tokens + n_out >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _unstick(self) -> list[Request]:
        """Nothing could be scheduled: with nothing running, the queue's head can never run; abort it."""
        if self.policy.running or not self.policy.waiting:
            return []
        head = self.policy.waiting[0]
        detail = (f"({head.num_pending} tokens to compute, {self.kv.usage().free_slots} free KV slots, budget "
                  f"{self.policy.max_num_batched_tokens} tokens)")
        self._check_unstreamed(head, f"scheduler {self.policy.name} left it unscheduled on an idle engine though "
                                     f"it fits the KV pool {detail}")
        self._finish(head, FinishReason.ABORTED, f"could not be scheduled on an idle engine {detail}")
        return [head]

    def run(self, requests: Iterable[Request] = (), on_step: Callable[[list[Request]], None] | None = None) -> None:
        """Replay `requests` by arrival time (0 = at once) until every one has ended; `steps` holds
        this run's steps. On an error or interrupt every unfinished request ends `aborted` first."""
        reqs = list(requests)
        for r in reqs:
            if not math.isfinite(r.arrival):  # would never arrive, or hang the replay
                r.finish(FinishReason.REJECTED, self.clock.now(),
                         f"request {r.req_id!r}: arrival={r.arrival}: must be a finite time (0 = now)")
        pending = deque(sorted((r for r in reqs if not r.is_finished), key=lambda r: r.arrival))
        self.steps = StepLog()
        try:
            while pending or self.has_unfinished():
                now = self.clock.now()
                while pending and pending[0].arrival <= now:
                    self.add_request(pending[0], now)
                    pending.popleft()
                if not self.has_unfinished():
                    if pending:
                        self.clock.sleep_until(pending[0].arrival)
                    continue
                finished = self.step(now)
                if on_step is not None:
                    on_step(finished)
        except BaseException as err:
            self._fail(list(self.requests.values()), err, "the run stopped")
            now = self.clock.now()
            for r in pending:  # never arrived: ended at their arrival, the run being gone
                if not r.is_finished:
                    r.finish(FinishReason.ABORTED, max(now, r.arrival),
                             _error_message("the run stopped before this request arrived", err))
            raise
        for r in reqs:
            if r.status is not Status.FINISHED:
                raise AssertionError(f"request {r.req_id} left unfinished")


#: Gaps (distinct neighbours) a streaming engine holds before handing them to its sink (Final:
#: compiled, a constant rather than a module lookup per gap).
GAP_BATCH: Final = 4096


def grant_problem(policy: SchedulerPolicy, req: Request, n: int) -> str:
    """The one line refusing a policy's grant of `n` tokens to `req` (a step computes 1 to its pending tokens)."""
    pending = req.num_tokens - req.num_computed_tokens
    return (f"policy {type(policy).__name__} scheduled {n} tokens for request {req.req_id!r}, which has {pending} "
            f"to compute: a grant is 1 to {pending} tokens (SchedulerOutput.scheduled)")


def _error_message(what: str, err: BaseException) -> str:
    detail = str(err)
    return f"{what}: {type(err).__name__}: {detail}" if detail else f"{what}: {type(err).__name__}"
