"""benchmarks/sim_fidelity.py's real runs: what the fidelity figures are measured on."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_fidelity  # noqa: E402


def test_real_runs_serve_each_prompt_from_its_own_tokens(tmp_path: Path) -> None:
    """Every prompt is computed, none served from the prefix cache: the benchmark once built all-zero
    prompts, each a prefix of the longer ones before it, so TTFT timed a few-token prefill and the wait
    for the running step instead of the prompt's prefill."""
    from varlen.traces import load_trace

    args = argparse.Namespace(seqs=4, budget=64, blocks=256, max_len=256, clock="cpu")
    model, _ = sim_fidelity.fidelity_model("tiny", str(tmp_path))
    trace = load_trace("azure_conv", limit=6, max_model_len=args.max_len, over_length="clip")
    reqs = sim_fidelity.slice_trace(trace, 0, 6, 50.0)
    run = sim_fidelity.real_run("A", model, "torch_sdpa", reqs, args)
    assert run.prefix_hits == 0
    computed = sum(sum(s.new_tokens) for s in run.steps)
    assert computed == sum(r.prompt_len + r.output_len - 1 for r in reqs)


def test_noise_reports_the_farthest_run_and_the_median_run() -> None:
    """One drifted run of three sets the farthest-run noise but not the median absolute deviation;
    two drifted runs set both (the robust figure does not hide noise that is really there)."""
    import pandas as pd

    one = sim_fidelity.run_noise(pd.DataFrame({"r1": [100.0], "r2": [102.0], "r3": [120.0]}, index=["TPOT"]))
    assert one.loc["TPOT", "noise %"] == pytest.approx(100 * 18 / 102)
    assert one.loc["TPOT", "noise MAD %"] == pytest.approx(100 * 2 / 102)
    two = sim_fidelity.run_noise(pd.DataFrame({"r1": [80.0], "r2": [100.0], "r3": [120.0]}, index=["TPOT"]))
    assert two.loc["TPOT", "noise MAD %"] == pytest.approx(20.0)


def test_step_kinds_split_decodes_by_batch_size_and_mixed_from_prefill_steps() -> None:
    assert [sim_fidelity.step_kind(n) for n in ([1], [1, 1, 1], [1] * 12, [40, 1, 1], [64], [30, 20])] == [
        "decode 1", "decode 3", "decode 9+", "mixed", "prefill", "prefill"]


def test_a_bad_feature_name_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", "--features", "const", "--features", "const,decode_batch_x"])
    with pytest.raises(SystemExit) as e:
        sim_fidelity.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "decode_batch_x" in err and "decode_batch_K" in err


def test_probe_reading_sums_the_kinds_median_steps_and_reports_the_repeats_spread() -> None:
    repeats = [{"decode 1": [0.020, 0.022], "chunk": [0.100]},
               {"decode 1": [0.030, 0.024], "chunk": [0.110]},
               {"decode 1": [0.021, 0.023], "chunk": [0.090]}]
    seconds, spread = sim_fidelity.probe_reading(repeats)
    assert seconds == pytest.approx(0.0225 + 0.100)  # medians over every repeat's steps, per kind
    sums = [0.021 + 0.100, 0.027 + 0.110, 0.022 + 0.090]
    assert spread == pytest.approx((max(sums) - min(sums)) / sorted(sums)[1])
    with pytest.raises(ValueError, match="no chunk step"):
        sim_fidelity.probe_reading([{"decode 1": [0.02], "chunk": [0.1]}, {"decode 1": [0.02]}])


def test_each_run_is_timed_at_its_bracket_and_its_steps_rescaled_to_the_reference() -> None:
    speeds = sim_fidelity.run_speeds({"A #1": (0.20, 0.22), "B #1": (0.22, 0.18)}, reference=0.2)
    assert speeds == pytest.approx({"A #1": 1.05, "B #1": 1.0})
    rows = [([1, 1], [10, 20], 0.042, 2), ([64], [0], 0.21, None)]
    assert sim_fidelity.at_speed(rows, 1.05) == [([1, 1], [10, 20], 0.042 / 1.05, 2), ([64], [0], 0.21 / 1.05, None)]


