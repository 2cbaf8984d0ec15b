"""A replica whose count of unfinished requests cannot change before an arrival is left where it is
(FastForwardEngine.count_horizon, sim/simulator.py's _lazy_loop): a `least_outstanding` fleet then
decodes in long stretches, with the reference loop's results bit for bit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.clock import SimClock
from varlen.kv import PagedAllocator
from varlen.kv.windowed import WindowedPagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.steplog import StepLog, StepRecord
from varlen.testing.fast_forward import assert_same, factory, shared_prefix_requests


class Counting(FastForwardEngine):
    calls = 0

    def step(self, start=None, until=None):
        self.calls += 1
        return super().step(start, until)


def counting(base):
    def make(clock):
        eng, ex = base(clock)
        return Counting(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex
    return make


def test_a_least_outstanding_fleet_decodes_in_stretches():
    """Arrivals far more frequent than one replica's steps: the reference loop cuts every replica's
    decodes at every arrival; the lazy loop advances a replica only when it is chosen or may have
    finished a request."""
    make = counting(factory("chunked", "paged", 2000))
    reqs = shared_prefix_requests(240, rate=300.0, seed=11)
    ref = simulate(fresh_copies(reqs), make, num_replicas=16, router="least_outstanding", lazy=False)
    lazy = simulate(fresh_copies(reqs), make, num_replicas=16, router="least_outstanding")
    assert_same(ref, lazy)
    ref_calls = sum(r.engine.calls for r in ref.replicas)
    lazy_calls = sum(r.engine.calls for r in lazy.replicas)
    assert lazy_calls < 0.5 * ref_calls, (lazy_calls, ref_calls)


@pytest.mark.parametrize("allocator", ["paged", "paged-cache", "contiguous-pow2"])
def test_horizons_cut_short_by_a_small_pool_change_nothing(allocator):
    """A pool too small for the decodes' growth: horizons end where an allocation may fail (then the
    policy preempts), and the results stay the reference loop's."""
    make = factory("chunked", allocator, 90)
    reqs = shared_prefix_requests(160, rate=300.0, seed=3)
    ref = simulate(fresh_copies(reqs), make, num_replicas=3, router="least_outstanding", lazy=False)
    lazy = simulate(fresh_copies(reqs), make, num_replicas=3, router="least_outstanding")
    assert_same(ref, lazy)
    if allocator.startswith("paged"):
        assert sum(r.engine.num_preemptions for r in lazy.replicas) > 0


def test_the_horizon_is_the_start_of_the_first_finishing_step():
    """One replica, four decodes: the count holds until the step that ends the shortest one starts,
    and the horizon is exactly that step's start."""
    make = factory("chunked", "paged", 400)
    reqs = [Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=m, ignore_eos=True), arrival=0.0)
            for i, m in enumerate((30, 12, 50, 19))]
    res = simulate(reqs, make, lazy=False, fast_forward=False)
    starts = [s.start for s in res.replicas[0].engine.steps]
    first_end = min(r.finish_time for r in reqs)
    finishing = max(t for t in starts if t < first_end)  # the step that ended r1 started there

    clock = SimClock()
    eng, _ = make(clock)
    for r in (Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=m, ignore_eos=True))
              for i, m in enumerate((30, 12, 50, 19))):
        eng.add_request(r)
    eng.step(0.0)  # the prefills (and each request's first token)
    assert eng.count_horizon() == finishing
    assert eng.count_horizon() > clock.now()


def four_decodes(make):
    """An engine past its prefills with four decodes ahead (max_tokens 30, 12, 50, 19)."""
    clock = SimClock()
    eng, _ = make(clock)
    for i, m in enumerate((30, 12, 50, 19)):
        eng.add_request(Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=m, ignore_eos=True)))
    eng.step(0.0)
    return eng, clock


def test_a_bounded_horizon_timed_further_is_the_whole_one():
    """count_horizon(bound) times `bound` steps: a lower bound (horizon_bound says how far to time next);
    timed further, doubling, it ends exactly at the horizon timed whole, the engine left where it was."""
    make = factory("chunked", "paged", 400)
    eng, clock = four_decodes(make)
    whole = eng.count_horizon()
    assert eng.horizon_bound == 0
    now, steps = clock.now(), len(eng.steps)
    bound, answers = 2, []
    while bound:
        answers.append(eng.count_horizon(bound))
        assert (bound, eng.horizon_bound) in ((2, 4), (4, 8), (8, 16), (16, 0))  # 12 tokens: 10 steps ahead
        bound = eng.horizon_bound
    assert clock.now() < answers[0] < answers[1] < answers[2] < whole == answers[-1]
    assert (clock.now(), len(eng.steps)) == (now, steps)
    # A bound at or past the stretch's end: the whole horizon at once.
    assert eng.count_horizon(10) == whole and eng.horizon_bound == 0


class WholeHorizons(CostModelExecutor):
    """The same steps, times and decode runs; only not CostModelExecutor itself, so every horizon is
    timed whole (times_prefixes is False), as before bounded horizons."""


class Bounded(FastForwardEngine):
    bounded = 0
    calls = 0

    def count_horizon(self, bound=0):
        h = super().count_horizon(bound)
        self.bounded += self.horizon_bound > 0
        return h

    def step(self, start=None, until=None):
        self.calls += 1
        return super().step(start, until)


