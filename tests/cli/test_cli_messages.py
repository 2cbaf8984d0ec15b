"""What a command says when the settings are valid but the outcome is not what was asked, or when the
fault is not a setting: a deployment search that finds nothing, a plug-in's own error, Hydra's config
errors, a sweep with one bad job. Run in this process through `run_cli`, as `python -m` runs them."""

from __future__ import annotations

import sys

import pytest

from tests.cli.test_cli_errors import SIM, SYNTHETIC, run_main


def run_cli_main(module: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    return run_main(module, args, monkeypatch, capsys, through_cli=True)


# ---------------------------------------------------------------------------------------------
# sim.search with nothing that qualifies

ONE_POINT = ["search.hardware=[h100_sxm]", "search.tensor=[1]", "search.scheduler=[chunked]",
             "search.max_num_batched_tokens=[512]", "workload.limit=200", "capacity.rel_tol=0.5"]


def test_a_search_that_finds_nothing_says_what_bound_it_in_one_line_exit_1(tmp_path, monkeypatch, capsys):
    # A 0.1 ms TTFT: no replica meets it even at capacity.low.
    code, out, err = run_cli_main("sim.search", [*ONE_POINT, "slo.ttft_s=0.0001", "slo.tpot_s=null",
                                                 f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("no deployment met the SLOs"), err
    assert "closest: h100_sxm TP1 PP1 chunked/512" in lines[0] and "capacity.low" in lines[0], lines[0]
    assert "Empty DataFrame" not in out and "Pareto set" not in out
    assert (tmp_path / "search.csv").is_file() and (tmp_path / "search.json").is_file()


def test_in_a_sweep_a_search_that_finds_nothing_says_so_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    code, stdout, err = run_cli_main("sim.search", ["-m", "hydra/launcher=basic", *ONE_POINT, "slo.tpot_s=null",
                                                    "slo.ttft_s=0.0001,1", f"hydra.sweep.dir={out}"],
                                     monkeypatch, capsys)
    assert code == 0, (code, stdout, err)
    assert [ln for ln in err.splitlines() if ln.startswith("no deployment")] != [], err
    assert "cheapest: h100_sxm TP1 PP1 chunked/512" in stdout and len(list(out.glob("*/search.json"))) == 2


def test_nothing_met_names_the_bound_of_the_closest_candidate():
    from sim.search import Point, nothing_met

    def pt(hw, **kw):
        p = Point(hw, 1, 1, "chunked", 512, cost_per_gpu_hour=1.0)
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    near, far = pt("a", status="over max_gpus", replicas=4), pt("b", status="over max_gpus", replicas=3)
    for p, att in ((near, 0.85), (far, 0.5)):
        p.checks.append({"replicas": p.replicas, "slo_attainment": att, "meets": False})
    line = nothing_met([far, near], 10.0, 0.9, 4, 8)
    assert "closest: a TP1 PP1 chunked/512 x4 replicas reached 85.0%" in line and "search.max_gpus=4" in line
    big = pt("c", status="over max_gpus", reason="needs 16 GPUs > search.max_gpus=8", replicas=16)
    assert "closest: c TP1 PP1" in nothing_met([big, pt("d", status="misses SLOs")], 10.0, 0.9, 8, 8)
    slow = [pt("e", status="misses SLOs", reason="misses", low_attainment=0.2),
            pt("f", status="misses SLOs", reason="misses", low_attainment=0.6)]
    assert "closest: f TP1 PP1 chunked/512 misses, reaching 60.0%" in nothing_met(slow, 10.0, 0.9, 8, 8)
    unfit = [pt("g", status="does not fit", reason="no room"), pt("h", status="error", reason="boom")]
    assert "every design was left out (1 does not fit, 1 error), e.g. g TP1 PP1 chunked/512: no room" in \
        nothing_met(unfit, 10.0, 0.9, 8, 8)
    unchecked = [pt("i", status="ok", replicas=2, replica_capacity=6.0)]
    assert "1 estimated to meet them were not checked (search.max_verify=0)" in nothing_met(unchecked, 10.0, 0.9, 8, 0)
    # Another criterion: the line names it instead of the SLOs, and the check's bound_by.
    near.checks[-1].update(bound_by="normalized_latency")
    line = nothing_met([far, near], 10.0, 0.9, 4, 8, "criterion normalized_latency (max_s_per_token=0.1), "
                                                     "steady state required")
    assert line.startswith("no deployment passed at 10 req/s (criterion normalized_latency (max_s_per_token=0.1)")
    assert "x4 replicas reached 85.0% SLO attainment, bound_by normalized_latency (" in line


# ---------------------------------------------------------------------------------------------
# A user's plug-in raising: its exception and its own frames, exit 1 (a setting error stays one line, exit 2)

PICKY = '''
from schedulers.chunked import ChunkedPolicy
from varlen.cli import SettingError


def _check(window):
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


class Picky(ChunkedPolicy):
    """chunked, with a setting of its own it checks, and a schedule that can be told to fail."""

    def __init__(self, max_num_seqs=64, max_num_batched_tokens=512, window=1, fail_in_schedule=False):
        super().__init__(max_num_seqs, max_num_batched_tokens)
        _check(window)
        if window > 100:
            raise SettingError(f"scheduler.window={window}: at most 100")
        self.fail_in_schedule = fail_in_schedule

    def schedule(self, kv):
        if self.fail_in_schedule:
            raise ValueError("schedule cannot decide")
        return super().schedule(kv)
'''


@pytest.fixture
def picky(tmp_path, monkeypatch):
    (tmp_path / "pkgs" / "mypicky").mkdir(parents=True)
    (tmp_path / "pkgs" / "mypicky" / "__init__.py").write_text("")
    (tmp_path / "pkgs" / "mypicky" / "policy.py").write_text(PICKY)
    (tmp_path / "conf" / "scheduler").mkdir(parents=True)
    (tmp_path / "conf" / "scheduler" / "picky.yaml").write_text("_target_: mypicky.policy.Picky\nwindow: 1\nfail_in_schedule: false\n")
    monkeypatch.setenv("VARLEN_CONFIG_PATH", str(tmp_path / "conf"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    yield tmp_path / "pkgs" / "mypicky" / "policy.py"
    for mod in [m for m in sys.modules if m.split(".")[0] == "mypicky"]:
        del sys.modules[mod]


@pytest.mark.parametrize("module", ["sim.run", "varlen.run"])
@pytest.mark.parametrize("setting, raised, frames", [
    ("scheduler.window=0", "ValueError: window must be >= 1, got 0", ["in __init__", "in _check"]),
    ("scheduler.fail_in_schedule=true", "ValueError: schedule cannot decide", ["in schedule"]),
])
def test_a_plugins_error_shows_its_traceback_trimmed_to_the_users_frames_exit_1(
        module, setting, raised, frames, picky, tmp_path, monkeypatch, capsys):
    args = ["scheduler=picky", setting, f"hydra.run.dir={tmp_path / 'out'}", *SYNTHETIC]
    args += SIM if module == "sim.run" else ["progress=false", "engine.threads=1"]
    code, out, err = run_cli_main(module, args, monkeypatch, capsys)
    # varlen.run announces its backend (backend=auto) before serving: not part of the error.
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("backend: auto -> ")]
    assert code == 1, (code, out, err)
    assert lines[0].startswith("error in a plug-in: ") and raised in lines[0], err
    assert lines[1].startswith("Traceback") and raised in lines[2:], err
    files = [ln.split('"')[1] for ln in lines if ln.lstrip().startswith("File ")]
    assert files and set(files) == {str(picky)}, err  # the user's frames only
    assert all(any(f in ln for ln in lines) for f in frames), err


def test_a_setting_error_a_plugin_raises_on_purpose_stays_one_line_exit_2(picky, tmp_path, monkeypatch, capsys):
    args = ["scheduler=picky", "scheduler.window=101", f"hydra.run.dir={tmp_path / 'out'}", *SIM, *SYNTHETIC]
    code, out, err = run_cli_main("sim.run", args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "scheduler.window=101" in lines[0], err


# ---------------------------------------------------------------------------------------------
# Hydra's own config errors: one line, exit 2, with the closest name

@pytest.mark.parametrize("module, arg, expect", [
    ("sim.run", "schedular=chunked", ["schedular is not a setting", "did you mean scheduler=chunked?", "hardware"]),
    ("sim.run", "scheduler=chunkd", ["scheduler=chunkd is unknown", "did you mean scheduler=chunked?",
                                     "sarathi", "VARLEN_CONFIG_PATH"]),
    ("sim.run", "engine.max_num_seq=3", ["engine.max_num_seq is not a setting",
                                         "did you mean scheduler.max_num_seqs=3?", "block_size"]),
    ("sim.run", "scheduler.max_num_seqz=3", ["did you mean scheduler.max_num_seqs=3?"]),
    ("sim.run", "engine.block_size=[1", ["engine.block_size=[1: cannot parse it"]),
    ("varlen.run", "backendd=torch_sdpa", ["did you mean backend=torch_sdpa?"]),
    ("varlen.run", "allocator=pagd", ["did you mean allocator=paged?", "contiguous", "VARLEN_CONFIG_PATH"]),
])
def test_hydras_config_errors_are_one_line_with_the_closest_name_exit_2(module, arg, expect, tmp_path,
                                                                        monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, out, err = run_cli_main(module, [arg, f"hydra.run.dir={tmp_path / 'out'}"], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert all(e in lines[0] for e in expect), lines[0]
    assert "+schedular" not in lines[0] and "HYDRA_FULL_ERROR" not in err
    assert "HYDRA_FULL_ERROR" not in __import__("os").environ  # run_cli leaves the environment as it was


# ---------------------------------------------------------------------------------------------
# Sweeps: every job checked before any starts, under every launcher

LAUNCHERS = {"basic": ["hydra/launcher=basic"], "joblib": [],  # joblib: sim.yaml's default
             "submitit_local": ["hydra/launcher=submitit_local"], "ray": ["hydra/launcher=ray"]}
PLUGINS = {"submitit_local": "hydra_plugins.hydra_submitit_launcher", "ray": "hydra_plugins.hydra_ray_launcher"}

SWEEPS = {  # module: (arguments, the bad jobs' numbers, what each bad line names)
    "sim.run": ([*SIM, *SYNTHETIC, "workload.rate=1,-1", "scheduler=chunked,sarathi"], [2, 3], "workload.rate=-1"),
    "sim.capacity": ([*SIM, *SYNTHETIC, "slo.ttft_s=1", "capacity.rel_tol=0.1,0"], [1], "capacity.rel_tol=0"),
    "sim.search": ([*SYNTHETIC, "search.target_rate=-2,6"], [0], "search.target_rate=-2"),
    "varlen.run": (["workload.limit=4,-1", "progress=false", "engine.threads=1"], [1], "workload.limit=-1"),
    "sim.run typo": ([*SIM, *SYNTHETIC, "scheduler=chunked,chunkd"], [1], "did you mean scheduler=chunked?"),
}


@pytest.mark.parametrize("sweep, launcher", [(s, "basic") for s in SWEEPS] + [("sim.run", n) for n in LAUNCHERS
                                                                             if n != "basic"])
def test_a_sweep_with_a_bad_job_names_each_in_one_line_and_starts_none_exit_2(sweep, launcher, tmp_path,
                                                                              monkeypatch, capsys):
    import importlib.util

    if launcher in PLUGINS and importlib.util.find_spec(PLUGINS[launcher]) is None:
        pytest.skip(f"{PLUGINS[launcher]} is not installed (the cluster extra: pip install -e '.[cluster]')")
    module, (args, bad, names) = sweep.split()[0], SWEEPS[sweep]
    out = tmp_path / "sweep"
    code, stdout, err = run_cli_main(module, ["-m", *LAUNCHERS[launcher], *args, f"hydra.sweep.dir={out}"],
                                     monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, stdout, err)
    assert [int(ln.split()[2]) for ln in lines] == bad, err  # "error: job N (...): ..."
    assert all(ln.startswith("error: job ") and names in ln for ln in lines), err
    assert not list(tmp_path.rglob("*.csv")) and not list(tmp_path.rglob("summary.json"))  # no job ran
    assert "simulating" not in stdout and "Launching" not in stdout
