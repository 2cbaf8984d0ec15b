"""`python -m sim.fit RUN_DIR`: the README's `sim.run cost.model=profiled cost.path=fit.json` runs as
written on a fit of a real varlen.run directory; the fit reads steps.csv's per-request columns; bad
input is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.cost.fitted import ProfiledCostModel
from sim.fit import FitInputError, fit_run, main

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env))


def test_a_real_run_fits_and_the_readme_command_runs(tmp_path, monkeypatch, capsys):
    from tests.cli.test_cli_errors import run_main

    # The real run in this process (a subprocess would spend ~10 s importing torch and transformers);
    # the README's commands below run as written.
    monkeypatch.setenv("VARLEN_HOME", str(tmp_path / "home"))
    code, _, err = run_main("varlen.run", [f"hydra.run.dir={tmp_path / 'real'}", "progress=false", "engine.threads=1",
                                           "workload.limit=12", "workload.output_len=uniform:8:16"],
                            monkeypatch, capsys, through_cli=True)
    assert code == 0, err
    fit = run(["sim.fit", str(tmp_path / "real"), "-o", "fit.json"], tmp_path)
    assert fit.returncode == 0, fit.stderr
    n_steps = len(pd.read_csv(tmp_path / "real" / "steps.csv"))
    model = ProfiledCostModel.load(tmp_path / "fit.json")
    assert model.report.n_steps == n_steps and f"fitted on {n_steps} steps" in fit.stdout
    assert model.meta["fitted_on"] == str((tmp_path / "real" / "steps.csv").resolve())
    # torch_paged sends prompts of >= 64 new tokens to SDPA: the fit prices the two paths apart.
    assert json.loads((tmp_path / "real" / "summary.json").read_text())["backend_long_query_min"] == 64
    assert model.long_query_min == 64 and "prompt chunks of >= 64 new tokens" in fit.stdout
    linear = [c for f, c in model.coefficients().items() if not f.startswith("decode_batch_")]  # offsets are signed
    assert min(linear) >= 0 and sum(linear) > 0
    # The README's command, as written (plus a short workload and an output folder).
    sim = run(["sim.run", "cost.model=profiled", "cost.path=fit.json", "sim_model=tiny", "hardware=cpu_2core",
               "workload.limit=20", f"hydra.run.dir={tmp_path / 'sim'}"], tmp_path)
    assert sim.returncode == 0, sim.stderr
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["cost_model"] == "profiled" and summary["finished"] == 20


def write_steps(path: Path, steps: list[tuple[list[int], list[int]]], cost) -> None:
    """A steps.csv of back-to-back steps (no idle gap) timed by cost(new_tokens, cached_tokens)."""
    rows, t = [], 0.0
    for i, (new, cached) in enumerate(steps):
        d = cost(new, cached)
        rows.append(dict(step=i, start=t, duration=d, num_seqs=len(new), num_waiting=1,
                         req_ids=" ".join(map(str, range(len(new)))), new_tokens=" ".join(map(str, new)),
                         cached_tokens=" ".join(map(str, cached))))
        t += d
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path / "steps.csv", index=False)


def test_the_fit_recovers_the_step_time_it_was_given(tmp_path):
    # Steps whose time is exactly 2 ms + 5 us per new token + 1 us per cached token.
    steps = [([n, 1, 1][: k], [c, 30, 7][: k]) for n in (1, 16, 64, 200) for c in (0, 50, 300) for k in (1, 2, 3)]
    write_steps(tmp_path / "run", steps, lambda new, cached: 2e-3 + 5e-6 * sum(new) + 1e-6 * sum(cached))
    model = fit_run(tmp_path / "run", features=["const", "new_tokens", "cached_tokens"])
    assert model.coefficients() == pytest.approx({"const": 2e-3, "new_tokens": 5e-6, "cached_tokens": 1e-6}, rel=1e-6)
    assert model.report.n_steps == len(steps) and model.report.r2 == pytest.approx(1.0)


@pytest.mark.parametrize("case, said", [
    ("missing", "no such directory"),
    ("no_steps", "steps.csv: not found"),
    ("no_detail", "no column new_tokens, cached_tokens"),
    ("too_few", "too few to fit"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, said):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
    if case == "no_detail":
        pd.DataFrame(dict(step=[0], start=[0.0], duration=[1e-3], num_waiting=[0])).to_csv(run_dir / "steps.csv")
    if case == "too_few":
        write_steps(run_dir, [([4], [0]), ([1], [4])], lambda new, cached: 1e-3)
    assert main([str(run_dir), "-o", str(tmp_path / "fit.json")]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and err.startswith("sim.fit: ")
    assert not (tmp_path / "fit.json").exists()
    with pytest.raises(FitInputError):
        fit_run(run_dir)


def test_the_default_fit_charges_the_lm_head_per_sampled_row():
    # Chunked prefill: a chunk that does not end its prompt samples nothing, so the LM head's rows
    # (logit_rows) differ from the step's requests; the default features must tell them apart.
    def cost(new, cached, logits):
        return 20e-3 + 0.6e-3 * sum(new) + 0.3e-3 * len(new) + 1e-3 * logits

    rows = []
    for chunk in (64, 128, 256):
        for decodes in (0, 1, 4, 9):
            for ends_prompt in (False, True):
                new, cached = [chunk] + [1] * decodes, [chunk] + [300 + 7 * i for i in range(decodes)]
                logits = decodes + ends_prompt
                rows.append((new, cached, cost(new, cached, logits), logits))
    model = ProfiledCostModel.fit(rows)
    got = model.coefficients()
    assert {k: got[k] for k in ("const", "new_tokens", "num_seqs", "logit_rows")} == pytest.approx(
        {"const": 20e-3, "new_tokens": 0.6e-3, "num_seqs": 0.3e-3, "logit_rows": 1e-3}, rel=1e-6)
    assert model.report.max_ape == pytest.approx(0.0, abs=1e-6)
    # A log where every request sampled cannot split the two: the request pays, logit_rows is 0.
    same = [(n, c, cost(n, c, len(n)), len(n)) for n, c, _, _ in rows]
    both = ProfiledCostModel.fit(same).coefficients()
    assert both["logit_rows"] == 0.0 and both["num_seqs"] == pytest.approx(1.3e-3, rel=1e-6)
