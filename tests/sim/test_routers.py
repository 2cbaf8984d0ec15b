"""Routers (sim/routers.py, conf/router/): each name builds through the registry and serves a
trace on several replicas; prefix_aware follows the replicas' own prefix caches, within its load
threshold; the run reports the prefix hit rate."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from schedulers import ChunkedPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.routers import LeastOutstandingRouter, PrefixAwareRouter
from sim.headline import prefix_hit_rate
from sim.run import check_router
from sim.simulator import simulate
from varlen import registry
from varlen.cli import SettingError
from varlen.clock import SimClock
from sim.fast_forward import FastForwardEngine
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.traces import load_trace
from varlen.workload import trace_requests


def engine_factory(num_blocks=400):
    cost = RooflineCostModel("tiny", "cpu_2core")

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        pol = ChunkedPolicy(max_num_seqs=16, max_num_batched_tokens=256)
        return FastForwardEngine(pol, PagedAllocator(num_blocks, 16, 2048), ex, clock=clock, max_model_len=2048), ex

    return make


def mooncake(n):
    tr = load_trace("mooncake_conv", limit=n, max_model_len=2048, over_length="clip")
    return trace_requests(tr, 512, SamplingParams(ignore_eos=True), token_ids=True)


@pytest.mark.parametrize("name", registry.names("router"))
def test_every_router_serves_every_request(name):
    reqs = mooncake(60)
    res = simulate(reqs, engine_factory(), num_replicas=3, router=name)
    assert all(r.finish_reason.value == "length" and r.num_output_tokens == r.sampling.max_tokens for r in reqs)
    assert sorted(res.routed) == sorted(r.req_id for r in reqs)
    assert set(res.routed.values()) <= {0, 1, 2}


def test_a_subclass_of_least_outstanding_is_still_called_at_every_arrival():
    """The simulator answers the shipped least_outstanding itself; a user's subclass is its own router."""
    class Tracked(LeastOutstandingRouter):
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, replicas, req):
            self.calls += 1
            return super().__call__(replicas, req)

    tracked = Tracked()
    a = simulate(mooncake(60), engine_factory(), num_replicas=3, router=tracked)
    b = simulate(mooncake(60), engine_factory(), num_replicas=3, router=LeastOutstandingRouter())
    assert tracked.calls == 60 and a.routed == b.routed and len(set(b.routed.values())) == 3


def test_router_names_are_conf_router_yaml():
    assert {"round_robin", "least_outstanding", "prefix_aware"} <= set(registry.names("router"))
    assert isinstance(registry.build("router", "prefix_aware", load_threshold=9), PrefixAwareRouter)


def _replicas(n):
    make = engine_factory()
    from sim.simulator import Replica

    reps = []
    for i in range(n):
        clock = SimClock()
        eng, ex = make(clock)
        reps.append(Replica(i, eng, clock, ex))
    return reps


def test_prefix_aware_picks_the_replica_caching_the_prefix_within_its_load_threshold():
    shared = list(range(100, 164))  # 4 blocks
    reps = _replicas(3)
    cached = Request("a", shared + [1, 2, 3], SamplingParams(max_tokens=4))
    assert reps[2].engine.kv.allocate(cached, cached.num_tokens)  # replica 2 holds its blocks
    new = Request("b", shared + [7, 8], SamplingParams(max_tokens=4))
    other = Request("c", [5] * 40, SamplingParams(max_tokens=4))
    assert reps[2].engine.kv.match_prefix(new) == 64
    assert PrefixAwareRouter(load_threshold=4)(reps, new) == 2
    assert PrefixAwareRouter(load_threshold=4)(reps, other) == 0  # no hit anywhere: least loaded
    for k in range(3):  # replica 2 gets 3 unfinished requests: more than 2 over the least loaded
        reps[2].engine.add_request(Request(f"w{k}", [9] * 20, SamplingParams(max_tokens=2)))
    assert PrefixAwareRouter(load_threshold=3)(reps, new) == 2
    assert PrefixAwareRouter(load_threshold=2)(reps, new) == 0
    with pytest.raises(ValueError, match="load_threshold=-1"):
        PrefixAwareRouter(load_threshold=-1)


def test_prefix_aware_raises_the_hit_rate_on_mooncake():
    reqs = {name: mooncake(300) for name in ("round_robin", "prefix_aware")}
    for name, rs in reqs.items():  # pools large enough to keep what the trace reuses
        simulate(rs, engine_factory(num_blocks=4000), num_replicas=4, router=name)
    rr, pa = prefix_hit_rate(reqs["round_robin"]), prefix_hit_rate(reqs["prefix_aware"])
    assert 0 < rr < pa


def test_bad_router_settings_are_one_line_errors():
    cfg = OmegaConf.create({"cluster": {"router": "random", "router_options": {}}})
    with pytest.raises(SettingError, match=r"cluster.router='random' is unknown; choose one of .*prefix_aware"):
        check_router(cfg, registry)
    cfg = OmegaConf.create({"cluster": {"router": "prefix_aware", "router_options": {"load_threshold": -2}}})
    with pytest.raises(SettingError, match=r"cluster.router='prefix_aware'.*load_threshold=-2"):
        check_router(cfg, registry)
    cfg = OmegaConf.create({"cluster": {"router": "round_robin", "router_options": {"bogus": 1}}})
    with pytest.raises(SettingError, match=r"bogus"):
        check_router(cfg, registry)
