"""Sweeps beyond one machine: the same 4-job `python -m sim.run -m` sweep through Hydra's submitit
launcher (`submitit_local`: submitit's own local executor, the Slurm code path without Slurm) and
its Ray launcher (on a local Ray instance the sweep starts: 2 CPUs, no dashboard) reports exactly
what the default joblib launcher reports, but for wall times and paths; two `python -m sim.search`
jobs through submitit choose what they choose through joblib.

The launchers come with the `cluster` extra (`pip install -e '.[cluster]'`; scripts/setup.sh, which
CI runs, installs it); without them these tests skip, saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ["scheduler=chunked,sarathi", "workload.rate=2,8", "workload.limit=60", "engine.max_model_len=4096"]
# Two deployment searches (sim.search composes each grid point's config inside its job).
SEARCHES = ["search.target_rate=6,24", "workload.limit=40", "capacity.rel_tol=0.5", "search.hardware=[a40,h100_sxm]",
            "search.tensor=[1]", "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]"]
# Differ run to run by nature: how long the simulation took, where it wrote.
UNCOMPARED = ["sim_wall_s", "sim_requests_per_wall_s", "run_dir"]
LAUNCHERS = {
    "joblib": ([], None),  # sim.yaml's default (conf/sim/hydra/launcher/joblib_2.yaml)
    "submitit_local": (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], "hydra_submitit_launcher"),
    # address=local: a new instance, never one that `ray start` left running on this machine.
    "ray": (["hydra/launcher=ray", "hydra.launcher.ray.init.address=local", "+hydra.launcher.ray.init.num_cpus=2",
             "+hydra.launcher.ray.init.include_dashboard=false"], "hydra_ray_launcher"),
}
HINT = "install the cluster extra: pip install -e '.[cluster]' (scripts/setup.sh does)"


def missing(plugin: str | None) -> str | None:
    if plugin is None:
        return None
    try:
        found = importlib.util.find_spec(f"hydra_plugins.{plugin}") is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{plugin.replace('_', '-')} is not installed: {HINT}"


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """All the sweeps started at once (mostly they wait: on imports, on submitit's polling, on
    Ray starting), each into a directory of its own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray waits 60 s for its node to register by default; a loaded 2-core machine may need longer.
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="180")
    procs = {}
    if all(missing(plugin) for _, plugin in LAUNCHERS.values() if plugin):
        yield procs  # every test skips: no baseline to run
        return
    for name, (args, plugin) in LAUNCHERS.items():
        if missing(plugin):
            continue
        # One Ray instance at a time (two starting together on 2 loaded cores can miss Ray's
        # start-up timeout): searches go through submitit_local, which carries Hydra's state
        # into each job as the Ray launcher does.
        for module, settings in (("sim.run", SWEEP), ("sim.search", SEARCHES))[:1 if name == "ray" else 2]:
            out = tmp_path_factory.mktemp(name) / "sweep"
            cmd = [sys.executable, "-m", module, "-m", *args, *settings, f"hydra.sweep.dir={out}"]
            procs[name, module] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True, start_new_session=True), out)
    yield procs
    for p, _ in procs.values():
        if p.poll() is None:  # only after a failed test: each sweep ends by itself (Ray's instance with it)
            os.killpg(p.pid, signal.SIGKILL)  # the sweep's own process group: its jobs, Ray's processes
        p.communicate()


def finished(sweeps, name: str, module: str) -> tuple[Path, str]:
    proc, out = sweeps[name, module]
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{module} through {name}: rc={proc.returncode}\n{log[-4000:]}"
    return out, log


def report(sweeps, name: str) -> pd.DataFrame:
    out, log = finished(sweeps, name, "sim.run")
    assert "table and plots written to" in log, log[-2000:]
    table = pd.read_csv(out / "summary.csv")  # sim.report's table, written as the sweep ended
    assert len(table) == 4 and table.finished.eq(60).all(), table
    assert sorted(p.parent.name for p in out.glob("*/summary.json")) == sorted(
        f"{i}_{o}" for i, o in enumerate(f"engine.max_model_len=4096,scheduler={s},workload.limit=60,workload.rate={r}"
                                         for s in ("chunked", "sarathi") for r in (2, 8)))
    assert all(Path(d).parent == out for d in table.run_dir)
    return table.sort_values("overrides").reset_index(drop=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["submitit_local", "ray"])
def test_sweep_through_a_cluster_launcher_reports_what_joblib_reports(sweeps, name):
    reason = missing(LAUNCHERS[name][1])
    if reason:
        pytest.skip(reason)
    got, want = report(sweeps, name), report(sweeps, "joblib")
    assert list(got.columns) == list(want.columns)
    assert set(UNCOMPARED) <= set(got.columns)
    # Four different runs (two policies, two rates), each equal to its joblib twin, number for number.
    assert got.overrides.nunique() == 4 and got.requests_per_s.nunique() > 1
    pd.testing.assert_frame_equal(got.drop(columns=UNCOMPARED), want.drop(columns=UNCOMPARED), check_exact=True)


def searched(sweeps, name: str) -> list[dict]:
    out, _ = finished(sweeps, name, "sim.search")
    results = [json.loads(f.read_text()) for f in sorted(out.glob("*/search.json"))]
    assert [r["target_rate"] for r in results] == [6, 24]
    return results


def test_searches_through_submitit_choose_what_joblib_chooses(sweeps):
    reason = missing(LAUNCHERS["submitit_local"][1])
    if reason:
        pytest.skip(reason)
    got, want = searched(sweeps, "submitit_local"), searched(sweeps, "joblib")
    assert got == want  # choices, their checks, Pareto sets: no wall times or paths in search.json
    assert all(r["chosen"]["verified"] and r["pareto"] for r in got)
