"""The shortest-job-first policy (schedulers/sjf.py, conf/scheduler/sjf.yaml): shortest prompt
admitted first, aging bounds how long a long prompt waits behind a stream of short ones, and it
runs everywhere a policy name goes. The property and invariant suites take it from the group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schedulers.sjf import SJFPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.simulator import simulate
from varlen import LLM, SamplingParams, registry
from sim.fast_forward import FastForwardEngine
from varlen.kv import PagedAllocator
from varlen.request import Request

SP = SamplingParams(max_tokens=4, ignore_eos=True)


def run(reqs: list[Request], aging_rate: float, seats: int = 1) -> None:
    def make(clock):
        ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
        pol = SJFPolicy(max_num_seqs=seats, max_num_batched_tokens=1024, aging_rate=aging_rate)
        return FastForwardEngine(pol, PagedAllocator(512, 16, 1024), ex, clock=clock, max_model_len=1024), ex

    simulate(reqs, make)
    assert all(r.finish_reason.value == "length" for r in reqs)


@pytest.mark.parametrize("aging_rate", [0.0, 1000.0])
def test_shortest_prompt_is_admitted_first(aging_rate):
    lens = [30, 5, 12, 5, 40, 1]
    reqs = [Request(f"r{i}", [7] * n, SP, arrival=1e-6) for i, n in enumerate(lens)]
    run(reqs, aging_rate)
    order = [r.req_id for r in sorted(reqs, key=lambda r: r.first_scheduled)]
    assert order == ["r5", "r1", "r3", "r2", "r0", "r4"]  # by length, equal lengths by arrival


def stream(n: int = 600, dt: float = 0.002) -> tuple[list[Request], Request]:
    """A long prompt arriving with a stream of short ones faster than one seat serves them."""
    shorts = [Request(f"s{i}", [7] * 8, SP, arrival=1e-6 + i * dt) for i in range(n)]
    return shorts, Request("long", [9] * 400, SP, arrival=2e-6)


def test_aging_bounds_the_wait_of_a_long_prompt():
    rate = 1000.0
    shorts, long = stream()
    run([*shorts, long], rate)
    # Ranked by prompt_len - rate * waited: a short one arriving later than this passes it no more.
    bound = long.arrival + (400 - 8) / rate
    ahead = {r.req_id for r in shorts if r.first_scheduled < long.first_scheduled}
    assert long.first_scheduled > bound  # the queue did build up: the bound is what let it in
    assert ahead == {r.req_id for r in shorts if r.arrival < bound}
    assert len(ahead) < len(shorts) - 100  # it ran well before the stream ended

    # Without aging, the same stream starves it until the last short one has been admitted.
    shorts, long = stream()
    run([*shorts, long], 0.0)
    assert all(r.first_scheduled < long.first_scheduled for r in shorts)


def test_preempted_request_keeps_its_rank_and_every_request_finishes():
    reqs = [Request(f"r{i}", [i + 3] * (20 + 7 * (i % 5)), SamplingParams(max_tokens=40, ignore_eos=True),
                    arrival=1e-6 + 1e-3 * i) for i in range(12)]

    def make(clock):
        ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
        pol = SJFPolicy(max_num_seqs=6, max_num_batched_tokens=32, aging_rate=50.0)
        return FastForwardEngine(pol, PagedAllocator(24, 4, 96), ex, clock=clock, max_model_len=96), ex

    res = simulate(reqs, make)
    assert sum(r.num_preemptions for r in reqs) > 0  # the small pool made it preempt
    assert all(r.finish_reason.value == "length" and len(r.output_token_ids) == 40 for r in reqs)
    assert not res.replicas[0].engine.policy.waiting


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "fast", True])
def test_bad_aging_rate_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"aging_rate=.*must be a number >= 0"):
        SJFPolicy(aging_rate=bad)


def test_sjf_is_a_name_of_the_scheduler_group():
    assert "sjf" in registry.names("scheduler")
    pol = registry.build("scheduler", "sjf", context={"engine": {"max_model_len": 64}})
    assert type(pol) is SJFPolicy and pol.aging_rate == 100.0 and pol.max_num_batched_tokens == 512


def test_llm_runs_sjf(tiny_model_dirs):
    prompts = [[5] * 30, [6] * 3, [7] * 11]
    outs = {}
    for name in ("sjf", "chunked"):
        llm = LLM(tiny_model_dirs["qwen3"], scheduler=name, block_size=4, max_model_len=64, max_num_seqs=1)
        assert llm.engine.policy.name == ("SJFPolicy" if name == "sjf" else "ChunkedPolicy")
        outs[name] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
        # One seat: sjf serves the shortest prompt (the second) first, chunked the first one.
        assert list(llm.engine.steps[0].req_ids) == (["1"] if name == "sjf" else ["0"])
    assert outs["sjf"] == outs["chunked"]  # greedy: the order changes the schedule, not the tokens


def _env(tmp_path) -> dict:
    return dict(os.environ, VARLEN_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")


def test_varlen_run_with_sjf(tmp_path, monkeypatch, capsys):
    from tests.cli.test_cli_errors import run_main

    # In this process (a subprocess would spend ~10 s importing torch and transformers).
    monkeypatch.setenv("VARLEN_HOME", str(tmp_path / "home"))
    code, out, err = run_main("varlen.run", ["scheduler=sjf", f"hydra.run.dir={tmp_path / 'out'}", "progress=false",
                                             "engine.threads=1", "workload.limit=5", "workload.output_len=uniform:2:4"],
                              monkeypatch, capsys, through_cli=True)
    assert code == 0, err
    assert "scheduler SJFPolicy" in out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["finished"] == 5


def test_sim_run_with_sjf(tmp_path):
    res = subprocess.run([sys.executable, "-m", "sim.run", "scheduler=sjf", "workload.limit=40", "sim_model=tiny",
                          "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=1024",
                          f"hydra.run.dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["scheduler"] == "sjf" and summary["finished"] == 40
