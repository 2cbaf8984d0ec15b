"""`python -m varlen.run` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest


def run_cli(tmp_path, *overrides):
    env = dict(os.environ, VARLEN_HOME=str(tmp_path / "home"))
    return subprocess.run(
        [sys.executable, "-m", "varlen.run", f"hydra.run.dir={tmp_path / 'out'}", "progress=false",
         "engine.threads=1", "workload.limit=6", "workload.output_len=uniform:2:6", *overrides],
        capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("combo", [("scheduler=chunked", "allocator=paged"),
                                   ("scheduler=static", "allocator=contiguous", "backend=torch_sdpa")])
def test_run_writes_tables_and_summary(tmp_path, combo):
    res = run_cli(tmp_path, *combo)
    assert res.returncode == 0, res.stderr
    assert "output tokens/s" in res.stdout and "TTFT" in res.stdout and "KV cache:" in res.stdout
    assert "linear layers torch\n" in res.stdout  # the tiny model's layers are below auto's size (test_linear_kernels.py)
    out = tmp_path / "out"
    reqs = pd.read_csv(out / "requests.csv")
    steps = pd.read_csv(out / "steps.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(reqs) == 6 and set(reqs.finish_reason) == {"length"}
    assert summary["finished"] == 6 and steps.num_new_tokens.sum() >= reqs.prompt_tokens.sum()
    assert (out / "config_resolved.yaml").exists()
    # The backend that ran: the default (backend=auto) chose torch_paged and said so in one line.
    named = "backend=torch_sdpa" in combo
    assert summary["backend"] == ("torch_sdpa" if named else "torch_paged")
    assert ("backend: auto -> torch_paged (cpu float32)\n" in res.stderr) != named


def test_bad_choices_fail_in_one_clear_line(tmp_path):
    res = run_cli(tmp_path, "scheduler=fifo")  # Hydra's own error, in one line too (tests/cli/test_cli_messages.py)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("error: scheduler=fifo is unknown") and "chunked, continuous" in res.stderr
    res = run_cli(tmp_path, "backend=flash_attn")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: backend 'flash_attn'")


# ---------------------------------------------------------------------------------------------
# Run directories: every run and every sweep gets its own (varlen.cli.ClaimRunDir)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
SIM_SMALL = ["sim_model=tiny", "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=1024",
             "workload=synthetic", "workload.rate=20"]


def test_claim_dir_is_exclusive_across_threads_and_skips_used_dirs(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from varlen.cli import CLAIM, SettingError, claim_dir

    base = tmp_path / "run"
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: claim_dir(base), range(16)))
    assert len(set(got)) == 16 and all((d / CLAIM).is_file() for d in got)
    assert sorted(got) == sorted([base] + [tmp_path / f"run-{k}" for k in range(1, 16)])
    used = tmp_path / "old"
    used.mkdir()
    (used / "summary.json").write_text("{}")  # a run from before claims existed: never written into
    assert claim_dir(used) == tmp_path / "old-1"
    (tmp_path / "file").write_text("x")
    with pytest.raises(SettingError, match="regular file"):
        claim_dir(tmp_path / "file" / "sub")


def test_concurrent_runs_and_sweeps_never_share_a_directory(tmp_path):
    """Runs named alike (as two runs started in the same second are by ${now:%H-%M-%S}) and
    started together: each gets its own directory, holding its own results."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, "-m", "sim.run", *SIM_SMALL, f"workload.limit={n}",
                              f"hydra.run.dir={tmp_path / 'same'}"], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (11, 12)]
    sweeps = [subprocess.Popen([sys.executable, "-m", "sim.run", "-m", *SIM_SMALL, f"workload.limit={n},{n + 1}",
                                f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.n_jobs=1"], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (21, 31)]
    for p in runs + sweeps:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert len(summaries) == 2 + 4
    by_dir = {s.parent: json.loads(s.read_text())["requests"] for s in summaries}
    assert len(by_dir) == 6 and sorted(by_dir.values()) == [11, 12, 21, 22, 31, 32]
    for d, n in by_dir.items():  # each directory's tables are its own run's
        assert len(pd.read_csv(d / "requests.csv")) == n
        assert f"limit: {n}" in (d / "config_resolved.yaml").read_text()
    assert {d for d in by_dir if d.parent == tmp_path} == {tmp_path / "same", tmp_path / "same-1"}
    sweep_dirs = {d.parent for d in by_dir if d.parent != tmp_path}
    assert sweep_dirs == {tmp_path / "sweep", tmp_path / "sweep-1"}
    assert all((d / "summary.csv").is_file() for d in sweep_dirs)  # each sweep reported its own jobs
    assert {len(pd.read_csv(d / "summary.csv")) for d in sweep_dirs} == {2}


@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_demo_any_block_size(block_size):
    """The demo's block tables were hard-coded for block_size >= 4 (1, 2, 3 crashed)."""
    from varlen.demo import main

    assert main(["--block-size", str(block_size)]) <= 1e-4
