"""benchmarks/sim_fidelity.py's real runs: what the fidelity figures are measured on."""

from __future__ import annotations

import argparse
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
