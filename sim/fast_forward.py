"""The simulator's decode fast-forward: a stretch of repeating pure-decode steps run in one go.

The simulator knows the next arrival, so `FastForwardEngine` times the stretch in one call and
logs one `DecodeRun`, with the same results step for step (tests/sim/test_sim_fastforward.py).
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Callable, Final, Sequence

from mypy_extensions import mypyc_attr

from varlen.engine import Engine, Executor, grant_problem
from varlen.kv.base import ALLOCATION_PROMISE_BEHAVIOUR, KVAllocator
from varlen.kv.growth import DecodeGrowth
from varlen.kv.paged import PagedAllocator
from varlen.promises import keeps_promise
from varlen.request import FinishReason, Request
from varlen.scheduler_api import DECODE_PROMISE_BEHAVIOUR, SchedulerPolicy
from varlen.steplog import DecodeRun, StepLog, StepRecord

#: Final: compiled, read from a C static rather than looked up in the module's dict at every step.
_perf_counter: Final[Callable[[], float]] = time.perf_counter


@mypyc_attr(allow_interpreted_subclasses=True)
class FastForwardExecutor(Executor):
    """An executor that may time many pure-decode steps in one call (the simulator's cost model)."""

    def decode_run(self, batch: Sequence[Request], max_steps: int, until: float) -> tuple[int, list[float]] | None:
        """Time up to `max_steps` pure-decode steps of `batch` starting before `until`: (tokens, step ends);
        the clock is not moved, nothing else changes (the simulator also asks it ahead of the steps, for
        a replica's horizon). None: this executor steps one at a time."""
        return None

    def times_prefixes(self) -> bool:
        """Whether decode_run(batch, m, until) times exactly the first m steps decode_run(batch, n, until)
        times for n > m, with the same token (count_horizon may then time a stretch in pieces)."""
        return False

    def idle_past_until(self) -> bool:
        """Whether decode_run(batch, m, until) with the clock at or past `until` times no step and changes nothing
        a result depends on, so FastForwardEngine need not ask it then. Only a class whose decode_run is exactly that."""
        return False

    def fuses_steps(self) -> bool:
        """Whether FastForwardEngine may run execute() inline: sum the batch itself and call advance_step
        (same clock, same tokens, nothing else changed). Only a class whose execute() is exactly that."""
        return False

    def advance_step(self, num_seqs: int, new: int, cached: int, new_cached: int, new_sq: int, num_logits: int,
                     num_prefills: int) -> int:
        """execute() of a batch with these sums (new: sum of new tokens, new_cached: of new x cached, new_sq:
        of new squared; num_logits: requests that sample; num_prefills: with more than one new token):
        moves the clock, returns the token every sampling request samples (fuses_steps)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse steps (fuses_steps() is False)")


@mypyc_attr(allow_interpreted_subclasses=True)
class FastForwardEngine(Engine):
    """The engine loop, plus: `step(start, until)` follows a step with the pure-decode steps the
    policy promises, up to `until`, when the allocator's and executor's promises hold."""

    def __init__(self, policy: SchedulerPolicy, kv: KVAllocator, executor: Executor, clock=None, max_model_len: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, vocab_size: int | None = None):
        super().__init__(policy, kv, executor, clock, max_model_len, eos_token_id, vocab_size)
        self.num_fast_forwarded_steps = 0  # steps run by _decode_run rather than one by one
        self._decode_promises = -1  # whether the allocator's and executor's promises are their own (-1: not checked)
        self._growth: DecodeGrowth | None = None  # the allocator, if it has DecodeGrowth's methods
        # The allocator, where its grow_decodes, decode_steps_fit and usage are PagedAllocator's: asked with the
        # counts read off the requests (grow_running, running_steps_fit), no list of them built per run, and
        # its step figures read without a KVUsage (reserved_slots, live_tokens).
        self._pool: PagedAllocator | None = None
        self._fits = -1  # whether the allocator's decode_steps_fit is its own class's (-1: not checked)
        self._fused = -1  # whether _step runs the executor inline (_fuses; -1: not checked)
        self._own_rules = -1  # whether the stop rule and step limits are this module's own (_rules_own; -1: not checked)
        # Whether a decode run from the clock's now at or past `until` is known to time nothing: the run's
        # methods and stop rules are this class's and the executor says so (idle_past_until; _promises_kept decides).
        self._own_run = -1
        self.horizon_bound = 0  # count_horizon's last answer a lower bound: the steps to time next; 0: exact
        # _base_and_limit's last answer, its batch and the step log and count it was read at: a step is the
        # one thing that changes a running request's counts, and count_horizon, timing further in doubling
        # pieces, then the decode run itself, ask again of the same batch.
        self._limits_log: StepLog | None = None
        self._limits_at = -1
        self._limits_batch: list[Request] = []
        self._limits_base: list[int] | None = None  # built when first asked (_base_and_limit)
        self._limits_min = 0
        self._limits_stops = False  # whether a token may stop a request of that batch (else none ever does)
        # The policy's last next_decode_batch answer and what it was read at (_decode_batch): asked up to three
        # times between two steps (after a step, for the horizon, before the next step), it changes only with
        # a step, a finish or an admission. -1: whether the policy's behaviour is SchedulerPolicy's not checked.
        self._own_batch = -1
        self._batch_log: StepLog | None = None
        self._batch_at = -1
        self._batch_running: list[Request] | None = None
        self._batch_len = -1
        self._batch_memo: list[Request] | None = None

    def _decode_batch(self) -> list[Request] | None:
        """policy.next_decode_batch(); its last answer again while nothing it reads can have changed: no step
        logged since, the same running list of the same length, nothing waiting then or now. Only for a policy
        whose every behaviour method is SchedulerPolicy's (DECODE_PROMISE_BEHAVIOUR); another is asked each time."""
        policy = self.policy
        if self._own_batch < 0:
            cls = type(policy)
            self._own_batch = int(all(getattr(cls, m) is getattr(SchedulerPolicy, m) for m in DECODE_PROMISE_BEHAVIOUR))
        if not self._own_batch:
            return policy.next_decode_batch()
        log, running = self.steps, policy.running
        if policy.waiting:
            self._batch_at = -1
            return policy.next_decode_batch()
        if (len(log) == self._batch_at and log is self._batch_log and running is self._batch_running
                and len(running) == self._batch_len):
            return self._batch_memo
        batch = policy.next_decode_batch()
        self._batch_log, self._batch_at, self._batch_running, self._batch_len = log, len(log), running, len(running)
        self._batch_memo = batch
        return batch

    def _fuses(self) -> bool:
        """Whether _step may fuse Engine._step's loops with the executor's: the executor offers it
        (fuses_steps) and the engine's stop rule is Engine's own (a subclass's is called as it is)."""
        ex, cls = self.executor, type(self)
        return (isinstance(ex, FastForwardExecutor) and ex.fuses_steps()
                and cls._stop_reason is Engine._stop_reason and cls._is_stop_token is Engine._is_stop_token)

    def _rules_own(self) -> bool:
        """Whether the stop rule (Engine's _stop_reason, _is_stop_token) and _steps_to_limit are this
        module's own, so decode runs may apply them inline (a subclass's are called as they are)."""
        if self._own_rules < 0:
            cls = type(self)
            self._own_rules = int(cls._stop_reason is Engine._stop_reason and cls._is_stop_token is Engine._is_stop_token
                                  and cls._steps_to_limit is FastForwardEngine._steps_to_limit)
        return self._own_rules > 0

    def _limit(self, batch: Sequence[Request]) -> int:
        """min(_steps_to_limit) of `batch` in one pass (own rules only), kept for the next caller asking of the
        same batch before a step. Also sets _limits_stops: whether any of them has a stop token (its own, or
        EOS unless it ignores EOS)."""
        log = self.steps
        at = len(log)
        if at == self._limits_at and log is self._limits_log and batch == self._limits_batch:
            return self._limits_min
        reqs: list[Request] = batch if isinstance(batch, list) else list(batch)
        max_len = self.max_model_len
        eos = len(self.eos_token_ids) > 0
        stops = False
        limit = 0
        first = True
        for r in reqs:
            sp = r.sampling
            s = max_len - r.num_prompt_tokens  # min(max_tokens - n, max_len - prompt - n), n subtracted once
            if sp.max_tokens < s:
                s = sp.max_tokens
            s -= len(r.output_token_ids)
            if s < limit or first:
                limit, first = s, False
            if not stops and (sp.stop_token_ids or (eos and not sp.ignore_eos)):
                stops = True
        self._limits_stops = stops
        self._limits_log, self._limits_at, self._limits_batch = log, at, reqs
        self._limits_base, self._limits_min = None, limit
        return limit

    def _base_and_limit(self, batch: Sequence[Request]) -> tuple[list[int], int]:
        """(each request's computed tokens, _limit(batch)); the list is shared with the next caller asking of
        the same batch before a step (not to be changed)."""
        limit = self._limit(batch)
        base = self._limits_base
        if base is None:
            base = self._limits_base = [r.num_computed_tokens for r in self._limits_batch]
        return base, limit

    def _kv_figures(self) -> tuple[int, int]:
        """The pool's (reserved slots, live tokens), as kv.usage() gives them; a PagedAllocator's own usage()
        is read without building a KVUsage (the step log takes both at every step and run)."""
        pool = self._pool
        if pool is not None:
            return pool.reserved_slots(), pool.live_tokens
        usage = self.kv.usage()
        return usage.reserved_slots, usage.live_tokens

    def _any_stop_token(self, batch: Sequence[Request], tok: object) -> bool:
        """any(Engine._is_stop_token(r, tok) for r in batch), inline (own rules only); `tok` boxed once."""
        reqs: list[Request] = batch if isinstance(batch, list) else list(batch)
        eos = tok in self.eos_token_ids
        for r in reqs:
            sp = r.sampling
            if (eos and not sp.ignore_eos) or (sp.stop_token_ids and tok in sp.stop_token_ids):
                return True
        return False

    def _step(self, start: float) -> list[Request]:
        """Engine._step; with a fusing executor, its loops and the executor's in two passes over the batch
        (the same calls to the policy, allocator and cost model, the same results and step log)."""
        if self._fused < 0:
            self._fused = int(self._fuses())
        if not self._fused:
            return super()._step(start)
        t0 = _perf_counter()
        policy, kv = self.policy, self.kv
        out = policy.schedule(kv)
        ex = self.executor
        assert isinstance(ex, FastForwardExecutor)
        for r in out.preempted:
            ex.release(r)
        self.num_preemptions += len(out.preempted)
        if not out:
            return self._unstick()
        self._batch = out
        # The leading decodes a shipped policy hands over in bulk (one token each, no tuples), then the rest.
        bulk = out.decodes
        decodes: list[Request] = [] if bulk is None else bulk
        rest = out.rest()
        nd = len(decodes)
        size = nd + len(rest)
        steps = self.steps
        detail = steps.reads_batches()  # else the log reads the step's figures only (append_step)
        cached: list[int] = []
        tc = 0
        for r in decodes:
            c = r.num_computed_tokens
            if c + 1 > r.num_prompt_tokens + len(r.output_token_ids):
                raise ValueError(grant_problem(policy, r, 1))
            if detail:
                cached.append(c)
            if r.first_scheduled is None:
                r.first_scheduled = start
            tc += c
        samples: list[bool] = []  # whether each entry of `rest` samples, as execute() decides it
        tn = tnn = sampled = nd  # each decode: one new token, and it samples
        tnc = tc
        prefills = 0
        for r, n in rest:
            c = r.num_computed_tokens
            total = r.num_prompt_tokens + len(r.output_token_ids)
            # A wrong grant would compute past the request's tokens or nothing, step after step.
            if n < 1 or c + n > total:
                raise ValueError(grant_problem(policy, r, n))
            if detail:
                cached.append(c)
            if r.first_scheduled is None:
                r.first_scheduled = start
            tn += n
            tc += c
            tnc += n * c
            tnn += n * n
            if n > 1:
                prefills += 1
            last = c + n == total
            samples.append(last)
            if last:
                sampled += 1
        t1 = _perf_counter()
        tok = ex.advance_step(size, tn, tc, tnc, tnn, sampled, prefills)
        t2 = _perf_counter()
        end = self._now()
        finished = []
        stop = FinishReason.STOP
        length = FinishReason.LENGTH
        tok_obj: Any = tok  # boxed once for the outputs and membership tests, not once a request
        eos = tok_obj in self.eos_token_ids
        max_len = self.max_model_len
        for i in range(size):
            if i < nd:
                r = decodes[i]
                r.num_computed_tokens += 1
            else:
                r, n = rest[i - nd]
                r.num_computed_tokens += n
                if not samples[i - nd]:
                    continue
            outs: list[Any] = r.output_token_ids
            outs.append(tok_obj)
            if r.streams_token_times:  # Engine._stream_time, inline
                nt = r.num_token_times
                if nt:
                    gap = end - r.last_token_time
                    if gap > r.max_token_gap:
                        r.max_token_gap = gap
                    if gap == self._gap_last:
                        self._gap_run += 1
                    else:
                        self._count_gap(gap, 1)
                else:
                    r.first_token_time = end
                r.last_token_time = end
                r.num_token_times = nt + 1
            else:
                r.token_times.append(end)
            sp = r.sampling
            n_out = len(outs)
            # Engine._stop_reason, inline.
            if (sp.stop_token_ids and tok_obj in sp.stop_token_ids) or (eos and not sp.ignore_eos):
                self._finish(r, stop)
            elif n_out >= sp.max_tokens or r.num_prompt_tokens + n_out >= max_len:
                self._finish(r, length)
            else:
                continue
            finished.append(r)
        reserved, live = self._kv_figures()
        if detail:
            ids = [r.req_id for r in decodes]
            ids += [r.req_id for r, _ in rest]
            new = [1] * nd
            new += [n for _, n in rest]
            steps.append(StepRecord(
                len(steps), start, end - start, ids, new, cached, len(out.preempted), reserved,
                live, len(policy.waiting), sampled, len(policy.running)))
        else:
            steps.append_step(start, end - start, size, reserved, live, len(policy.waiting))
        timings = self.timings
        timings["schedule"] += t1 - t0
        timings["execute"] += t2 - t1
        timings["update"] += _perf_counter() - t2
        return finished

    def step(self, start: float | None = None, until: float | None = None) -> list[Request]:
        """The pure-decode steps the policy promises from `start` up to `until`, else one step and
        then those (until None: exactly Engine.step). A failure there aborts every running request."""
        before, preemptions = len(self.steps), self.num_preemptions
        now = self._now() if until is not None else 0.0
        if until is not None and (start is None or start == now) and now < until:
            # A run cut short at `until` resumes as a run: no full step between two stretches of decodes.
            batch = self._decode_batch()
            if batch and self._promises_kept():
                finished = self._timed_decode_run(batch, until)
                if len(self.steps) != before:
                    return finished
        finished = super().step(start)
        if until is None or len(self.steps) == before or self.num_preemptions != preemptions:
            return finished  # no step recorded (nothing schedulable), or it preempted: no promise
        batch = self._decode_batch()
        if not batch or not self._promises_kept():
            return finished
        if self._own_run > 0 and self._now() >= until:
            return finished  # the step ended at or past `until`: a run would time no step (idle_past_until)
        return finished + self._timed_decode_run(batch, until)

    def count_horizon(self, bound: int = 0) -> float:
        """With no arrival, the start of the first step that may end a request or leave the promised
        decodes (a finish, a stop token, an allocation that may fail): the count of unfinished requests
        holds for every step starting before it. The clock's now when that is not known.
        bound > 0, and an executor whose shorter runs time the first steps of longer ones
        (times_prefixes): at most `bound` steps are timed; when that cut the stretch, the end of the
        last one is returned, a lower bound, and horizon_bound says how far to time next (else 0)."""
        self.horizon_bound = 0
        now = self._now()
        batch = self._decode_batch()
        if not batch or not self._promises_kept() or self._fits < 1:
            return now
        own = self._rules_own()
        if own:
            k = self._limit(batch)
        else:
            k = min(self._steps_to_limit(batch, [len(r.output_token_ids) for r in batch]))
        if k <= 1:
            return now
        ex = self.executor
        assert isinstance(ex, FastForwardExecutor)
        pool = self._pool
        try:
            if pool is not None:
                fits = pool.running_steps_fit(batch, k)
            else:
                fits = self.kv.decode_steps_fit(batch, self._base_and_limit(batch)[0] if own
                                                else [r.num_computed_tokens for r in batch], k)
            n = k
            if 0 < bound < min(k - 1, fits) and ex.times_prefixes():
                n = bound  # a shorter run first: its steps are the longer one's first steps
            while True:
                run = ex.decode_run(batch, n, math.inf)
                if run is None:
                    return now
                tok, ends = run
                if (self._limits_stops and self._any_stop_token(batch, tok) if own
                        else any(self._is_stop_token(r, tok) for r in batch)):
                    return now
                if n < k:
                    if len(ends) == n:  # cut by the bound: the whole run's horizon is at least this
                        self.horizon_bound = 2 * n
                        return ends[n - 1]
                    n = k  # the executor stopped on its own: the whole run decides
                    continue
                j = min(k - 1, len(ends), fits)
                return ends[j - 1] if j > 0 else now
        except Exception:  # raised again by the step itself, when the replica gets there
            return now

    def _steps_to_limit(self, batch: Sequence[Request], n_out: list[int]) -> list[int]:
        """Each request's decode steps until max_tokens or max_model_len ends it (`n_out`: its outputs so far)."""
        max_len = self.max_model_len
        return [min(r.sampling.max_tokens - n, max_len - r.num_prompt_tokens - n) for r, n in zip(batch, n_out)]

    def _timed_decode_run(self, batch: list[Request], until: float) -> list[Request]:
        t0 = _perf_counter()
        try:
            finished = self._decode_run(batch, until)
        except BaseException as err:
            self._fail(list(self.policy.running), err, f"step {len(self.steps)} failed")
            raise
        self.timings["decode_run"] += _perf_counter() - t0
        return finished

    def _promises_kept(self) -> bool:
        """The allocator's and executor's decode promises are their own classes', and the stop rule the
        decode runs apply (limits, the run's one token) is Engine's (varlen/promises.py)."""
        if self._decode_promises < 0:
            kv, ex = self.kv, self.executor
            kept = [keeps_promise(kv, ("next_allocation_event", "grow_decodes"), ALLOCATION_PROMISE_BEHAVIOUR,
                                  KVAllocator),
                    isinstance(ex, FastForwardExecutor)
                    and keeps_promise(ex, "decode_run", ("execute",), FastForwardExecutor),
                    keeps_promise(self, "_decode_run", ("_stop_reason", "_is_stop_token"), Engine)]
            self._decode_promises = int(all(kept))
            self._fits = int(all(kept) and keeps_promise(kv, "decode_steps_fit", (*ALLOCATION_PROMISE_BEHAVIOUR,
                             "next_allocation_event", "grow_decodes"), KVAllocator))
            self._growth = kv if isinstance(kv, DecodeGrowth) else None
            self._pool = None
            if isinstance(kv, PagedAllocator) and self._growth is not None:
                kv_cls = type(kv)
                if (kv_cls.grow_decodes is PagedAllocator.grow_decodes
                        and kv_cls.decode_steps_fit is PagedAllocator.decode_steps_fit
                        and kv_cls.usage is PagedAllocator.usage and kv_cls.num_free_plain is PagedAllocator.num_free_plain):
                    self._pool = kv
            cls = type(self)
            self._own_run = int(isinstance(ex, FastForwardExecutor) and ex.idle_past_until() and self._rules_own()
                                and cls._timed_decode_run is FastForwardEngine._timed_decode_run
                                and cls._decode_run is FastForwardEngine._decode_run
                                and cls._decode_segment is FastForwardEngine._decode_segment)
        return self._decode_promises > 0

    def _decode_run(self, batch: list[Request] | None, until: float) -> list[Request]:
        """The promised pure-decode steps, as step() would run them, until `until` or a failed allocation."""
        finished: list[Request] = []
        while batch:
            done, go_on = self._decode_segment(batch, until)
            finished += done
            if not go_on:
                break
            batch = self._decode_batch()
        return finished

    def _decode_segment(self, batch: list[Request], until: float) -> tuple[list[Request], bool]:
        """Steps of `batch` up to its first finish: (the finished requests, whether a next step still
        starts before `until`); a failed allocation ends the segment before its step (the policy preempts)."""
        own = self._rules_own()
        n_out: list[int] = []
        stop_at: list[int] = []
        stops = True  # whether a token may stop a request of the batch
        base: list[int] | None = None  # each request's computed tokens, read where needed
        if own:  # the limits' minimum only; who reaches a limit is read off the counts after the steps
            limit = self._limit(batch)
            stops = self._limits_stops
        else:
            base = [r.num_computed_tokens for r in batch]
            n_out = [len(r.output_token_ids) for r in batch]
            stop_at = self._steps_to_limit(batch, n_out)
            limit = min(stop_at)
        ex = self.executor
        assert isinstance(ex, FastForwardExecutor)
        run = ex.decode_run(batch, limit, until)
        if run is None:
            return [], False
        tok, ends = run
        k = len(ends)
        if k > 1 and stops and (self._any_stop_token(batch, tok) if own
                                else any(self._is_stop_token(r, tok) for r in batch)):
            k = 1
        if k == 0:
            return [], False
        kv = self.kv
        growth, pool = self._growth, self._pool
        reserved, live_before = self._kv_figures()
        changed: dict[int, int] = {}  # run step -> reserved slots after its allocations
        failed = False
        steps = self.steps
        if pool is not None:
            bulk = pool.grow_running(batch, k)
        else:
            if base is None:
                base = self._base_and_limit(batch)[0]
            bulk = growth.grow_decodes(batch, base, k) if growth is not None else None
        if base is None and (bulk is None or steps.reads_batches()):
            base = self._base_and_limit(batch)[0]  # before the counts move (no allocation changes them)
        asked: list[int] = []
        if bulk is not None:
            ok, changed = bulk
            if ok < k:
                k, failed = ok, True
        else:
            assert base is not None
            asked = base[:]
            if own:
                n_out = [len(r.output_token_ids) for r in batch]
            k, failed = self._decode_allocations(batch, base, n_out, tok, k, changed, asked)
        if k == 0:
            return [], False
        times = ends[:k] if k < len(ends) else ends
        # Every request streamed (the common case), none (no stream_token_times), or a mix: those that
        # keep their token times (Engine.add_request decides) extend their lists.
        keep = self._gap_sink is None or self._stream_run(batch, times) < len(batch)
        if bulk is not None:
            tok_obj: object = tok  # boxed once
            toks = [tok_obj] * k if k > 1 else []
            for r in batch:
                r.num_computed_tokens += k
                outs: list[Any] = r.output_token_ids
                if k == 1:  # a third of the runs: an append costs a fifth of an extend
                    outs.append(tok_obj)
                else:
                    outs.extend(toks)
                if keep and not r.streams_token_times:
                    r.token_times.extend(times)
        else:
            assert base is not None
            for p, r in enumerate(batch):
                r.num_computed_tokens = base[p] + k
                missing = n_out[p] + k - len(r.output_token_ids)  # events may have added some
                if missing > 0:
                    r.output_token_ids.extend([tok] * missing)
                if keep and not r.streams_token_times:
                    r.token_times += times
                # Records the count, unless an event asked it (or more): a step-by-step run asks once.
                if asked[p] < base[p] + k and not kv.allocate(r, base[p] + k):
                    raise AssertionError(f"{type(kv).__name__}.next_allocation_event missed an event for {r.req_id!r}")
        start = self._now()
        c = self._sim_clock
        if c is not None and c is self.clock:
            c.sleep_until(times[-1])
        else:
            self.clock.sleep_until(times[-1])
        finished = []
        if own:
            # Engine._stop_reason, inline: a stop token only where k == 1 (a longer run has none); a length
            # limit where the request's own limit was k (its count now at max_tokens or max_model_len), so
            # none short of the batch's least limit, and no stop token where nobody has one: no finish.
            tok_obj = tok
            eos = tok_obj in self.eos_token_ids
            max_len = self.max_model_len
            stop, length = FinishReason.STOP, FinishReason.LENGTH
            stop_token = k == 1 and stops
            for r in (batch if k >= limit or stop_token else []):
                sp = r.sampling
                n = len(r.output_token_ids)
                if stop_token and (tok_obj in sp.stop_token_ids or (eos and not sp.ignore_eos)):
                    self._finish(r, stop)
                elif n >= sp.max_tokens or r.num_prompt_tokens + n >= max_len:
                    self._finish(r, length)
                else:
                    continue
                finished.append(r)
        else:
            for r in (batch if k == 1 else [r for r, s in zip(batch, stop_at) if s == k]):
                reason = self._stop_reason(r, tok)
                if reason is not None:
                    self._finish(r, reason)
                    finished.append(r)
        reserved_after: list[int] = []
        done = 0
        # PagedAllocator's grow_running lists the steps in order; another allocator's dict may not.
        for j in (sorted(changed) if len(changed) > 1 and (pool is None or bulk is None) else changed):
            if j < k:
                reserved_after += [reserved] * (j - done)
                reserved, done = changed[j], j
        reserved_after += [reserved] * (k - done)
        live_last = live_before + len(batch) * k
        if not failed:
            # After the finishes freed their blocks (a failed step's allocations are not the run's).
            reserved_after[-1], live_last = self._kv_figures()
        if steps.reads_batches():
            assert base is not None
            steps.append(DecodeRun(len(steps), start, times, [r.req_id for r in batch], base, reserved_after,
                                   live_before, live_last, len(self.policy.waiting), len(self.policy.running)))
        else:
            steps.append_run(start, times, len(batch), reserved_after, live_before, live_last, len(self.policy.waiting))
        self.num_fast_forwarded_steps += k
        return finished, bool(finished) and not failed and times[-1] < until

    def _stream_run(self, batch: list[Request], times: list[float]) -> int:
        """Every request of `batch` sampled at each of `times`; those that stream their token times: each
        one's gap into the run, then the run's own gaps, shared by all of them: O(batch + steps), not
        O(batch x steps). Returns how many streamed."""
        first, last, k = times[0], times[-1], len(times)
        run_max = 0.0  # the run's longest gap (k > 1)
        prev = first
        for j in range(1, k):
            t = times[j]
            gap = t - prev  # np.diff's subtraction, as on each request's timeline
            if j == 1 or gap > run_max:
                run_max = gap
            prev = t
        b = 0
        for r in batch:
            if not r.streams_token_times:
                continue
            b += 1
            n = r.num_token_times
            longest = r.max_token_gap
            if n:
                gap = first - r.last_token_time
                if gap > longest:
                    longest = gap
                if gap == self._gap_last:  # _count_gap(gap, 1), its common case inline
                    self._gap_run += 1
                else:
                    self._count_gap(gap, 1)
            else:
                r.first_token_time = first
            r.max_token_gap = run_max if k > 1 and run_max > longest else longest
            r.last_token_time = last
            r.num_token_times = n + k
        if b:
            prev = first
            for j in range(1, k):
                t = times[j]
                self._count_gap(t - prev, b)
                prev = t
        return b

    def _decode_allocations(self, batch: list[Request], base: list[int], n_out: list[int], tok: int, k: int,
                            changed: dict[int, int], asked: list[int]) -> tuple[int, bool]:
        """The event calls of k decode steps; fills `changed` (step -> reserved slots) and `asked`.
        Returns (steps whose calls all succeeded, whether one failed)."""
        kv, growth = self.kv, self._growth
        events = []
        for p, r in enumerate(batch):
            m = growth.next_allocation_event(r, base[p]) if growth is not None else base[p] + 1
            if m - base[p] - 1 < k:
                events.append((m - base[p] - 1, p, m))
        heapq.heapify(events)
        while events and events[0][0] < k:
            j, p, m = heapq.heappop(events)
            r = batch[p]
            r.num_computed_tokens = base[p] + j
            missing = n_out[p] + j - len(r.output_token_ids)
            if missing > 0:
                r.output_token_ids.extend([tok] * missing)
            if not kv.allocate(r, m):
                return j, True  # step j is the policy's to decide (it preempts)
            asked[p] = m
            m = growth.next_allocation_event(r, m) if growth is not None else m + 1
            if m - base[p] - 1 < k:
                heapq.heappush(events, (m - base[p] - 1, p, m))
            if not events or events[0][0] != j:
                changed[j] = kv.usage().reserved_slots
        return k, False