def test_paired_errors_compare_each_run_with_its_own_simulation_and_take_the_median() -> None:
    import pandas as pd

    reals = pd.DataFrame({"A #1": [100.0, 10.0], "A #2": [110.0, 11.0], "A #3": [90.0, 12.0]}, index=["TTFT", "TPOT"])
    sims = pd.DataFrame({"A #1": [101.0, 10.0], "A #2": [99.0, 11.55], "A #3": [99.0, 12.0]}, index=["TTFT", "TPOT"])
    err = sim_fidelity.paired_errors(sims, reals)
    assert err.loc["TTFT", ["A #1", "A #2", "A #3"]].tolist() == pytest.approx([1.0, -10.0, 10.0])
    assert err.loc["TTFT", "adjusted error %"] == pytest.approx(1.0)
    assert err.loc["TPOT", "adjusted error %"] == pytest.approx(0.0)


def test_drift_agreement_compares_factors_relative_to_their_own_mean() -> None:
    steps = {"A #1": 0.9, "B #1": 1.0, "A #2": 1.1}
    r, worst = sim_fidelity.drift_agreement({k: 2 * v for k, v in steps.items()}, steps)
    assert r == pytest.approx(1.0) and worst == pytest.approx(0.0, abs=1e-9)
    r, worst = sim_fidelity.drift_agreement({"A #1": 1.0, "B #1": 1.0, "A #2": 1.0}, steps)
    assert worst == pytest.approx(10.0) and r != r  # a flat probe explains nothing: r undefined (NaN)


def test_the_speed_probe_reads_the_engine_and_a_run_at_speed_1_is_the_raw_comparison(tmp_path: Path) -> None:
    """On the tiny model: a reading is positive and labelled, and simulating the one real run at factor 1
    gives the raw comparison's error (the real median of one run is that run)."""
    from sim.cost.fitted import ProfiledCostModel, profile_rows
    from varlen.traces import load_trace

    args = argparse.Namespace(seqs=8, budget=128, blocks=256, max_len=256, clock="cpu")
    model, _ = sim_fidelity.fidelity_model("tiny", str(tmp_path))
    probe = sim_fidelity.SpeedProbe(model, "torch_sdpa", args, repeats=1, decode_steps=1)
    assert probe.read("now") > 0 and [w for w, _, _ in probe.readings] == ["now"]
    trace = load_trace("azure_conv", limit=6, max_model_len=args.max_len, over_length="clip")
    ticks = sim_fidelity.SpeedTicks(every=4)
    run = sim_fidelity.real_run("A", model, "torch_sdpa", sim_fidelity.slice_trace(trace, 0, 6, 50.0), args,
                                ticks, "A #1")
    assert len(ticks.samples["A #1"]) == len(run.steps) // 4  # a tick after every 4th step of the run
    cost = ProfiledCostModel.fit(profile_rows(run.steps))
    raw = sim_fidelity.compare(cost, "test", [run])
    adjusted = sim_fidelity.compare_at_speeds(cost, "test", [run], [1.0])
    metrics = ["TTFT p50 (ms)", "TPOT p50 (ms)", "throughput (tok/s)"]
    assert adjusted.loc[metrics, "adjusted error %"].tolist() == pytest.approx(raw.loc[metrics, "sim error %"].tolist())


def test_speed_ticks_come_after_every_kth_step_and_their_time_is_off_the_runs_clock() -> None:
    ticks = sim_fidelity.SpeedTicks(every=3)
    clock = sim_fidelity.CpuClock()
    after_step = ticks.on_step("A #1", clock)
    for _ in range(7):
        after_step([])
    assert len(ticks.samples["A #1"]) == 2
    assert clock._idle == pytest.approx(-sum(ticks.samples["A #1"]), abs=1e-15)  # exactly what the ticks took
    ticks.burst("sim.profile passes", 5)
    assert len(ticks.samples["sim.profile passes"]) == 5 and ticks.median("sim.profile passes") > 0


