"""sim.profile's engine overhead fit under noise: it recovers known coefficients when the steps are noisy
and a whole call runs slow, pins (and says so) a decode scale the data cannot tell from the per-step and
per-request terms, and reports how far halves of its passes disagree."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest

from sim.cost.measured import MeasuredCostModel
from sim.cost.profiles import SHIPPED

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)


@pytest.fixture()
def ops(tmp_path: Path) -> MeasuredCostModel:
    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    return MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.0, engine_overhead=False)


TRUE = dict(const=2e-3, per_seq=0.1e-3, per_prefill=0.5e-3, chunk=1.2, decode=1.05)


def engine(ops: MeasuredCostModel, new: list[int], cached: list[int], decode_scale: float | None = None) -> float:
    k = (decode_scale or TRUE["decode"]) if max(new) == 1 else TRUE["chunk"]
    return (k * ops.step_time(new, cached) + TRUE["const"] + TRUE["per_seq"] * len(new)
            + TRUE["per_prefill"] * sum(x > 1 for x in new))


def calls(passes: int) -> list[list[tuple[list[int], list[int]]]]:
    """profile_engine-like calls: each a batch's prefill chunks, then its decode steps as the cache grows."""
    out = []
    for _ in range(passes):
        for b, prompt, steps in ((1, 32, 20), (2, 900, 20), (4, 64, 20), (8, 400, 6), (16, 128, 12), (32, 200, 6)):
            call = [([prompt] * b, [0] * b)]
            call += [([1] * b, [prompt + i] * b) for i in range(steps)]
            out.append(call)
    return out


def rows_from(ops: MeasuredCostModel, passes: int, noise: float, call_noise: float = 0.0, seed: int = 0,
              decode_scale: float | None = None):
    """Rows with lognormal noise per step and per call (the machine's speed moves from one call to the next)."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    per_pass = len(calls(1))
    for c, call in enumerate(calls(passes)):
        speed = float(np.exp(rng.normal(0, call_noise)))
        for new, cached in call:
            rows.append((new, cached, engine(ops, new, cached, decode_scale) * speed * float(np.exp(rng.normal(0, noise))), None))
            groups.append(c // per_pass)
    return rows, groups


def decode_errors(tmp_path: Path, fit: dict, ops: MeasuredCostModel) -> list[float]:
    from sim.profile import write_table

    write_table([fit], tmp_path, "h200_sxm", "m", "overhead")
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    return [eng.step_time([1] * n, [300] * n) / engine(ops, [1] * n, [300] * n) - 1 for n in range(1, 9)]


def test_fit_recovers_known_coefficients_under_noise(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """3% noise per step over 3 passes: the decode steps at 1..8 requests within 2%, the chunk steps' scale
    within 3%, and the halves of the passes agree (spread_pct small, not unknown)."""
    from sim.profile import fit_engine_overhead

    rows, groups = rows_from(ops, 3, 0.03)
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path, groups=groups)
    errors = decode_errors(tmp_path, fit, ops)
    assert max(map(abs, errors)) < 0.02, errors
    assert fit["ops_scale"] == pytest.approx(TRUE["chunk"], rel=0.03)
    assert 0 <= fit["spread_pct"] < 3
    assert fit["pass_speed_min"] == pytest.approx(1, abs=0.02) and fit["pass_speed_max"] == pytest.approx(1, abs=0.02)


def test_more_passes_steady_the_predicted_decode_steps(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """Calls each at their own speed (10%, as a shared machine moves from one call to the next): five
    builds of 3 passes predict the decode steps closer together than five builds of one pass, the
    predictions' spread between builds being the calls' noise the fit averages over."""
    from sim.profile import fit_engine_overhead

    spread = {}
    for passes in (1, 3):
        preds = []
        for seed in range(5):
            rows, groups = rows_from(ops, passes, 0.02, call_noise=0.1, seed=seed)
            preds.append(decode_errors(tmp_path, fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path,
                                                                     groups=groups), ops))
        spread[passes] = float(np.ptp(np.array(preds), axis=0).max())
    assert spread[3] < 0.8 * spread[1], spread


def test_degenerate_decode_design_is_pinned_and_reported(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """Every decode-only step the same size and cache: their operator time is one number, so its scale
    cannot be told from the constant. The fit pins it to the chunk steps' and says why."""
    from sim.profile import fit_engine_overhead, overhead_confidence

    steps = [([1] * 4, [100] * 4)] * 12 + [([64], [0]), ([512], [0]), ([2048], [0]), ([200, 1, 1], [0, 50, 60]),
                                           ([512], [1024]), ([128, 128], [0, 64])]
    fit = fit_engine_overhead([(n, c, engine(ops, n, c), None) for n, c in steps], LLAMA3_8B, "h200_sxm", tmp_path)
    assert fit["decode_scale_pinned"] == 1
    assert fit["decode_ops_scale"] == fit["ops_scale"]
    assert "degenerate" in fit["decode_scale_note"]
    assert "pinned" in overhead_confidence(fit)
    assert math.isnan(fit["spread_pct"]) and "unknown" in overhead_confidence(fit)


