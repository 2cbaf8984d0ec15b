"""Decode runs apply Engine's stop rule and FastForwardEngine's step limits inline (one pass over the
batch, no per-request lists) when the engine's class keeps them as they are; the results are those of
calling them request by request, and a subclass's own rule or limits are still called."""

from __future__ import annotations

import pytest

from sim.executor import SIM_TOKEN, CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.kv import PagedAllocator
from varlen.request import FinishReason, Request
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import ALLOCATORS, assert_same, factory, shared_prefix_requests, step_table


def rules(make, inline: bool):
    """`make` with the inline rules on, or off (each request's _stop_reason and _steps_to_limit called)."""

    def build(clock):
        eng, ex = make(clock)
        if not inline:
            eng._own_rules = 0
        return eng, ex

    return build


def mixed(n: int, seed: int) -> list[Request]:
    """Ends by max_tokens, by max_model_len, by EOS and by a stop token, in one trace."""
    out = []
    for i, r in enumerate(shared_prefix_requests(n, rate=80.0, seed=seed)):
        sp = r.sampling
        if i % 4 == 1:
            sp = SamplingParams(max_tokens=sp.max_tokens, ignore_eos=False)  # the engine's EOS is SIM_TOKEN
        elif i % 4 == 2:
            sp = SamplingParams(max_tokens=sp.max_tokens, stop_token_ids=[SIM_TOKEN], ignore_eos=True)
        elif i % 4 == 3:
            sp = SamplingParams(max_tokens=5000, ignore_eos=True)  # ends at max_model_len
        out.append(Request(r.req_id, r.prompt_token_ids, sp, arrival=r.arrival, priority=r.priority))
    return out


@pytest.mark.parametrize("eos", [None, SIM_TOKEN])
@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("policy", ["chunked", "vllm_v0", "sarathi"])
def test_inline_rules_equal_the_calls(policy, allocator, eos):
    """A pool small enough to preempt, a fleet read by its counts (horizons): the same requests, steps,
    allocator state and clocks with the rules inline as with each request's calls."""
    make = factory(policy, allocator, 150, max_model_len=640, eos=eos)
    reqs = mixed(100, seed=7)
    ref = simulate(fresh_copies(reqs), rules(make, False), num_replicas=3, router="least_outstanding")
    got = simulate(fresh_copies(reqs), rules(make, True), num_replicas=3, router="least_outstanding")
    assert all(r.engine._own_rules == 1 for r in got.replicas)
    assert all(r.engine._own_rules == 0 for r in ref.replicas)
    assert sum(r.engine.num_fast_forwarded_steps for r in got.replicas) > 0
    assert_same(ref, got)
    reasons = {r.finish_reason for r in got.requests}
    assert FinishReason.LENGTH in reasons and (eos is None or FinishReason.STOP in reasons)


class OwnLimits(FastForwardEngine):
    """A user's engine with its own step limits (every request ends after at most 7 tokens) and its
    own stop rule, declaring the decode-run promise itself: both must be called in decode runs."""

    limit_calls = 0
    stop_calls = 0

    def _steps_to_limit(self, batch, n_out):
        self.limit_calls += 1
        return [min(s, 7 - n) for s, n in zip(super()._steps_to_limit(batch, n_out), n_out)]

    def _stop_reason(self, r, tok):
        self.stop_calls += 1
        return FinishReason.LENGTH if len(r.output_token_ids) >= 7 else super()._stop_reason(r, tok)

    def _decode_run(self, batch, until):
        return super()._decode_run(batch, until)


