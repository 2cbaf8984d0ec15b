"""Proof that the decode fast-forward (FastForwardEngine.step with `until`, simulate(fast_forward=True)) changes
nothing: for every policy and allocator, the same requests (tokens, token times, finishes), the
same step records, the same summary and the same allocator state as stepping one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given

from sim.cost.base import StepSums
from sim.cost.fitted import ProfiledCostModel
from sim.cost.roofline import RooflineCostModel
from sim.executor import SIM_TOKEN, CostModelExecutor
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.kv import PagedAllocator
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import (
    ALLOCATORS, POLICIES, assert_same, factory, policy_class, run_both, shared_prefix_requests,
)
from varlen.testing.strategies import trace_workloads as workloads
from varlen.traces import load_trace
from varlen.workload import trace_requests

ROOT = Path(__file__).resolve().parents[2]


def distinct_policies() -> list[str]:
    """One name per policy class (`orca` and `fastertransformer` name the classes of `continuous`
    and `static`): the one the class is named after, else the first."""
    by_class: dict[type, list[str]] = {}
    for name in POLICIES:
        by_class.setdefault(policy_class(name), []).append(name)
    return sorted(next((n for n in ns if cls.__name__.lower() == n.replace("_", "") + "policy"), ns[0])
                  for cls, ns in by_class.items())


DISTINCT_POLICIES = distinct_policies()


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("policy", DISTINCT_POLICIES)
def test_fast_forward_changes_nothing(policy, allocator):
    """Roomy pool (long stretches) and a small one (allocation failures, preemptions)."""
    reqs = shared_prefix_requests(70, rate=30.0, seed=1)
    for num_blocks in (400, 70):
        a, b = run_both(reqs, factory(policy, allocator, num_blocks))
        assert_same(a, b)
        eng = b.replicas[0].engine
        # Static batching keeps arrivals waiting while a batch runs, as does a full pool (or
        # max-length reservations), and a non-empty queue stops the fast-forward (the
        # conservative rule), so it saves less there.
        roomy = num_blocks == 400 and policy != "static" and allocator.startswith("paged")
        assert eng.num_fast_forwarded_steps > (0.3 * len(eng.steps) if roomy else 0)
        if num_blocks == 70 and allocator.startswith("paged"):
            assert eng.num_preemptions > 0
    if allocator == "paged-cache":
        assert sum(r.num_prefix_hit_tokens for r in b.requests) > 0


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_fast_forward_with_replicas_and_profiled_cost(router):
    cost = ProfiledCostModel(coef={"const": 2e-3, "new_tokens": 3e-6, "num_seqs": 1e-5, "attn_work": 2e-10,
                                   "cached_tokens": 4e-8, "logit_rows": 5e-6})
    reqs = shared_prefix_requests(80, rate=60.0, seed=2)
    a, b = run_both(reqs, factory("chunked", "paged-cache", 150, cost=cost), num_replicas=3, router=router)
    assert_same(a, b)


def test_stop_tokens_and_max_model_len_end_runs():
    """Requests that stop on the simulated token, or on max_model_len, finish where they would."""
    reqs = shared_prefix_requests(40, rate=50.0, seed=3, max_len=200)
    for i, r in enumerate(reqs):
        if i % 3 == 0:
            r.sampling = SamplingParams(stop_token_ids=[SIM_TOKEN], ignore_eos=True, max_tokens=50)
        elif i % 3 == 1:
            r.sampling = SamplingParams(ignore_eos=True, max_tokens=10_000)  # ends at max_model_len
    a, b = run_both(reqs, factory("chunked", "paged", 200, max_model_len=256))
    assert_same(a, b)
    reasons = {r.finish_reason.value for r in b.requests}
    assert reasons == {"stop", "length"}
    # An engine whose EOS is the simulated token ends every request at its first token.
    a, b = run_both(reqs[1::3], factory("continuous", "paged", 200, max_model_len=256, eos=SIM_TOKEN))
    assert_same(a, b)


def test_decode_step_time_is_step_time_sums_bit_for_bit():
    for cost in (RooflineCostModel("tiny", "h100_sxm"), RooflineCostModel("tiny", "cpu_2core"),
                 ProfiledCostModel(coef={"const": 1e-3, "attn_work": 1e-9, "cached_tokens": 3e-8}),
                 ProfiledCostModel(coef={"const": 1e-3, "num_seqs": 2e-5})):
        for B, c in ((1, 0), (7, 12345), (250, 3_000_000), (4096, 100)):  # both sides of each max()
            step = cost.decode_step_time(B)
            times = [step(c + j * B) for j in range(40)]
            assert times == [cost.step_time_sums(StepSums(B, B, c + j * B, c + j * B, B, B)) for j in range(40)]


@pytest.mark.parametrize("policy", DISTINCT_POLICIES)
def test_azure_slice(policy):
    """200 requests of the Azure conversation trace at twice its rate, Llama-3-8B on an H100."""
    # Static batching steps through every batch's longest request: fewer requests keep it short.
    tr = load_trace("azure_conv", limit=60 if policy == "static" else 200, max_model_len=4096, rate=11.0)
    reqs = trace_requests(tr, 128256, SamplingParams(ignore_eos=True))
    conf = yaml.safe_load((ROOT / "conf" / "sim_model" / "llama3_8b.yaml").read_text())
    cost = RooflineCostModel(conf["config"], "h100_sxm")
    for allocator, blocks in (("paged", 3000), ("paged", 400), ("contiguous-pow2", 3000)):
        a, b = run_both(reqs, factory(policy, allocator, blocks, max_model_len=4096, budget=512, seats=64, cost=cost))
        assert_same(a, b)
        if policy != "static" and blocks == 3000:
            assert b.replicas[0].engine.num_fast_forwarded_steps > 0.4 * b.num_steps


@given(workloads())
def test_fast_forward_never_changes_anything(w):
    """Random small traces, tiny pools (preemption, rejections, aborts), every policy and allocator."""
    make = factory(w["policy"], w["allocator"], w["num_blocks"], w["block_size"], w["max_model_len"],
                   w["budget"], w["seats"])
    a, b = run_both(w["reqs"], make, num_replicas=w["replicas"], router="least_outstanding")
    assert_same(a, b)


def test_fast_forward_needs_the_simulators_engine():
    """simulate(fast_forward=True) refuses a plain Engine (the core loop has no fast-forward)
    rather than quietly stepping one by one; fast_forward=False runs it."""
    from varlen.engine import Engine

    def make(clock):
        ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
        return Engine(policy_class("chunked")(max_num_seqs=4, max_num_batched_tokens=64), PagedAllocator(64, 16, 256),
                      ex, clock=clock, max_model_len=256), ex

    reqs = shared_prefix_requests(5, rate=30.0, seed=3, max_len=100)
    with pytest.raises(ValueError, match="needs make_engine to build a sim.fast_forward.FastForwardEngine, got Engine"):
        simulate(fresh_copies(reqs), make)
    res = simulate(fresh_copies(reqs), make, fast_forward=False)
    assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in res.requests)


def _decoding_engine(policy):
    """An engine whose four requests are all past their prompts (the next batch a pure decode)."""
    from sim.fast_forward import FastForwardEngine
    from varlen.clock import SimClock
    from varlen.request import Request

    clock = SimClock()
    kv = PagedAllocator(num_blocks=64, block_size=16, max_model_len=1024)
    eng = FastForwardEngine(policy, kv, CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock), clock=clock)
    for i in range(4):
        eng.add_request(Request(f"r{i}", [1] * 20, SamplingParams(max_tokens=50, ignore_eos=True)))
    while eng.policy.next_decode_batch() is None:
        eng.step()
    return eng


def test_decode_batch_is_asked_again_after_a_step_a_finish_or_an_arrival():
    """The engine reuses the shipped policy's next_decode_batch answer between two steps; a step, a finish
    without a step (abort) or an arrival gives a fresh answer, the policy's own."""
    from schedulers import ChunkedPolicy
    from varlen.request import Request

    eng = _decoding_engine(ChunkedPolicy(max_num_seqs=8, max_num_batched_tokens=256))
    batch = eng._decode_batch()
    assert batch == eng.policy.next_decode_batch() and len(batch) == 4
    assert eng._decode_batch() is batch  # nothing changed: the same answer, not asked again
    eng.abort("r1")
    assert [r.req_id for r in eng._decode_batch()] == ["r0", "r2", "r3"]
    eng.step()
    fresh = eng._decode_batch()
    assert fresh == eng.policy.next_decode_batch() and fresh is not batch
    eng.add_request(Request("late", [1] * 20))
    assert eng._decode_batch() is None and eng.policy.next_decode_batch() is None


def test_a_user_policys_decode_batch_is_asked_every_time():
    """A policy with its own next_decode_batch (its promise declared) is asked each time, never answered for."""
    from schedulers import ChunkedPolicy

    class Counting(ChunkedPolicy):
        repeats_decode_batches = True
        calls = 0

        def next_decode_batch(self):
            type(self).calls += 1
            return super().next_decode_batch()

    eng = _decoding_engine(Counting(max_num_seqs=8, max_num_batched_tokens=256))
    before = Counting.calls
    assert eng._decode_batch() == eng._decode_batch() and len(eng._decode_batch()) == 4
    assert Counting.calls == before + 3