def test_noisy_collinear_decode_scale_is_pinned(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """Decode steps whose operator time is near a straight line in their requests, under 5% noise: the
    scale's standard error is over the limit, so it is pinned rather than fitted into a swing."""
    from sim.profile import fit_engine_overhead

    rng = np.random.default_rng(3)
    steps = [([1] * b, [300] * b) for b in (1, 2, 4, 8) for _ in range(10)] + [
        ([64], [0]), ([512], [0]), ([2048], [0]), ([512], [1024]), ([128, 128], [0, 64])] * 3
    rows = [(n, c, engine(ops, n, c) * float(np.exp(rng.normal(0, 0.05))), None) for n, c in steps]
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path)
    assert fit["decode_scale_pinned"] == 1, fit
    assert "standard error" in fit["decode_scale_note"]


def test_unsteady_fit_is_reported(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """One pass run 1.5x slow throughout: the halves of the passes disagree and the line says so."""
    from sim.profile import SPREAD_WARN_PCT, fit_engine_overhead, overhead_confidence

    rows, groups = rows_from(ops, 2, 0.0)
    rows = [(n, c, t * (1.5 if g == 1 else 1.0), s) for (n, c, t, s), g in zip(rows, groups)]
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path, groups=groups)
    assert fit["spread_pct"] > SPREAD_WARN_PCT
    assert overhead_confidence(fit).startswith("WARNING: unsteady fit")


def test_new_overhead_columns_load_and_old_files_still_do(tmp_path: Path, ops: MeasuredCostModel) -> None:
    from sim.profile import fit_engine_overhead, write_table

    rows, groups = rows_from(ops, 2, 0.0)
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path, groups=groups)
    path = write_table([fit], tmp_path, "h200_sxm", "m", "overhead")
    header = path.read_text().splitlines()[0].split(",")
    assert {"spread_pct", "decode_scale_pinned"} <= set(header)
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert eng.step_time([1] * 4, [300] * 4) == pytest.approx(engine(ops, [1] * 4, [300] * 4), rel=1e-6)
    assert any(f"passes {fit['spread_pct']:.1f}% apart" in n for n in eng.notes), eng.notes
    fit["decode_scale_pinned"], fit["spread_pct"] = 1, float("nan")  # one pass, pinned: said so, no spread
    write_table([fit], tmp_path, "h200_sxm", "m", "overhead")
    notes = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path).notes
    assert any("scale pinned" in n and "apart" not in n for n in notes), notes
    path.write_text("const_ms,per_seq_ms,per_prefill_ms,steps,step_mape_pct\n2.5,0.01,0.3,100,5\n")
    old = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert old.overhead_form == pytest.approx((2.5e-3, 0.01e-3, 0.3e-3))


def test_cli_refuses_zero_engine_passes(capsys: pytest.CaptureFixture[str]) -> None:
    from sim.profile import main

    assert main(["--engine-passes", "0"]) == 2
    assert "--engine-passes 0" in capsys.readouterr().err


def test_profile_engine_passes_are_labelled_for_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_engine(passes=N) runs ENGINE_BATCHES N times and labels each row with its pass."""
    import sim.profile
    from varlen.tiny_model import ensure_tiny_model

    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((2, 8, 3), (1, 4, 2)))
    groups: list[int] = []
    rows = sim.profile.profile_engine(ensure_tiny_model("qwen3"), "torch_sdpa", 3, passes=3, groups_out=groups)
    assert len(groups) == len(rows) and sorted(set(groups)) == [0, 1, 2]
    per_pass = sum(b * (p + o - 1) for b, p, o in sim.profile.ENGINE_BATCHES)
    for p in range(3):
        assert sum(sum(new) for (new, *_), g in zip(rows, groups) if g == p) == per_pass


def test_profile_engine_calls_back_after_every_timed_step_with_its_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """on_step: a callback among each pass's steps (sim_fidelity's speed ticks, the runs' kind of sample), once
    after every timed step, told its pass; the steps are the same batches' as without it."""
    import sim.profile
    from varlen.tiny_model import ensure_tiny_model

    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((2, 8, 3), (1, 4, 2)))
    seen: list[int] = []
    groups: list[int] = []
    rows = sim.profile.profile_engine(ensure_tiny_model("qwen3"), "torch_sdpa", 3, passes=2, groups_out=groups,
                                      on_step=lambda p: lambda finished: seen.append(p))
    assert seen == groups and len(seen) == len(rows)
    per_pass = sum(b * (p + o - 1) for b, p, o in sim.profile.ENGINE_BATCHES)
    assert sum(sum(new) for new, *_ in rows) == 2 * per_pass