def test_mean_table_averages_the_timings_row_by_row_and_keeps_the_shape_columns() -> None:
    a = [{"num_tokens": 1, "time_stats.add.median": 1.0, "time_stats.add.max": 3.0, "n_head": 8},
         {"num_tokens": 2, "time_stats.add.median": 2.0, "time_stats.add.max": 2.0, "n_head": 8}]
    b = [{"num_tokens": 1, "time_stats.add.median": 3.0, "time_stats.add.max": 5.0, "n_head": 8},
         {"num_tokens": 2, "time_stats.add.median": 4.0, "time_stats.add.max": 4.0, "n_head": 8}]
    got = sim_fidelity.mean_table([a, b])
    assert got == [{"num_tokens": 1, "time_stats.add.median": 2.0, "time_stats.add.max": 4.0, "n_head": 8},
                   {"num_tokens": 2, "time_stats.add.median": 3.0, "time_stats.add.max": 3.0, "n_head": 8}]


def test_build_agreement_compares_two_builds_by_step_kind() -> None:
    """B over A on every step, median by kind (decode k, mixed, prefill) and over all, and the largest kind gap."""

    class Build:
        def __init__(self, decode: float, chunk: float) -> None:
            self.decode, self.chunk = decode, chunk

        def step_time(self, new, cached, logits=None) -> float:
            return (self.decode if max(new) == 1 else self.chunk) * len(new)

    rows = [([1], [10], 0.0, 1), ([1, 1], [10, 20], 0.0, 2), ([1, 50], [10, 0], 0.0, 2), ([64], [0], 0.0, 1)]
    got = sim_fidelity.build_agreement(Build(1.0, 2.0), Build(1.02, 1.9), rows)
    assert got["decode 1"] == pytest.approx(1.02) and got["decode 2"] == pytest.approx(1.02)
    assert got["mixed"] == pytest.approx(0.95) and got["prefill"] == pytest.approx(0.95)
    assert got["worst kind gap %"] == pytest.approx(5.0)
    assert got["all steps"] == pytest.approx((1.02 + 0.95) / 2)


