"""The fast-forward identity: a simulation with the decode fast-forward equals stepping one by one
(tokens, token times, step records, summary, allocator state), for every policy and allocator."""

from __future__ import annotations

import math
from dataclasses import astuple

import numpy as np

from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen import registry
from varlen.metrics import step_table, summarize
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.steplog import step_columns
from varlen.traces import SyntheticTrace, load_trace
from varlen.workload import trace_requests

POLICIES = registry.names("scheduler")  # every policy of conf/scheduler/ (and the user's config folders)

# The allocators (conf/allocator/) in the modes the suites run; paged_window has its own tests.
ALLOCATORS = {
    "paged-cache": registry.build("allocator", "paged", enable_prefix_caching=True),
    "paged": registry.build("allocator", "paged", enable_prefix_caching=False),
    "contiguous-pow2": registry.build("allocator", "contiguous", reservation="pow2"),
    "contiguous-max": registry.build("allocator", "contiguous", reservation="max"),
}


def policy_class(name: str) -> type:
    return registry.target("scheduler", name)


def state(obj) -> dict:
    """An object's data attributes, whether its class keeps them in a __dict__ or, compiled, in
    native slots (no __dict__, so no vars())."""
    values = {n: getattr(obj, n) for n in dir(obj) if not n.startswith("__")}
    return {n: v for n, v in values.items() if not callable(v)}


def factory(policy: str, allocator: str, num_blocks: int, block_size: int = 16, max_model_len: int = 1024,
            budget: int = 256, seats: int = 16, cost=None, eos: int | None = None):
    cost = cost or RooflineCostModel("tiny", "cpu_2core")
    if not policy_class(policy).chunked_prefill:
        budget = max(budget, max_model_len)  # whole prompts must fit one step

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        kv = ALLOCATORS[allocator](num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
        pol = policy_class(policy)(max_num_seqs=seats, max_num_batched_tokens=budget)
        return FastForwardEngine(pol, kv, ex, clock=clock, max_model_len=max_model_len, eos_token_id=eos), ex

    return make


def shared_prefix_requests(n: int, rate: float, seed: int, max_len: int = 600) -> list[Request]:
    """A synthetic trace whose prompts start with one of a few shared prefixes (prefix cache hits),
    with priorities for the priority policy."""
    tr = load_trace(SyntheticTrace(requests=n, rate=rate, prompt_len=f"uniform:8:{max_len}",
                                   output_len="uniform:1:120", seed=seed), max_model_len=1024)
    reqs = trace_requests(tr, 512, SamplingParams(ignore_eos=True), token_ids=True)
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 512, 64).tolist() for _ in range(3)]
    out = []
    for i, r in enumerate(reqs):
        p = prefixes[i % 3][: int(rng.integers(0, 65))]
        prompt = (p + list(map(int, r.prompt_token_ids)))[:max(len(r.prompt_token_ids), 1)]
        out.append(Request(r.req_id, prompt, r.sampling, arrival=r.arrival, priority=int(rng.integers(0, 3))))
    return out


def run_both(reqs, make, **kw):
    a = simulate(fresh_copies(reqs), make, fast_forward=False, **kw)
    b = simulate(fresh_copies(reqs), make, fast_forward=True, **kw)
    return a, b


def assert_same(a, b) -> None:
    for x, y in zip(a.requests, b.requests):
        assert x.req_id == y.req_id
        assert x.output_token_ids == y.output_token_ids, x.req_id
        # Bit for bit: the fast-forward sums step times the way the clock does, one at a time.
        assert x.token_times == y.token_times, x.req_id
        assert (x.finish_reason, x.finish_time, x.finish_message) == (y.finish_reason, y.finish_time, y.finish_message)
        assert (x.num_computed_tokens, x.num_preemptions, x.num_prefix_hit_tokens, x.first_scheduled) == \
               (y.num_computed_tokens, y.num_preemptions, y.num_prefix_hit_tokens, y.first_scheduled)
    assert a.routed == b.routed
    for ra, rb in zip(a.replicas, b.replicas):
        assert [astuple(s) for s in ra.engine.steps] == [astuple(s) for s in rb.engine.steps]
        assert step_table(ra.engine.steps).equals(step_table(rb.engine.steps))
        assert ra.engine.num_preemptions == rb.engine.num_preemptions
        assert ra.clock.now() == rb.clock.now()
        assert state(ra.engine.kv) == state(rb.engine.kv)  # blocks, free-list order, prefix cache
        # The compact log's columns are those of its records, read one by one.
        fast, slow = rb.engine.steps.columns(), step_columns(list(rb.engine.steps))
        assert fast.keys() == slow.keys()
        for k in fast:
            assert np.array_equal(fast[k], slow[k]), k
    sa, sb = (summarize(r.requests, r.steps, r.total_slots, 1.0, 0.05) for r in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == sb[k] or (math.isnan(sa[k]) and math.isnan(sb[k])), k