def test_profile_engine_takes_the_callbacks_cpu_time_off_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A callback among the steps (a speed tick) is not the engine's work: its CPU time stays off the step log,
    where profile_rows would charge it to the step before it (every 4th pass step ran ~9 ms slow).
    The CPU clock is a counter (1 ms a reading) so the steps' times do not depend on the machine's load."""
    import time
    import types

    import sim.profile
    from varlen.tiny_model import ensure_tiny_model

    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((2, 8, 6),))
    cpu = [0.0]

    def process_time() -> float:
        cpu[0] += 0.001
        return cpu[0]

    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake.process_time = process_time
    monkeypatch.setattr(sim.profile, "time", fake)

    def burn(finished) -> None:  # 20 ms of the callback's own CPU after every step
        cpu[0] += 0.02

    def rows(callback) -> list:
        cpu[0] = 0.0
        return sim.profile.profile_engine(ensure_tiny_model("qwen3"), "torch_sdpa", 3, passes=1,
                                          on_step=lambda p: callback)

    quiet, burnt = rows(lambda finished: None), rows(burn)
    assert len(quiet) >= 5 and all(t > 0 for _, _, t, _ in quiet)
    # The same steps read the clock the same number of times: only the callback's 20 ms could differ.
    assert [t for _, _, t, _ in burnt] == pytest.approx([t for _, _, t, _ in quiet], abs=1e-9)


def test_profile_engine_runs_the_simulated_engines_budget_and_seats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overhead is fitted on the steps the simulated engine makes: at its token budget its prompts come in
    chunks of at most that many tokens and at its seats no more decodes share a step (the fixed 512 / 64 engine
    ran 512-token chunks for a 256-token engine's fit)."""
    import sim.profile
    from varlen.tiny_model import ensure_tiny_model

    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((6, 100, 3),))
    folder = ensure_tiny_model("qwen3")
    default = sim.profile.profile_engine(folder, "torch_sdpa", 3, passes=1)
    assert max(sum(new) for new, *_ in default) > 64 and max(len(new) for new, *_ in default) > 4
    rows = sim.profile.profile_engine(folder, "torch_sdpa", 3, passes=1,
                                      settings={"max_num_batched_tokens": 64, "max_num_seqs": 4, "num_blocks": 256})
    assert max(sum(new) for new, *_ in rows) <= 64 and max(len(new) for new, *_ in rows) <= 4
    assert sum(sum(new) for new, *_ in rows) == 6 * (100 + 3 - 1)  # every prompt and output still computed


def test_engine_settings_are_checked_where_they_enter(capsys: pytest.CaptureFixture[str]) -> None:
    from sim.profile import engine_settings, main

    assert engine_settings({"max_num_batched_tokens": 256})["max_num_batched_tokens"] == 256
    with pytest.raises(ValueError, match="block_size"):
        engine_settings({"block_size": 16})
    assert main(["--max-num-batched-tokens", "0"]) == 2
    assert "max_num_batched_tokens=0" in capsys.readouterr().err


def test_the_fidelity_benchmarks_measured_build_fits_at_its_real_runs_engine(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """benchmarks/sim_fidelity.py's `measured` fits its overhead on engine passes sized as its real runs."""
    import argparse
    import sys

    import sim.profile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sim_fidelity

    seen: list[dict] = []
    monkeypatch.setattr(sim.profile, "profile_engine", lambda *a, settings=None, groups_out=None, **k: (
        seen.append(settings) or []))
    args = argparse.Namespace(seqs=16, budget=256, max_len=1024, blocks=1024)
    prof = sim_fidelity.MeasuredProfiler(str(sim.profile.model_folder("tiny")), "torch_sdpa", str(tmp_path),
                                         sim_fidelity.fidelity_engine(args))
    prof.between_runs(1)  # a later pair: engine passes only
    assert seen == [{"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 1024, "num_blocks": 1024}]


def test_the_fit_follows_the_median_step_when_some_steps_run_slow(tmp_path: Path, ops: MeasuredCostModel) -> None:
    """A machine's slow seconds make a fifth of the steps 30-60% slow: the fit (least absolute relative
    deviations) still predicts the typical step, where least squares was pulled off it."""
    from sim.profile import fit_engine_overhead

    rows, groups = rows_from(ops, 3, noise=0.01, seed=3)
    rng = np.random.default_rng(4)
    rows = [(n, c, t * (1.0 + rng.uniform(0.3, 0.6)) if rng.random() < 0.2 else t, x) for n, c, t, x in rows]
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path, groups=groups)
    assert max(abs(e) for e in decode_errors(tmp_path, fit, ops)) < 0.02