def test_an_engine_with_its_own_limits_and_stop_rule_is_called():
    base = factory("chunked", "paged", 400)

    def make(clock):
        eng, ex = base(clock)
        return OwnLimits(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex

    res = simulate(fresh_copies(shared_prefix_requests(40, rate=20.0, seed=4)), make)
    eng = res.replicas[0].engine
    assert eng._own_rules == 0
    assert eng.num_fast_forwarded_steps > 0 and eng.limit_calls > 0 and eng.stop_calls > 0
    assert all(len(r.output_token_ids) <= 7 for r in res.requests)


class CountingRecords(PagedAllocator):
    """A user's allocator with its own count bookkeeping: grow_decodes must go through it."""

    records_in_runs = 0
    _growing = False
    decode_steps_fit = PagedAllocator.decode_steps_fit  # its promise kept: horizons go on as they did

    def _record_count(self, req_id, num_tokens):
        self.records_in_runs += self._growing
        super()._record_count(req_id, num_tokens)

    def grow_decodes(self, reqs, counts, num_steps):
        self._growing = True
        try:
            return super().grow_decodes(reqs, counts, num_steps)
        finally:
            self._growing = False


def with_pool(base, kv_cls):
    """base's engine factory with its paged pool replaced by a kv_cls of the same shape (no prefix caching)."""
    def make(clock):
        eng, ex = base(clock)
        kv = kv_cls(eng.kv.num_blocks, eng.kv.block_size, eng.kv.max_model_len, enable_prefix_caching=False)
        return FastForwardEngine(eng.policy, kv, ex, clock=clock, max_model_len=eng.max_model_len), ex

    return make


def test_an_allocator_with_its_own_count_bookkeeping_is_called_in_decode_runs():
    base = factory("chunked", "paged", 400)
    make = with_pool(base, CountingRecords)
    reqs = shared_prefix_requests(40, rate=20.0, seed=4)
    res = simulate(fresh_copies(reqs), make)
    assert res.replicas[0].engine.num_fast_forwarded_steps > 0 and res.replicas[0].engine.kv.records_in_runs > 0
    assert res.replicas[0].engine._pool is None  # its grow_decodes is its own: asked with the counts, as it is
    ref = simulate(fresh_copies(reqs), base)
    assert ref.replicas[0].engine._pool is ref.replicas[0].engine.kv  # PagedAllocator's own: counts read off
    assert [(r.req_id, r.token_times, r.finish_reason) for r in ref.requests] == \
           [(r.req_id, r.token_times, r.finish_reason) for r in res.requests]


class OwnUsage(PagedAllocator):
    """A user's allocator with its own usage(): the engine's step figures are read through it."""

    usage_calls = 0

    def usage(self):
        self.usage_calls += 1
        return super().usage()


def test_an_allocator_with_its_own_usage_is_asked_for_the_step_figures():
    base = factory("chunked", "paged", 400)
    make = with_pool(base, OwnUsage)
    reqs = shared_prefix_requests(40, rate=20.0, seed=4)
    with pytest.warns(UserWarning):  # its usage() voids the decode-growth promise: steps one at a time
        res = simulate(fresh_copies(reqs), make)
    eng = res.replicas[0].engine
    assert eng._pool is None and eng.kv.usage_calls >= len(eng.steps) > 0
    ref = simulate(fresh_copies(reqs), base)  # fast-forwarded: its step figures read without usage()
    assert ref.replicas[0].engine._pool is ref.replicas[0].engine.kv
    assert [(r.req_id, r.token_times, r.finish_reason) for r in ref.requests] == \
           [(r.req_id, r.token_times, r.finish_reason) for r in res.requests]
    assert step_table(ref.replicas[0].engine.steps).equals(step_table(eng.steps))  # reserved and live slots too


class PastUntil(CostModelExecutor):
    """A user's executor (CostModelExecutor's own decode_run, re-declared): counts the runs it is asked
    for from a clock already at or past `until`, which CostModelExecutor itself is no longer asked for."""

    late_calls = 0

    def decode_run(self, batch, max_steps, until):
        self.late_calls += self.clock.now() >= until
        return super().decode_run(batch, max_steps, until)


def test_a_run_past_until_is_skipped_for_the_shipped_executor_only():
    """A full step ending at or past the next arrival: no decode run is asked of CostModelExecutor
    (it would time no step); a subclass is still asked, and both simulations are the same."""
    base = factory("chunked", "paged", 400)

    def make(clock):
        eng, _ = base(clock)
        ex = PastUntil(eng.executor.cost, clock)
        return FastForwardEngine(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex

    reqs = shared_prefix_requests(60, rate=40.0, seed=5)
    ref = simulate(fresh_copies(reqs), make, num_replicas=2, router="least_outstanding")
    got = simulate(fresh_copies(reqs), base, num_replicas=2, router="least_outstanding")
    assert all(r.engine._own_run == 0 for r in ref.replicas) and all(r.engine._own_run == 1 for r in got.replicas)
    assert sum(r.executor.late_calls for r in ref.replicas) > 0
    assert sum(r.engine.num_fast_forwarded_steps for r in got.replicas) > 0
    assert_same(ref, got)


class SamplesSeven(CostModelExecutor):
    """A user's executor whose decode runs sample token 7 (its steps one at a time, SIM_TOKEN)."""

    def decode_run(self, batch, max_steps, until):
        run = super().decode_run(batch, max_steps, until)
        return None if run is None else (7, run[1])


def test_a_stop_token_sampled_in_a_decode_run_ends_its_requests_there():
    """A batch with a request that stops on the run's token: the run is cut to one step and that request
    stops, inline as with the calls; batches where nobody stops on it run on (their limits only)."""
    base = factory("chunked", "paged", 400)

    def make(inline):
        def build(clock):
            eng, _ = base(clock)
            ex = SamplesSeven(eng.executor.cost, clock)
            eng = FastForwardEngine(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len)
            if not inline:
                eng._own_rules = 0
            return eng, ex
        return build

    reqs = []
    for i, r in enumerate(shared_prefix_requests(60, rate=40.0, seed=6)):
        sp = SamplingParams(max_tokens=r.sampling.max_tokens, stop_token_ids=[7] if i % 5 == 0 else [], ignore_eos=True)
        reqs.append(Request(r.req_id, r.prompt_token_ids, sp, arrival=r.arrival))
    ref = simulate(fresh_copies(reqs), make(False), num_replicas=2, router="least_outstanding")
    got = simulate(fresh_copies(reqs), make(True), num_replicas=2, router="least_outstanding")
    assert all(r.engine._own_rules == 1 for r in got.replicas)
    assert sum(r.engine.num_fast_forwarded_steps for r in got.replicas) > 0
    assert_same(ref, got)
    stopped = [r for r in got.requests if r.finish_reason is FinishReason.STOP]
    assert stopped and all(r.output_token_ids[-1] == 7 for r in stopped)
    assert any(r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) > 1 for r in got.requests)
