"""The simulator: its event loop is Engine.run, routers, cost-model fast path, CLI, sweep, report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedulers import ChunkedPolicy, ContinuousPolicy
from sim.capacity import bisect_rate
from sim.cost.base import StepSums
from sim.cost.fitted import ProfiledCostModel, profile_rows
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import batch_sequence, first_difference, fresh_copies
from varlen import registry
from varlen.clock import SimClock
from varlen.kv import PagedAllocator
from varlen.metrics import kv_usage_table
from varlen.sampling_params import SamplingParams
from varlen.traces import SyntheticTrace, load_trace
from varlen.workload import trace_requests

ROOT = Path(__file__).resolve().parents[2]


def synthetic(n=120, rate=40.0, seed=0):
    tr = load_trace(SyntheticTrace(requests=n, rate=rate, prompt_len="uniform:16:600",
                                   output_len="uniform:1:80", seed=seed), max_model_len=1024)
    return trace_requests(tr, 512, SamplingParams(ignore_eos=True), token_ids=True)


def engine_factory(num_blocks=200, policy=ChunkedPolicy, budget=256):
    cost = RooflineCostModel("tiny", "cpu_2core")

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        pol = policy(max_num_seqs=16, max_num_batched_tokens=budget)
        return FastForwardEngine(pol, PagedAllocator(num_blocks, 16, 1024), ex, clock=clock, max_model_len=1024), ex

    return make


@pytest.mark.parametrize("policy,budget", [(ChunkedPolicy, 128), (ContinuousPolicy, 1024)])
def test_one_replica_is_engine_run(policy, budget):
    """The event loop with one replica makes exactly Engine.run's decisions on a SimClock
    (small pool: preemptions included)."""
    reqs = synthetic()
    make = engine_factory(num_blocks=60, policy=policy, budget=budget)
    res = simulate(fresh_copies(reqs), make)
    clock = SimClock()
    eng, _ = make(clock)
    eng.run(reqs)
    assert eng.num_preemptions > 0
    assert first_difference(batch_sequence(eng.steps), batch_sequence(res.replicas[0].engine.steps)) is None
    assert [r.token_times for r in reqs] == [r.token_times for r in res.requests]


@pytest.mark.parametrize("router", registry.names("router"))
def test_replicas_behind_a_router(router):
    reqs = synthetic(n=90, rate=200.0)
    res = simulate(reqs, engine_factory(), num_replicas=3, router=router)
    assert all(r.finish_reason.value == "length" for r in res.requests)
    counts = np.bincount(list(res.routed.values()), minlength=3)
    assert counts.sum() == 90
    if router == "round_robin":
        assert counts.tolist() == [30, 30, 30]
    else:
        assert counts.min() > 0
    one = simulate(fresh_copies(reqs), engine_factory(), num_replicas=1)
    # Three replicas share the load: the last request finishes sooner.
    assert max(r.finish_time for r in res.requests) < max(r.finish_time for r in one.requests)


@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3000)), min_size=1, max_size=40),
       st.integers(0, 40))
def test_step_sums_equal_arrays(batch, logits):
    n = [a for a, _ in batch]
    c = [b for _, b in batch]
    s = StepSums(len(n), sum(n), sum(c), sum(a * b for a, b in batch), sum(a * a for a in n), logits,
                 sum(a > 1 for a in n))
    assert s == StepSums.of(n, c, logits)
    roof = RooflineCostModel("tiny", "h100_sxm")
    assert roof.step_time_sums(s) == pytest.approx(roof.step_time(n, c, logits), rel=1e-12)
    prof = ProfiledCostModel(coef={"const": 1e-3, "new_tokens": 2e-6, "num_seqs": 1e-5, "attn_work": 1e-9,
                                   "cached_tokens": 3e-8, "logit_rows": 4e-6, "prefill_seqs": 2e-3})
    assert prof.step_time_sums(s) == pytest.approx(prof.step_time(n, c, logits), rel=1e-12)


def test_profile_rows_count_logits_and_busy_gaps():
    reqs = synthetic(n=40)
    res = simulate(reqs, engine_factory())
    steps = res.replicas[0].engine.steps
    rows = profile_rows(steps)
    assert [r[3] for r in rows] == [s.num_sampled for s in steps]
    # Every sampled token is one logit row: the rows add up to all output tokens.
    assert sum(r[3] for r in rows) == sum(r.num_output_tokens for r in reqs)
    assert all(r[2] >= s.duration for r, s in zip(rows, steps))
    fit = ProfiledCostModel.fit(rows, features=("const", "new_tokens", "num_seqs", "attn_work", "logit_rows"))
    assert fit.report.r2 > 0.9


def test_kv_usage_table_thins_and_keeps_the_peak():
    res = simulate(synthetic(n=80, rate=400.0), engine_factory())
    steps = res.replicas[0].engine.steps
    full = kv_usage_table(steps, res.total_slots, None)
    thin = kv_usage_table(steps, res.total_slots, 50)
    assert len(full) == len(steps) and len(thin) <= 52
    assert thin["kv_usage"].max() == full["kv_usage"].max() > 0
    assert (full["kv_usage"] <= 1).all() and (full["kv_live"] <= full["kv_usage"] + 1e-12).all()


def test_bisection_finds_the_threshold():
    best, probes = bisect_rate(lambda r: (r <= 3.7, {}), 0.5, 64.0, rel_tol=0.01)
    assert 3.7 / 1.01 <= best <= 3.7 and len(probes) < 20
    assert bisect_rate(lambda r: (False, {}), 1, 2)[0] is None
    assert bisect_rate(lambda r: (True, {}), 1, 2)[0] == 2


@pytest.mark.parametrize("rel_tol", [1e-300, 1e-17])
def test_bisection_always_ends(rel_tol):
    """A tolerance floats cannot reach (capacity.rel_tol=0 did this) bisected forever: the
    search ends at its probe cap or when the bounds are adjacent floats."""
    from sim.capacity import MAX_PROBES

    best, probes = bisect_rate(lambda r: (r <= 3.7, {}), 0.5, 64.0, rel_tol=rel_tol)
    assert len(probes) <= MAX_PROBES and best == pytest.approx(3.7, rel=1e-9) and best <= 3.7
    best, probes = bisect_rate(lambda r: (r <= 3.7, {}), 3.7, np.nextafter(3.7, 4), rel_tol=rel_tol)
    assert best == 3.7 and len(probes) == 2  # adjacent bounds: nothing between them to probe


@pytest.mark.parametrize("low, high, rel_tol", [(2, 1, 0.05), (0, 1, 0.05), (1, float("inf"), 0.05), (1, 2, 0)])
def test_bisection_refuses_bad_ranges(low, high, rel_tol):
    with pytest.raises(ValueError):
        bisect_rate(lambda r: (True, {}), low, high, rel_tol)


@pytest.mark.slow
def test_sweep_command_and_report(tmp_path, monkeypatch, capsys):
    """The sweep of the issue, small: one command, a Hydra multirun through the joblib launcher
    that ends with the report (sim.callbacks.SweepReport); sim.report alone redraws it."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "sim.run", "-m", "scheduler=static,chunked", "workload.rate=2,8",
           "workload=synthetic", "workload.limit=60", "sim_model=tiny", "hardware=cpu_2core",
           "engine.num_blocks=256", "engine.max_model_len=2048", f"hydra.sweep.dir={sweep}"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    summaries = sorted(sweep.rglob("summary.json"))
    assert len(summaries) == 4
    row = json.loads(summaries[0].read_text())
    assert row["requests"] == 60 and row["scheduler"] in ("static", "chunked")
    assert "chunked/paged" in out and "static/paged" in out, out
    files = ("summary.csv", "latency_throughput.png", "ttft_cdf.png", "tpot_cdf.png", "kv_usage.png")
    for f in files:
        assert (sweep / f).stat().st_size > 0
    assert len(pd.read_csv(sweep / "summary.csv")) == 4
    for f in files:
        (sweep / f).unlink()
    from tests.cli.test_cli_errors import run_main

    code, out, err = run_main("sim.report", [str(sweep)], monkeypatch, capsys)  # in this process: no second start-up
    assert code == 0, err
    assert "chunked/paged" in out and "static/paged" in out
    for f in files:
        assert (sweep / f).stat().st_size > 0


