"""A run's files do not depend on how many threads numpy's BLAS may use. OpenBLAS splits a long dot
product across its threads, so a figure reduced with np.dot moved in its last bits between a Ray cell
(OMP_NUM_THREADS=1) and the same cells in a process with two threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The disaggregated cells whose mean_kv_usage differed: ~16k steps, past the length at which OpenBLAS
# starts splitting a dot product.
ARGS = ["workload=synthetic", "workload.limit=80", "workload.rate=20", "cluster.mode=disaggregated",
        "cluster.prefill_replicas=1", "cluster.decode_replicas=2", "cluster.decode.num_blocks=120",
        "cluster.cells=3", "output.steps=true"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs: on one, OpenBLAS runs a single thread whatever it is told")
def test_a_runs_files_are_the_same_with_one_and_two_blas_threads(tmp_path: Path) -> None:
    for t in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "sim.run", *ARGS, f"hydra.run.dir={tmp_path / t}"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = tmp_path / "1", tmp_path / "2"
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s1["steps"] > 10_000  # long enough for OpenBLAS to split a dot product
    assert {k for k in s1 if s1[k] != s2.get(k)} <= {"sim_wall_s", "sim_requests_per_wall_s"}
    files = sorted(p.name for p in one.glob("*.csv"))
    assert "steps.csv" in files and files == sorted(p.name for p in two.glob("*.csv"))
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
