"""What a run assumed, said before its figures (sim/headline.py, sim/capacity.py), and progress
of disaggregated runs (sim/disagg.py's loop on sim/progress.py).

sim.run's first lines name the model, hardware, TP/PP, trace and limit, policy, allocator, cost model
and the SLOs in force (saying which are defaults); a trace more than 10% clipped or dropped gets a
warning line with the fix; the result line carries the prefix hit rate when prefix caching is on."""

import io
import re
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from sim import progress
from sim.run import CONF, simulate_config
from tests.sim.test_progress import LINE

TINY = ["sim_model=tiny", "hardware=cpu_2core", "engine.num_blocks=256", "workload=synthetic",
        "workload.limit=60", "workload.rate=20", "workload.prompt_len=uniform:16:400",
        "workload.output_len=uniform:4:32", "output.requests=false"]


def _main(module, overrides, tmp_path, monkeypatch, capsys) -> str:
    """Run `python -m sim.run` (or sim.capacity) in this process; its standard output."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *overrides, f"hydra.run.dir={tmp_path}"])
    GlobalHydra.instance().clear()
    try:
        module.main()
    finally:
        GlobalHydra.instance().clear()
    return capsys.readouterr().out


def _sim_run(overrides, tmp_path, monkeypatch, capsys) -> str:
    import sim.run

    return _main(sim.run, [*TINY, *overrides], tmp_path, monkeypatch, capsys)


def test_sim_run_headline_names_what_the_run_assumed(tmp_path, monkeypatch, capsys):
    out = _sim_run(["parallel.tensor=2", "+hardware.node=h100_dgx"], tmp_path, monkeypatch, capsys)
    head = out.split("\n  simulated")[0]
    assert "simulating 60 requests of synthetic (limit 60)" in head
    for field in ("1 replica(s) of tiny on cpu_2core TP2 PP1", "scheduler chunked", "allocator paged",
                  "cost roofline", "SLO TTFT <= 2 s, TPOT <= 0.1 s (defaults; set slo.ttft_s, slo.tpot_s)"):
        assert field in head, (field, head)
    assert "warning:" not in out  # 400 + 32 tokens fit the default max_model_len


def test_slos_set_by_the_user_are_not_called_defaults(tmp_path, monkeypatch, capsys):
    out = _sim_run(["slo.ttft_s=0.5"], tmp_path, monkeypatch, capsys)
    assert "SLO TTFT <= 0.5 s, TPOT <= 0.1 s (TPOT the default)" in out
    out = _sim_run(["slo.ttft_s=0.5", "slo.tpot_s=0.05", "slo.tbt_s=0.2"], tmp_path, monkeypatch, capsys)
    assert re.search(r"cost roofline; SLO TTFT <= 0\.5 s, TPOT <= 0\.05 s, TBT <= 0\.2 s$", out, re.M), out


@pytest.mark.parametrize("over_length, verb, fix", [("clip", "clipped to", "workload.over_length=drop"),
                                                     ("drop", "dropped as longer than", "workload.over_length=clip")])
def test_a_trace_mostly_over_max_model_len_gets_a_warning_line(over_length, verb, fix, tmp_path, monkeypatch, capsys):
    # Prompts of 16..400 tokens plus outputs: about three quarters are over 128 tokens.
    out = _sim_run(["engine.max_model_len=128", f"workload.over_length={over_length}"], tmp_path, monkeypatch, capsys)
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, out
    m = re.fullmatch(rf"warning: (\d+)% of synthetic's requests {verb} max_model_len=128; "
                     rf"raise engine.max_model_len or set {fix}", warning[0])
    assert m and 10 < int(m[1]) < 100, warning


def test_prefix_hit_rate_shown_when_prefix_caching_is_on(tmp_path, monkeypatch, capsys):
    out = _sim_run(["workload.token_ids=true"], tmp_path, monkeypatch, capsys)
    assert "allocator paged (prefix caching on)" in out
    assert re.search(r", prefix hit rate \d+\.\d%", out)
    # Content-free prompts turn caching off (every prompt would hit every other's blocks).
    out = _sim_run(["workload.token_ids=false"], tmp_path, monkeypatch, capsys)
    assert "allocator paged (prefix caching off)" in out and "prefix hit rate" not in out


def test_capacity_headline_names_what_the_search_assumed(tmp_path, monkeypatch, capsys):
    import sim.capacity

    out = _main(sim.capacity, [*TINY, "engine.max_model_len=128", "capacity.low=1", "capacity.high=2",
                               "capacity.rel_tol=0.5"], tmp_path, monkeypatch, capsys)
    lines = out.splitlines()
    assert lines[0].startswith("capacity search: chunked/paged, criterion slo_attainment (the SLO below for 90%")
    for field in ("trace synthetic (limit 60)", "tiny on cpu_2core TP1 PP1", "scheduler chunked", "allocator paged",
                  "cost roofline", "SLO TTFT <= 2 s, TPOT <= 0.1 s (defaults"):
        assert field in lines[1], (field, lines[1])
    # The trace is the same at every probed rate: one warning, not one per probe.
    assert sum(line.startswith("warning: ") and "clipped to max_model_len=128" in line for line in lines) == 1


def test_disaggregated_runs_show_progress_from_their_loop_and_the_same_summary():
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=[*TINY, "workload.limit=1500", "workload.rate=30", "cluster.mode=disaggregated",
                                        "cluster.prefill_replicas=2"])
    _, quiet = simulate_config(cfg)
    out = io.StringIO()
    with progress.showing(interval_s=0, label="disagg", stream=out, tty=False):
        _, shown = simulate_config(cfg)
    parsed = [LINE.match(line) for line in out.getvalue().splitlines()]
    assert parsed and all(parsed), out.getvalue()
    done = [int(m["done"].replace(",", "")) for m in parsed]
    assert {m["label"] for m in parsed} == {"disagg"}
    assert {int(m["total"].replace(",", "")) for m in parsed} == {1500}
    assert done[-1] == 1500 and done[0] < 1500 and done == sorted(done)  # lines from inside the loop, then the end
    timing = ("sim_wall_s", "sim_requests_per_wall_s")
    assert {k: v for k, v in shown.items() if k not in timing} == {k: v for k, v in quiet.items() if k not in timing}


def test_a_cost_model_s_estimates_are_named_in_the_headline(tmp_path, monkeypatch, capsys):
    """`measured` on a GPU whose tables lack the attention cases predicts those parts: the headline says
    which figures are not measured; the roofline (no tables, no notes) adds no such line."""
    base = ["sim_model=llama3_8b", "workload.limit=20", "engine.num_blocks=null"]
    out = _main(__import__("sim.run").run, [*base, "cost.model=measured", "hardware=a100_80gb_sxm",
                                             "workload=synthetic", "output.requests=false"], tmp_path, monkeypatch, capsys)
    line = next(ln for ln in out.splitlines() if "not from measurements" in ln)
    assert "cost measured" in line and "predicted from its GEMM shape" in line
    out = _main(__import__("sim.run").run, [*base, "workload=synthetic", "output.requests=false"],
                tmp_path / "r", monkeypatch, capsys)
    assert "not from measurements" not in out


# cost.model=measured on an H200 (no operator tables): its linear, lm_head, attention and overhead
# figures are estimates; a short trace and a two-probe bisection keep each command to seconds.
ESTIMATED = ["sim_model=llama3_8b", "hardware=h200_sxm", "cost.model=measured", "engine.num_blocks=null",
             "workload=synthetic", "workload.limit=60", "workload.prompt_len=uniform:16:400",
             "workload.output_len=uniform:4:32", "capacity.low=1", "capacity.high=2", "capacity.rel_tol=0.5",
             "capacity.verify_below=[]", "progress.enabled=false"]
ENTRY_POINTS = {
    "sim.capacity": ([], "capacity.json"),
    "sim.capacity slo_scale": (["capacity.mode=slo_scale", "workload.rate=2", "capacity.slo_scale.rel_tol=1"],
                               "slo_scale.json"),
    "sim.search": (["search.target_rate=2", "search.hardware=[h200_sxm]", "search.tensor=[1]",
                    "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]", "search.max_verify=1"],
                   "search.json"),
}


def _entry(name: str, overrides: list, tmp_path, monkeypatch, capsys) -> tuple[str, dict]:
    import importlib
    import json

    extra, file = ENTRY_POINTS[name]
    if name == "sim.search":  # it sets the hardware itself, from search.hardware
        overrides = [o for o in overrides if not o.startswith("hardware=")]
    out = _main(importlib.import_module(name.split()[0]), [*overrides, *extra], tmp_path, monkeypatch, capsys)
    return out, json.loads((tmp_path / file).read_text())


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_every_figure_reporting_entry_point_names_the_cost_model_s_estimates(name, tmp_path, monkeypatch, capsys):
    """sim.capacity (both modes) and sim.search print sim.run's not-from-measurements line, in its
    words, and record the same notes (`cost_notes`) in their JSON; the roofline's has none."""
    from omegaconf import OmegaConf

    from sim.capacity import cost_model_of
    from sim.headline import not_measured_line, unmeasured_notes

    out, found = _entry(name, ESTIMATED, tmp_path, monkeypatch, capsys)
    with initialize_config_dir(CONF, version_base="1.3"):
        expected = unmeasured_notes(cost_model_of(OmegaConf.to_container(compose("sim", overrides=ESTIMATED[:4]),
                                                                          resolve=True)))
    assert any(n.startswith("linear: estimated") for n in expected), expected  # not vacuous
    line = not_measured_line({"cost": {"model": "measured"}}, expected)
    # sim.search: after the hardware's first point, and under the chosen deployment's assumptions.
    assert [ln for ln in out.splitlines() if "not from measurements" in ln] == (
        [line + " (h200_sxm)", line] if name == "sim.search" else [line]), out
    notes = found["cost_notes"]["h200_sxm"] if name == "sim.search" else found["cost_notes"]
    assert notes == expected and found["cost_model"] == "measured"
    if name != "sim.search":
        assert "llama3_8b on h200_sxm TP1 PP1" in found["assumptions"] and "cost measured" in found["assumptions"]
        assert f"on {found['assumptions']}" in out  # the headline's words, printed and recorded
    else:
        import pandas as pd

        assert found["chosen"]["cost_notes"] == expected and "cost measured" in found["chosen"]["assumptions"]
        assert pd.read_csv(tmp_path / "search.csv").cost_notes.str.contains("linear: estimated").all()

    roofline = [o for o in ESTIMATED if not o.startswith("cost.model")]
    out, found = _entry(name, roofline, tmp_path / "roofline", monkeypatch, capsys)
    assert "not from measurements" not in out and found["cost_notes"] in ([], {})


@pytest.mark.parametrize("cells", [1, 2])
def test_sim_run_records_the_cost_model_s_estimates_and_a_celled_fleet_prints_them(cells, tmp_path, monkeypatch,
                                                                                    capsys):
    """sim.run's summary.json records `cost_notes` (varlen.compare flags such runs), and a fleet of
    cells prints the not-from-measurements line as a single fleet does."""
    import json

    from sim.headline import not_measured_line

    run = [o for o in ESTIMATED if not o.startswith(("capacity.", "progress."))]
    out = _main(__import__("sim.run").run, [*run, f"cluster.cells={cells}", "output.requests=false"],
                tmp_path, monkeypatch, capsys)
    notes = json.loads((tmp_path / "summary.json").read_text())["cost_notes"]
    assert any(n.startswith("linear: estimated") for n in notes), notes
    assert [ln for ln in out.splitlines() if "not from measurements" in ln] == [
        not_measured_line({"cost": {"model": "measured"}}, notes)], out