def bounded(base, executor):
    def make(clock):
        eng, _ = base(clock)
        ex = executor(eng.executor.cost, clock)
        return Bounded(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex
    return make


def test_bounded_horizons_catch_replicas_up_at_the_same_arrivals():
    """A fleet whose horizons are timed in bounded pieces advances each replica at the very arrivals
    (the same step calls, the same decode runs in the step log) as one whose horizons are timed whole."""
    base = factory("chunked", "paged", 2000)
    reqs = shared_prefix_requests(240, rate=300.0, seed=11)
    whole = simulate(fresh_copies(reqs), bounded(base, WholeHorizons), num_replicas=16, router="least_outstanding")
    pieces = simulate(fresh_copies(reqs), bounded(base, CostModelExecutor), num_replicas=16,
                      router="least_outstanding")
    assert_same(whole, pieces)
    assert [r.engine.calls for r in whole.replicas] == [r.engine.calls for r in pieces.replicas]
    assert sum(r.engine.bounded for r in whole.replicas) == 0
    assert sum(r.engine.bounded for r in pieces.replicas) > 0


def paged_state(draw, cls, caching: bool):
    """A small pool with requests holding blocks: (allocator, requests, counts)."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    kw = {"sliding_window": draw(st.integers(4, 64))} if cls is WindowedPagedAllocator else {}
    kv = cls(num_blocks=draw(st.integers(1, 24)), block_size=bs, enable_prefix_caching=caching, **kw)
    reqs, counts = [], []
    for i in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 40))
        r = Request(f"q{i}", [(i * 7 + j) % 50 + 1 for j in range(n)], SamplingParams(max_tokens=200))
        if kv.allocate(r, n):
            r.num_computed_tokens = n
            reqs.append(r)
            counts.append(n)
    return kv, reqs, counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([PagedAllocator, WindowedPagedAllocator]), st.booleans(), st.integers(1, 60))
def test_decode_steps_fit_is_what_the_calls_do(data, cls, caching, num_steps):
    """decode_steps_fit answers without side effects: the paged allocator's answer is exactly the
    steps whose decode allocations succeed, the windowed one's (it also frees) a lower bound."""
    kv, reqs, counts = paged_state(data.draw, cls, caching)
    if not reqs:
        return
    before = (kv.free_stack(), dict(kv.free_cached), {k: list(v) for k, v in kv.tables.items()})
    fit = kv.decode_steps_fit(reqs, counts, num_steps)
    assert (kv.free_stack(), dict(kv.free_cached), {k: list(v) for k, v in kv.tables.items()}) == before
    done = num_steps
    for j in range(num_steps):
        ok = True
        for p, r in enumerate(reqs):
            r.num_computed_tokens = counts[p] + j
            if not kv.allocate(r, counts[p] + j + 1):
                ok = False
                break
        if not ok:
            done = j
            break
    assert fit == done if cls is PagedAllocator else fit <= done


def test_the_batch_limits_are_read_again_after_a_step_or_for_another_batch():
    """_base_and_limit answers a repeated question about the same batch from its last answer (the
    horizon's doubling calls, then the decode run) until a step is recorded, the batch differs or
    the engine's step log is replaced: each answer is what the requests hold at that moment."""
    make = factory("chunked", "paged", 400)
    eng, clock = four_decodes(make)

    def fresh(batch):
        return ([r.num_computed_tokens for r in batch],
                min(eng._steps_to_limit(batch, [len(r.output_token_ids) for r in batch])))

    batch = eng.policy.next_decode_batch()
    first = eng._base_and_limit(batch)
    assert first == fresh(batch) and first[1] == 11  # r1: 12 tokens, 1 sampled by the prefill step
    again = eng._base_and_limit(eng.policy.next_decode_batch())  # an equal list, asked again
    assert again[0] is first[0]  # kept, not read again
    assert eng._base_and_limit(batch[1:]) == fresh(batch[1:])  # another batch: read afresh
    eng.step(clock.now(), clock.now() + 1e-9)  # one step (its decode run cut at once)
    assert len(eng.steps) > 1
    batch = eng.policy.next_decode_batch()
    after = eng._base_and_limit(batch)
    assert after == fresh(batch) and after[0] != first[0]
    at = len(eng.steps)
    eng.steps = StepLog()  # a new log of the same length: its answers are its own
    for i in range(at):
        eng.steps.append(StepRecord(i, 0.0, 0.1, ["x"], [1], [0], 0, 16, 1, 0, 1, 1))
    assert len(eng.steps) == at and eng._base_and_limit(batch)[0] is not after[0]


def test_the_engine_reads_whichever_clock_it_holds():
    """Engine._now reads the SimClock natively, and a clock put in its place afterwards is the one read."""
    make = factory("chunked", "paged", 400)
    eng, clock = four_decodes(make)
    assert eng._now() == clock.now() > 0.0
    later = SimClock(clock.now() + 5.0)
    eng.clock = later
    clock.advance(1.0)  # the clock it was built with no longer speaks for it
    assert eng._now() == later.now() != clock.now()
