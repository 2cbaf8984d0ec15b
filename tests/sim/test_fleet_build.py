"""A fleet's replicas are built alike without each paying for it: the policy's config resolved once
(registry.builder), one cost model object where it holds no state (sim/cost/registry.py), the
allocators' free stacks made from one tuple of block ids; every replica still its own objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sim import run as sim_run
from sim.cost.hardware import HardwareSpec
from sim.cost.registry import cost_model_factory, shareable
from sim.executor import CostModelExecutor
from varlen import registry
from varlen.assembly import allocator_factory, build_engine
from varlen.clock import SimClock
from varlen.kv import PagedAllocator
from varlen.settings import EngineSizes

H100 = HardwareSpec.load("h100_sxm")


def test_a_builder_resolves_once_and_makes_new_equal_instances(monkeypatch):
    resolved = []
    real = registry._resolve
    monkeypatch.setattr(registry, "_resolve", lambda *a: resolved.append(1) or real(*a))
    make = registry.builder("scheduler", "chunked", context={"engine": {"max_model_len": 4096}}, max_num_seqs=3)
    a, b, c = make(), make(), make()
    assert len(resolved) == 1
    assert type(a) is type(b) is type(c) is registry.target("scheduler", "chunked")
    assert a is not b and b is not c
    for p in (a, b, c):
        assert (p.max_num_seqs, p.max_num_batched_tokens) == (3, 512)


def test_a_builder_instantiates_each_time_what_is_not_plain_keywords(monkeypatch):
    import hydra.utils

    calls = []
    real = hydra.utils.instantiate
    monkeypatch.setattr(hydra.utils, "instantiate", lambda *a, **k: calls.append(1) or real(*a, **k))
    make = registry.builder("allocator", "paged", context={})  # _partial_: a factory of pools, not a pool
    assert make() is not make() and len(calls) == 2
    calls.clear()
    plain = registry.builder("scheduler", "chunked", context={"engine": {"max_model_len": 4096}})
    plain(), plain(), plain()
    assert len(calls) == 1  # the first through Hydra, the others the class it made


def test_settings_a_builder_hands_out_are_copies():
    make = registry.builder("router", {"_target_": "sim.routers.RoundRobinRouter"})
    assert type(make()) is type(make())
    spec = {"_target_": "tests.sim.test_fleet_build.Keeps", "sizes": [1, 2]}
    make = registry.builder("scheduler", spec)
    a, b = make(), make()
    a.sizes.append(3)
    assert b.sizes == [1, 2] and make().sizes == [1, 2]


class Keeps:
    def __init__(self, sizes: list[int]):
        self.sizes = sizes


def test_one_roofline_object_serves_every_replica_a_replay_one_each(tmp_path: Path):
    make = cost_model_factory({"model": "roofline"}, "tiny", H100, None)
    first = make()
    assert shareable(first) and make() is first
    tp = cost_model_factory({"model": "roofline"}, "tiny", H100, {"tensor": 2})
    assert type(tp()).__name__ == "CommunicationCostModel" and tp() is tp()
    path = tmp_path / "d.json"
    path.write_text(json.dumps([0.25, 0.5]))
    replay = cost_model_factory({"model": "replay", "path": str(path)}, "tiny", H100, None)
    a, b = replay(), replay()
    assert not shareable(a) and a is not b  # each replica plays the timeline from its start


def test_a_subclass_of_a_shipped_model_is_not_shared():
    from sim.cost.roofline import RooflineCostModel

    class Counting(RooflineCostModel):
        pass

    assert not shareable(Counting("tiny", H100))


def test_engines_sharing_a_policy_cache_get_their_own_equal_policies(monkeypatch):
    built = []
    real = registry.builder
    monkeypatch.setattr(registry, "builder", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    sizes = EngineSizes(64, 16, 512)
    cost = cost_model_factory({}, "tiny", H100)
    make_kv = allocator_factory("paged", {"engine": {}})
    policies: dict = {}
    engines = [build_engine(sizes, "chunked", make_kv, lambda _p, _l: CostModelExecutor(cost(), SimClock()),
                            policies=policies) for _ in range(3)]
    assert built.count("scheduler") == 1 and len(policies) == 1
    assert len({id(e.policy) for e in engines}) == 3 and len({id(e.kv) for e in engines}) == 3
    assert {(e.policy.max_num_batched_tokens, e.policy.max_num_seqs, e.max_model_len) for e in engines} == \
        {(engines[0].policy.max_num_batched_tokens, engines[0].policy.max_num_seqs, 512)}


def test_pools_of_one_size_start_alike_and_stay_apart():
    a, b = PagedAllocator(40, 16, None, False), PagedAllocator(40, 16, None, False)
    assert a.free_stack() == list(range(39, -1, -1)) and a.free_plain is not b.free_plain
    a.free_plain.append(a._take_plain(1)[0])
    assert a.free_stack() == [*range(39, 0, -1), 0] and b.free_stack() == list(range(39, -1, -1))
    assert PagedAllocator(40, 16).free_stack() == list(range(39, -1, -1))


@pytest.mark.parametrize("replicas", [3])
def test_a_fleet_run_builds_its_cost_model_and_policy_config_once(monkeypatch, replicas):
    import sim.cost.registry as cost_registry

    factories, resolved = [], []
    real_factory, real_resolve = cost_registry.cost_model_factory, registry._resolve
    monkeypatch.setattr(cost_registry, "cost_model_factory", lambda *a: factories.append(1) or real_factory(*a))
    monkeypatch.setattr(registry, "_resolve", lambda *a: resolved.append(a[0]) or real_resolve(*a))
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        cfg = compose("sim", ["workload=synthetic", "workload.limit=30", f"cluster.replicas={replicas}",
                              "engine.num_blocks=256", "output.requests=false"])
    res, row = sim_run.simulate_config(cfg)
    assert row["finished"] == 30 and len(res.replicas) == replicas
    engines = [r.engine for r in res.replicas]
    assert len({id(e.policy) for e in engines}) == replicas
    assert len({id(e.executor.cost) for e in engines}) == 1  # roofline: one object
    assert resolved.count("scheduler") == 1
    assert len(factories) == 2  # the run's headline model, and the replicas' one