def test_mooncake_hash_ids_drive_prefix_caching():
    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["workload=mooncake_conv", "workload.limit=150", "workload.rate=2",
                                        "engine.max_model_len=16384"])
    res, row = simulate_config(cfg)
    assert row["finished"] == 150
    # About 5% of these first prompt tokens repeat earlier blocks (36.6% over the whole trace).
    results = res.results  # the requests' columns (output.token_times=false released them)
    assert results.prefix_hit_tokens.sum() > 0.02 * results.prompt_tokens.sum()


def test_cdf_plot_says_why_when_runs_kept_no_request_table(tmp_path, capsys):
    from sim.report import plot_cdfs

    with_table, without = tmp_path / "a", tmp_path / "b"
    with_table.mkdir()
    without.mkdir()
    pd.DataFrame({"ttft": [0.1, 0.2, 0.3]}).to_csv(with_table / "requests.csv", index=False)
    df = pd.DataFrame({"rate": [1.0, 1.0], "run_dir": [str(with_table), str(without)], "policy": ["x", "y"]})
    assert plot_cdfs(df, "ttft", tmp_path / "ttft_cdf.png") == 1
    assert (tmp_path / "ttft_cdf.png").is_file()
    assert plot_cdfs(df.iloc[1:], "ttft", tmp_path / "none.png") == 0
    assert not (tmp_path / "none.png").exists()
    assert "output.requests=true" in capsys.readouterr().err


def test_sim_run_says_what_the_trace_options_changed(tmp_path, monkeypatch, capsys):
    """Clipped, dropped, reordered and zero-output requests were counted but never shown: all
    of a trace could be clipped without a word. Now one line, and the counts in summary.json."""
    from hydra.core.global_hydra import GlobalHydra

    from sim.run import main

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:47.0,900,200\n2023-11-16 18:15:46.0,100,0\n"
                     "2023-11-16 18:15:48.0,50,20\n2023-11-16 18:15:49.0,2000,10\n")
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["sim.run", "sim_model=tiny", "hardware=cpu_2core", "engine.num_blocks=256",
                                      "engine.max_model_len=1024", f"workload.source={trace}", f"hydra.run.dir={out}"])
    GlobalHydra.instance().clear()
    try:
        main()
    finally:
        GlobalHydra.instance().clear()
    printed = capsys.readouterr().out
    assert ("workload (4 requests kept of 4 read): 2 clipped to max_model_len (1 of them in the prompt), "
            "1 out of arrival order (sorted), 1 with output length 0 raised to 1") in printed
    row = json.loads((out / "summary.json").read_text())
    assert (row["trace_num_clipped"], row["trace_num_prompt_clipped"], row["trace_num_reordered"],
            row["trace_num_zero_output"], row["trace_num_dropped"]) == (2, 1, 1, 1, 0)
