"""FastForwardEngine's fused full step (its _step with the shipped CostModelExecutor) decides and records
exactly what Engine._step with the executor's execute() does: every policy and allocator, with
preemptions, stop tokens and max_model_len; a subclass's execute() or stop rule is still called."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

from sim.executor import SIM_TOKEN, CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.promises import PromiseWarning
from varlen.request import FinishReason, Request
from varlen.sampling_params import SamplingParams
from varlen.steplog import StepLog
from varlen.testing.fast_forward import ALLOCATORS, POLICIES, assert_same, factory, shared_prefix_requests


def fused(make, on: bool):
    """`make` with the fused step on (checked taken) or off (Engine._step and execute(), the reference)."""

    def build(clock):
        eng, ex = make(clock)
        if not on:
            eng._fused = 0
        return eng, ex

    return build


def was_fused(res) -> bool:
    return all(r.engine._fused == 1 for r in res.replicas)


def mixed_stops(reqs: list[Request]) -> list[Request]:
    """Some requests end on the simulated token (EOS or a stop token), the rest by length."""
    out = []
    for i, r in enumerate(reqs):
        sp = r.sampling
        if i % 5 == 1:
            sp = SamplingParams(max_tokens=sp.max_tokens, ignore_eos=False)  # the engine's EOS is SIM_TOKEN
        elif i % 5 == 2:
            sp = SamplingParams(max_tokens=sp.max_tokens, stop_token_ids=[SIM_TOKEN], ignore_eos=True)
        out.append(Request(r.req_id, r.prompt_token_ids, sp, arrival=r.arrival, priority=r.priority))
    return out


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("policy", POLICIES)
def test_fused_steps_equal_engine_steps(policy, allocator):
    """A pool small enough to preempt, two replicas: requests, step records, allocator state and clock agree."""
    make = factory(policy, allocator, 120, max_model_len=640, eos=SIM_TOKEN)
    reqs = mixed_stops(shared_prefix_requests(90, rate=60.0, seed=5))
    ref = simulate(fresh_copies(reqs), fused(make, False), num_replicas=2, router="least_outstanding")
    got = simulate(fresh_copies(reqs), fused(make, True), num_replicas=2, router="least_outstanding")
    assert was_fused(got) and not was_fused(ref)
    assert_same(ref, got)
    reasons = {r.finish_reason for r in got.requests}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons


def test_max_model_len_ends_requests_in_fused_steps():
    """Requests cut by max_model_len rather than max_tokens: the same ends, fused or not."""
    make = factory("chunked", "paged", 400, max_model_len=200)
    reqs = [Request(f"r{i}", list(range(1, 150 + i)), SamplingParams(max_tokens=500, ignore_eos=True), arrival=0.01 * i)
            for i in range(12)]
    ref = simulate(fresh_copies(reqs), fused(make, False), num_replicas=1)
    got = simulate(fresh_copies(reqs), fused(make, True), num_replicas=1)
    assert was_fused(got)
    assert_same(ref, got)
    assert all(len(r.output_token_ids) < 500 and r.finish_reason is FinishReason.LENGTH for r in got.requests)


class CountingExecutor(CostModelExecutor):
    """A user's executor: its execute() must be called for every full step."""

    calls = 0
    decode_run = CostModelExecutor.decode_run  # its promise kept: decode runs go on as they did

    def execute(self, scheduled, kv):
        self.calls += 1
        return super().execute(scheduled, kv)


def test_a_subclassed_executor_sees_every_execute_call():
    base = factory("chunked", "paged", 400)

    def make(clock):
        eng, ex = base(clock)
        mine = CountingExecutor(ex.cost, clock)
        return FastForwardEngine(eng.policy, eng.kv, mine, clock=clock, max_model_len=eng.max_model_len), mine

    reqs = shared_prefix_requests(40, rate=50.0, seed=2)
    res = simulate(fresh_copies(reqs), make, num_replicas=1)
    eng = res.replicas[0].engine
    assert eng._fused == 0
    full_steps = sum(1 for e in eng.steps.entries if not hasattr(e, "ends"))
    assert full_steps > 0 and res.replicas[0].executor.calls == full_steps
    assert_same(simulate(fresh_copies(reqs), base, num_replicas=1), res)


class StopsAtThree(FastForwardEngine):
    """A user's engine with its own stop rule: every request ends after three tokens."""

    def _stop_reason(self, r, tok):
        return FinishReason.STOP if len(r.output_token_ids) >= 3 else super()._stop_reason(r, tok)


@pytest.mark.parametrize("fast_forward", [False, True])
def test_an_engine_with_its_own_stop_rule_is_not_fused(fast_forward):
    """Neither fused nor fast-forwarded (decode runs apply Engine's limits): the rule ends each request."""
    base = factory("chunked", "paged", 400)

    def make(clock):
        eng, ex = base(clock)
        return StopsAtThree(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex

    with pytest.warns(PromiseWarning, match="StopsAtThree._stop_reason") if fast_forward else nullcontext():
        res = simulate(fresh_copies(shared_prefix_requests(30, rate=50.0, seed=4)), make, fast_forward=fast_forward)
    assert res.replicas[0].engine._fused == 0
    assert res.replicas[0].engine.num_fast_forwarded_steps == 0
    assert all(len(r.output_token_ids) <= 3 for r in res.requests)
    assert any(r.finish_reason is FinishReason.STOP for r in res.requests)


@pytest.mark.parametrize("sink", [False, True])
def test_a_columns_only_log_keeps_the_same_columns(sink):
    """StepLog(keep=False): without a sink the fused steps and decode runs leave out the batch's request
    ids (only its size is read); the columns are those of the kept log. A sink still gets the ids."""
    base = factory("chunked", "paged", 400)
    seen: list[str] = []

    def keep_ids(entries):
        seen.extend(i for e in entries for i in e.req_ids)

    def make(clock):
        eng, ex = base(clock)
        eng.steps = StepLog(keep=False, sink=keep_ids if sink else None)
        return eng, ex

    reqs = shared_prefix_requests(60, rate=50.0, seed=8)
    kept = simulate(fresh_copies(reqs), base, num_replicas=2, router="least_outstanding")
    cols = simulate(fresh_copies(reqs), make, num_replicas=2, router="least_outstanding")
    assert was_fused(cols)
    a, b = kept.steps.columns(tokens=False), cols.steps.columns(tokens=False)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    for log in (r.engine.steps for r in cols.replicas):
        if sink:  # the sink reads every entry: held as entries until a fold hands them over
            assert log.entries
        else:  # nothing reads an entry: the figures held as columns, no entry object
            assert not log.entries and log._held_entries > 0
    for eng in (r.engine for r in cols.replicas):
        eng.steps.flush()
    if sink:
        assert set(seen) == {r.req_id for r in reqs}