def test_the_measured_build_times_two_tables_and_two_engine_passes_a_pair(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """Tables after each of the first two pairs, two engine passes after every pair, each pass its own group:
    build A takes each pair's first pass, build B its second (so the two builds' figures are apart)."""
    import sim.profile

    calls: list[str] = []
    monkeypatch.setattr(sim.profile, "profile_model", lambda *a, **k: calls.append("ops") or ["ops"])
    monkeypatch.setattr(sim.profile, "profile_attention", lambda *a, **k: calls.append("attention") or ["att"])

    def engine(*a, passes=None, groups_out=None, **k):
        calls.append(f"engine x{passes}")
        groups_out += [p for p in range(passes) for _ in range(2)]
        return [("row", p) for p in range(passes) for _ in range(2)]

    monkeypatch.setattr(sim.profile, "profile_engine", engine)
    prof = sim_fidelity.MeasuredProfiler(str(tmp_path), "torch_sdpa", str(tmp_path / "p")) \
        if (tmp_path / "config.json").write_text("{}") else None
    for i in range(3):
        prof.between_runs(i)
    assert calls == ["ops", "attention", "engine x2"] * 2 + ["engine x2"]
    assert len(prof.tables) == 2 and prof.groups == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert len(prof.rows) == 12


def test_each_engine_pass_is_ticked_apart_and_fitted_at_its_own_speed(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The passes a measured build fits its overhead on ran at 0.75-1.0x each other's speed: each pass's ticks,
    taken among its steps as among a run's, are kept under its own label, and its steps are divided by its own
    factor before the fit."""
    import sim.profile

    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((1, 4, 2), (2, 4, 2)))

    def engine(*a, passes=None, groups_out=None, on_step=None, **k):
        rows = []
        for p in range(passes):
            for _ in sim.profile.ENGINE_BATCHES:
                after = on_step(p)
                for _ in range(8):  # a batch of 8 steps: a tick after the 4th and the 8th
                    rows.append(([1], [10], 0.02 * (p + 1), 1))  # the second pass twice as slow
                    groups_out.append(p)
                    after([])
        return rows

    monkeypatch.setattr(sim.profile, "profile_engine", engine)
    (tmp_path / "config.json").write_text("{}")
    prof = sim_fidelity.MeasuredProfiler(str(tmp_path), "torch_sdpa", str(tmp_path / "p"))
    prof.TABLE_PAIRS = 0  # no tables: the engine passes alone
    ticks = sim_fidelity.SpeedTicks()
    prof.between_runs(1, ticks)
    assert sorted(ticks.samples) == ["sim.profile pass 2", "sim.profile pass 3"]
    assert all(len(v) == 2 * 2 for v in ticks.samples.values())  # 2 ticks in each of a pass's 2 batches
    ticks.samples = {"sim.profile pass 2": [1.0, 1.2, 1.1], "sim.profile pass 3": [0.9], "sim.profile pass 4": [1.5],
                     "bursts after the runs": [9.0]}  # another kind of sample: never set against the passes'
    assert sim_fidelity.pass_factors(ticks, [2, 2, 3, 4]) == pytest.approx({2: 1.0, 3: 0.9 / 1.1, 4: 1.5 / 1.1})

    fitted: list = []
    monkeypatch.setattr(sim.profile, "write_table", lambda *a, **k: None)
    monkeypatch.setattr(sim.profile, "fit_engine_overhead", lambda rows, *a, **k: fitted.append(rows) or {})
    monkeypatch.setattr("sim.cost.measured.MeasuredCostModel", lambda *a, **k: "model")
    prof.pass_speeds = {2: 1.0, 3: 2.0}
    prof._build(tmp_path / "b", ([], []), lambda g: True)
    assert [t for _, _, t, _ in fitted[0]] == pytest.approx([0.02] * 32)  # every pass at the reference speed


def test_the_verdict_judges_the_adjusted_figure_only_when_the_real_runs_stray_past_the_goal() -> None:
    quiet = sim_fidelity.verdict({"profiled": 4.0, "measured": 6.0}, {"profiled": 9.0, "measured": 1.0}, noise=3.0)
    assert "judged figure: raw" in quiet[0]
    assert quiet[1].startswith("  profiled: PASS at 4.0%") and quiet[2].startswith("  measured: MISS at 6.0%")
    noisy = sim_fidelity.verdict({"profiled": 4.0, "measured": 6.0}, {"profiled": 9.0, "measured": 1.0}, noise=15.0)
    assert "judged figure: speed-adjusted" in noisy[0] and "15.0% (> 5%)" in noisy[0]
    assert noisy[1].startswith("  profiled: MISS at 9.0%") and noisy[2].startswith("  measured: PASS at 1.0%")
    assert "raw 4.0%" in noisy[1]  # the raw figure stays beside the judged one
    none = sim_fidelity.verdict({"profiled": 4.0}, {}, noise=15.0)
    assert "judged figure: raw, for want of" in none[0] and "cannot resolve 5%" in none[0]


def _passes_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ticks: dict[int, float], k: float):
    """A MeasuredProfiler whose engine passes' steps ran at tick ** k (0.02 s at 1), its builds faked: the
    fit returns nothing and the model times every step at 0.02 s. Returns it and the rows each fit got."""
    import sim.profile

    (tmp_path / "config.json").write_text("{}")
    prof = sim_fidelity.MeasuredProfiler(str(tmp_path), "torch_sdpa", str(tmp_path / "p"))
    prof.tables = [([], []), ([], [])]
    prof.groups = [g for g in ticks for _ in range(3)]
    prof.rows = [([1, 1], [10, 20], 0.02 * ticks[g] ** k, 2) for g in prof.groups]
    fitted: list = []
    fit = {"const_ms": 1.0, "per_seq_ms": 0.1, "per_prefill_ms": 0.1, "ops_scale": 1.0, "decode_ops_scale": 1.0,
           "steps": len(prof.rows), "step_mape_pct": 0.0}

    class Model:
        notes: list[str] = []

        def step_time(self, new, cached, logits) -> float:
            return 0.02

    monkeypatch.setattr(sim.profile, "write_table", lambda *a, **kw: None)
    monkeypatch.setattr(sim.profile, "fit_engine_overhead", lambda rows, *a, **kw: fitted.append(rows) or fit)
    monkeypatch.setattr("sim.cost.measured.MeasuredCostModel", lambda *a, **kw: Model())
    return prof, fitted


def test_the_speed_slope_is_fitted_on_the_passes_steps_and_divides_them_through_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    """Steps move ~1.7x as much as the ticks: the slope fitted on the passes' own steps recovers it, each pass
    is divided by tick ** k (all back at the reference speed, which dividing by the tick alone does not do),
    and a run's factor goes through the same slope."""
    ticks = {0: 0.85, 1: 0.93, 2: 0.97, 3: 1.0, 4: 1.04, 5: 1.12, 6: 1.2}  # over their median, as pass_factors
    prof, fitted = _passes_at(monkeypatch, tmp_path, ticks, 1.7)
    prof.model(ticks)
    assert prof.slope.form == "power" and prof.slope.k == pytest.approx(1.7, abs=0.01)
    assert prof.slope.r2 == pytest.approx(1.0)
    assert [t for _, _, t, _ in fitted[-1]] == pytest.approx([0.02] * len(prof.rows))  # the pooled build's rows
    assert prof.slope(1.1) == pytest.approx(1.1 ** 1.7, rel=1e-3)  # a run whose ticks are 10% slow: ~17.6%
    assert "k = 1.70 +- 0.00 (power" in capsys.readouterr().out
    prof.model(ticks, level=0.9)  # the passes ticked 10% fast against the runs: the model brought to the runs' speed
    assert [t for _, _, t, _ in fitted[-1]] == pytest.approx([0.02 / 0.9 ** 1.7] * len(prof.rows))


def test_a_steps_line_against_the_ticks_is_fitted_as_a_line() -> None:
    ticks = {g: t for g, t in enumerate((0.8, 0.9, 1.0, 1.1, 1.25))}
    slope = sim_fidelity.fit_speed_slope(ticks, {g: 1.0 + 1.7 * (t - 1.0) for g, t in ticks.items()})
    assert slope.form == "linear" and slope.k == pytest.approx(1.7)
    assert slope(1.1) == pytest.approx(1.17)


def test_the_slope_falls_back_to_1_when_the_passes_ticks_spread_too_little_or_it_is_not_positive(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ticks within 2%: the steps' noise over no signal would set k; k = 1, said so, and each pass divided
    by its tick factor itself."""
    ticks = {0: 0.99, 1: 1.0, 2: 1.01, 3: 0.995}
    prof, fitted = _passes_at(monkeypatch, tmp_path, ticks, 5.0)
    prof.model(ticks)
    assert prof.slope.k == 1.0 and "spread 2.0%" in prof.slope.note and "fallback" in prof.slope.describe()
    assert [t for _, _, t, _ in fitted[-1]] == pytest.approx(
        [0.02 * ticks[g] ** 4 for g in prof.groups])  # divided by the tick (k = 1), not tick ** 5
    backwards = sim_fidelity.fit_speed_slope({0: 0.9, 1: 1.0, 2: 1.1}, {0: 1.1, 1: 1.0, 2: 0.9})
    assert backwards.k == 1.0 and "not positive" in backwards.note
    # Points a third of whose variance the slope explains (this machine's passes): k 0.6 +- 0.3, not told from 1.
    ticks = {0: 1.022, 1: 1.058, 2: 0.986, 3: 1.014, 4: 0.946, 5: 0.986}
    loose = sim_fidelity.fit_speed_slope(ticks, {0: 1.005, 1: 1.021, 2: 0.995, 3: 0.964, 4: 0.935, 5: 1.006})
    assert loose.k == 1.0 and "within two standard errors of 1" in loose.note and 0.2 < loose.se < 0.4


def test_a_cells_resolution_is_how_far_a_1pct_step_time_change_moves_its_simulation() -> None:
    """Every step 1% slower or faster moves a steady decode metric by about 1% (TPOT, step-bound) and leaves the
    offered load's throughput; the largest move over the factors, against the metric at 1."""
    from sim.validate import fresh_copies, simulate_like

    run, cost = _slice_and_model()
    sim = simulate_like(fresh_copies(run.originals), run.make_policy, run.make_kv, 256, cost)
    base = sim_fidelity.headline(sim.requests, sim.steps, sim.total_slots)
    moves = sim_fidelity.resolution(cost, [run], base)
    assert moves["TPOT p50 (ms)"] == pytest.approx(1.0, abs=0.05)
    assert moves["throughput (tok/s)"] < 1.0
    assert set(sim_fidelity.GOAL_METRICS) <= set(moves.index)


def test_step_jitter_is_each_runs_scatter_over_its_median_by_kind_with_mean_1() -> None:
    """A run 20% slow throughout (drift) adds the same factors as the one it copies, not more spread; decode-only
    steps and steps with a prompt chunk draw apart; each kind's factors average 1 (the model's mean step stays)."""

    class Flat:
        def step_time(self, new, cached, logits=None) -> float:
            return 0.1 if max(new) > 1 else 0.01

    run = [([1], [5], 0.010, 1), ([1, 1], [5, 6], 0.012, 2), ([1], [7], 0.008, 1), ([64], [0], 0.11, 1)]
    slow = [(new, cached, 1.2 * t, logits) for new, cached, t, logits in run]
    pools = sim_fidelity.step_jitter(Flat(), [run, slow])
    assert sorted(pools["decode"]) == pytest.approx(sorted([1.0, 1.2, 0.8] * 2))
    assert pools["chunk"] == pytest.approx([1.0, 1.0])  # 1.1 over the run's median 1.0, over the kind's mean 1.1
    assert set(sim_fidelity.step_jitter(Flat(), [run[:3]])) == {"decode"}  # no chunk steps: none to draw from


def _slice_and_model():
    from functools import partial

    from schedulers import ChunkedPolicy
    from sim.cost.fitted import ProfiledCostModel
    from varlen.kv import PagedAllocator
    from varlen.sampling_params import SamplingParams
    from varlen.traces import Trace, TraceStats, load_trace
    from varlen.workload import trace_requests

    trace = load_trace("azure_conv", limit=8, max_model_len=256, over_length="clip")
    reqs = trace_requests(Trace(sim_fidelity.slice_trace(trace, 0, 8, 0.5), TraceStats("slice", "azure")), 1000,
                          SamplingParams(ignore_eos=True, temperature=0.0), token_ids=True)
    run = sim_fidelity.RealRun("A", [], {}, reqs, partial(ChunkedPolicy, max_num_seqs=4, max_num_batched_tokens=64),
                               partial(PagedAllocator, 256, 16, 256), 256, 0.0, 0.0, {}, 0)
    rows = [([n] + [1] * d, [0] + [50] * d, 0.01 + 2e-4 * n + 1e-3 * d, 1 + d) for n in (1, 16, 64) for d in range(4)]
    return run, ProfiledCostModel.fit(rows)


def test_a_jittered_step_draws_its_kinds_factor_and_unit_factors_are_the_deterministic_simulation() -> None:
    """Unit factors reproduce the deterministic simulation (at its scale) exactly, though the decode fast path is
    off; spread factors move it, the same seed alike; a chunk step draws from the chunk factors only."""
    import numpy as np

    from sim.cost.scaled import ScaledCostModel

    run, cost = _slice_and_model()
    chunky = sim_fidelity.JitteredCostModel(cost, 1.0, {"chunk": np.array([2.0])}, seed=0)
    assert chunky.step_time([1, 1], [10, 20], 2) == cost.step_time([1, 1], [10, 20], 2)
    assert chunky.step_time([64, 1], [0, 20], 1) == pytest.approx(2.0 * cost.step_time([64, 1], [0, 20], 1))

    ones = {"decode": np.ones(3), "chunk": np.ones(2)}
    det, jittered, steps = sim_fidelity.simulated(cost, [run], 1.1, ones, seeds=2)
    assert jittered.shape[1] == 2 and steps > 0
    assert jittered[0].tolist() == pytest.approx(det.tolist(), rel=1e-12)
    at_scale, _, _ = sim_fidelity.simulated(ScaledCostModel(cost, 1.1), [run], 1.0)
    assert det.tolist() == pytest.approx(at_scale.tolist(), rel=1e-12)

    spread = {"decode": np.array([0.5, 1.5]), "chunk": np.array([0.5, 1.5])}
    _, a, _ = sim_fidelity.simulated(cost, [run], 1.0, spread, seeds=3)
    _, b, _ = sim_fidelity.simulated(cost, [run], 1.0, spread, seeds=3)
    assert a.equals(b)  # seeded: the same figures on every run of the benchmark
    assert not a[0].equals(a[1]) and not a[0].equals(det)
    assert sim_fidelity.simulated(cost, [run], 1.0, spread, seeds=0)[1] is None  # --jitter-seeds 0: deterministic

    # Every step through step_total: the decode fast path (which reuses a stretch's end times) is off for it.
    from sim.executor import CostModelExecutor
    from varlen.clock import SimClock

    assert CostModelExecutor(cost, SimClock())._decode
    assert not CostModelExecutor(chunky, SimClock())._decode


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the stand-in run has no steps to count
def test_the_adjusted_figure_keeps_the_deterministic_error_beside_the_jittered_one() -> None:
    """Against a run the deterministic simulation matches, unit jitter leaves every error 0; spread jitter moves
    the judged (median) figure off it while the deterministic error stays printed at 0, with the seeds' spread."""
    import numpy as np

    run, cost = _slice_and_model()
    det, _, _ = sim_fidelity.simulated(cost, [run], 1.0)
    real = dataclasses.replace(run, headline=det.to_dict())  # a real run the simulation matches exactly
    ones = {"decode": np.ones(2)}
    err = sim_fidelity.compare_at_speeds(cost, "test", [real], [1.0], ones, seeds=2)
    assert err.loc[sim_fidelity.GOAL_METRICS, "adjusted error %"].abs().max() == pytest.approx(0.0, abs=1e-9)
    assert err.attrs["deterministic"].loc[sim_fidelity.GOAL_METRICS].abs().max() == pytest.approx(0.0, abs=1e-9)
    raw = sim_fidelity.compare(cost, "test", [real], {"decode": np.array([0.5, 1.5])}, seeds=4)
    assert raw.loc["TPOT p50 (ms)", "deterministic error %"] == pytest.approx(0.0, abs=1e-9)
    assert raw.loc["TPOT p50 (ms)", "sim error %"] != pytest.approx(0.0, abs=1e-6)
    assert raw.loc["TPOT p50 (ms)", "jitter sd %"] > 0
