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
         "engine.threads=1", "workload.num_requests=6", "workload.output_len=uniform:2:6", *overrides],
        capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("combo", [("scheduler=chunked", "allocator=paged"),
                                   ("scheduler=static", "allocator=contiguous", "backend=torch_sdpa")])
def test_run_writes_tables_and_summary(tmp_path, combo):
    res = run_cli(tmp_path, *combo)
    assert res.returncode == 0, res.stderr
    assert "output tokens/s" in res.stdout and "TTFT" in res.stdout and "KV cache:" in res.stdout
    out = tmp_path / "out"
    reqs = pd.read_csv(out / "requests.csv")
    steps = pd.read_csv(out / "steps.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(reqs) == 6 and set(reqs.finish_reason) == {"length"}
    assert summary["finished"] == 6 and steps.num_new_tokens.sum() >= reqs.prompt_tokens.sum()
    assert (out / "config_resolved.yaml").exists()


def test_bad_choices_fail_in_one_clear_line(tmp_path):
    res = run_cli(tmp_path, "scheduler=fifo")
    assert res.returncode != 0 and "Available options in 'scheduler'" in res.stderr + res.stdout
    res = run_cli(tmp_path, "backend=flash_attn")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: backend 'flash_attn'")
