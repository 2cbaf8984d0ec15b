"""varlen/assembly.py: one rule sizes and wires every engine, the real one (LLM) and the simulator's."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import sim.run as sim_run
import sim.validate
import varlen.assembly
import varlen.llm
from schedulers import ChunkedPolicy, ContinuousPolicy
from varlen.assembly import build_engine
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.settings import EngineSizes

ROOT = Path(__file__).resolve().parents[2]
# A pool of 10 blocks x 16 tokens holds less than the 256 tokens asked for: the rule must clip.
POOL, ASKED, HELD = 10, 256, 160


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, policy, max_model_len):
        from sim.executor import CostModelExecutor
        from varlen.clock import SimClock

        self.calls.append((policy, max_model_len))
        return CostModelExecutor(_cost(), SimClock())


def test_the_rule_pool_first_then_max_model_len_then_policy_then_executor():
    make_executor = Recorder()
    eng = build_engine(EngineSizes(POOL, 16, ASKED, max_num_seqs=3), "continuous", PagedAllocator, make_executor)
    assert (eng.kv.num_blocks, eng.kv.block_size, eng.kv.max_model_len) == (POOL, 16, ASKED)
    assert eng.max_model_len == HELD
    # continuous.yaml: max_num_batched_tokens: ${engine.max_model_len}, the pool's; the set size wins over the yaml's.
    assert isinstance(eng.policy, ContinuousPolicy)
    assert (eng.policy.max_num_batched_tokens, eng.policy.max_num_seqs) == (HELD, 3)
    assert make_executor.calls == [(eng.policy, HELD)]

    spec = {"_target_": "schedulers.ChunkedPolicy", "max_num_seqs": "${engine.block_size}",
            "max_num_batched_tokens": "${extra.budget}"}
    eng = build_engine(EngineSizes(POOL, 8, 1000), spec, partial(PagedAllocator, enable_prefix_caching=False),
                       Recorder(), context={"extra": {"budget": 48}, "engine": {"num_blocks": -1}})
    assert (eng.policy.max_num_seqs, eng.policy.max_num_batched_tokens) == (8, 48)
    assert eng.max_model_len == POOL * 8

    given = ChunkedPolicy(max_num_seqs=2, max_num_batched_tokens=32)
    eng = build_engine(EngineSizes(POOL, 16, 64, max_num_seqs=99), given, PagedAllocator, Recorder())
    assert eng.policy is given and given.max_num_seqs == 2  # an object comes as it is
    assert eng.max_model_len == 64  # asked for less than the pool holds


@pytest.fixture
def calls(monkeypatch):
    """Every build_engine call, by the engine class it built, wherever the caller looks it up."""
    seen: list[str] = []
    real = varlen.assembly.build_engine

    def spy(*args, **kw):
        engine = real(*args, **kw)
        seen.append(type(engine).__name__)
        return engine

    for module in (varlen.assembly, varlen.llm, sim.validate):
        monkeypatch.setattr(module, "build_engine", spy)
    return seen


def sim_cfg(*overrides):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        return compose("sim", ["scheduler=continuous", f"engine.num_blocks={POOL}", f"engine.max_model_len={ASKED}",
                               "workload.limit=4", *overrides])


def test_llm_and_the_simulator_size_an_engine_alike(tiny_model_dirs, calls):
    from varlen import LLM

    llm = LLM(tiny_model_dirs["qwen3"], scheduler="continuous", num_blocks=POOL, max_model_len=ASKED)
    real = llm.engine
    assert calls == ["Engine"]
    assert (real.max_model_len, real.policy.max_num_batched_tokens) == (HELD, HELD)
    assert llm.executor is real.executor and llm.executor.runner is llm.runner and llm.runner.num_blocks == POOL

    res, row = sim_run.simulate_config(sim_cfg())
    assert calls[1:] == ["FastForwardEngine"]
    eng = res.replicas[0].engine
    assert (eng.max_model_len, eng.policy.max_num_batched_tokens, eng.kv.num_blocks) == (HELD, HELD, POOL)
    assert row["max_model_len"] == HELD

    del calls[:]
    res, row = sim_run.simulate_config(sim_cfg("cluster.mode=disaggregated"))
    assert calls == ["DisaggEngine"] * 4  # a check instance of each pool, then one per instance
    for rep in res.replicas:
        assert (rep.engine.max_model_len, rep.engine.policy.max_num_batched_tokens) == (HELD, HELD)

    del calls[:]
    reqs = [Request(str(i), [1 + i] * 20, SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(3)]
    sim_res = sim.validate.simulate_like(reqs, lambda: ContinuousPolicy(max_num_seqs=4, max_num_batched_tokens=HELD),
                                         lambda: PagedAllocator(POOL, 16, ASKED), ASKED, _cost())
    assert calls == ["FastForwardEngine"] and sim_res.replicas[0].engine.max_model_len == HELD


def _cost():
    from sim.cost.roofline import RooflineCostModel

    return RooflineCostModel(sim_run.load_sim_model("tiny"), "h100_sxm")


def test_assembly_imports_no_torch():
    code = "import sys, varlen.assembly; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
