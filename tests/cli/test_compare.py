"""`python -m varlen.compare`: runs of varlen.run, sim.run and sim.capacity (its slo_scale mode too)
side by side in one table, and `sim.capacity -m` ending with it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli_errors import run_main
from varlen.compare import main

ROOT = Path(__file__).resolve().parents[2]
SIM_SMALL = ["sim_model=tiny", "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=1024",
             "workload=synthetic", "workload.rate=20", "workload.limit=20", "progress.enabled=false"]


def command(tmp, module, *args):
    env = dict(os.environ, VARLEN_HOME=str(tmp / "home"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sim.run sweep over two policies (tiny model, 20 requests: about a second)."""
    tmp = tmp_path_factory.mktemp("sweep")
    res = command(tmp, "sim.run", "-m", f"hydra.sweep.dir={tmp / 'sweep'}", *SIM_SMALL, "scheduler=chunked,continuous")
    assert res.returncode == 0, res.stderr
    return tmp / "sweep"


def summaries(sweep_dir):
    return {json.loads(f.read_text())["scheduler"]: json.loads(f.read_text())
            for f in sorted(sweep_dir.rglob("summary.json"))}


def test_labels_say_what_differs_and_ratios_come_from_the_summaries(sweep, tmp_path, capsys):
    runs = summaries(sweep)
    t = main([str(sweep), "--plot", str(tmp_path / "cmp.png")])
    out = capsys.readouterr().out
    assert list(t["label"]) == ["scheduler=chunked", "scheduler=continuous"]  # the only override that differs
    assert "scheduler=continuous" in out and "ratios (METRIC/base) against: scheduler=chunked" in out
    base = runs["chunked"]
    for label, name in zip(t["label"], ["chunked", "continuous"]):
        row = t[t["label"] == label].iloc[0]
        for m in ("requests_per_s", "goodput_requests_per_s", "ttft_p50", "ttft_p99", "tpot_p99"):
            assert row[m] == runs[name][m]
            assert row[f"{m}/base"] == pytest.approx(runs[name][m] / base[m])
        assert math.isnan(row["capacity_requests_per_s"])  # not a capacity run: NaN, and the table says so
    assert "sim.run runs: n/a (NaN) for capacity_requests_per_s, slo_scale, bound_by" in out
    assert (tmp_path / "cmp.png").stat().st_size > 0

    # Another baseline, chosen by its label; fewer metrics.
    t = main([str(sweep), "--baseline", "scheduler=continuous", "--metrics", "ttft_p50"])
    assert list(t.columns) == ["label", "kind", "ttft_p50", "ttft_p50/base"]
    assert t["ttft_p50/base"].tolist() == pytest.approx(
        [runs["chunked"]["ttft_p50"] / runs["continuous"]["ttft_p50"], 1.0])


def test_runs_of_each_kind_in_one_table(sweep, tmp_path, monkeypatch, capsys):
    """A varlen.run run next to the sim.run sweep: labelled by its command too, NaN where a
    metric does not apply (varlen.run has no SLO figures)."""
    # In this process (a subprocess would spend ~10 s importing torch and transformers).
    monkeypatch.setenv("VARLEN_HOME", str(tmp_path / "home"))
    code, _, err = run_main("varlen.run", [f"hydra.run.dir={tmp_path / 'engine'}", "progress=false", "engine.threads=1",
                                           "workload.limit=4", "workload.output_len=uniform:2:4"],
                            monkeypatch, capsys, through_cli=True)
    assert code == 0, err
    t = main([str(sweep), str(tmp_path / "engine")])
    out = capsys.readouterr().out
    assert list(t["kind"]) == ["sim.run", "sim.run", "varlen.run"]
    assert all(lab.startswith(kind) for lab, kind in zip(t["label"], t["kind"]))
    assert len(set(t["label"])) == 3
    engine = json.loads((tmp_path / "engine" / "summary.json").read_text())
    row = t.iloc[2]
    assert row["requests_per_s"] == engine["requests_per_s"] and math.isnan(row["slo_attainment"])
    assert row["requests_per_s/base"] == pytest.approx(engine["requests_per_s"] / summaries(sweep)["chunked"]["requests_per_s"])
    assert "varlen.run runs: n/a (NaN) for goodput_requests_per_s, slo_attainment" in out


def test_slo_scale_runs_get_their_column_and_ratios(sweep, tmp_path, capsys):
    """Two `sim.capacity capacity.mode=slo_scale` runs (60 requests at 2 req/s, tiny model: seconds)
    next to the sim.run sweep: the scale, its ratio to the baseline's, bound_by, NaN elsewhere."""
    found = {}
    for name in ("chunked", "static"):
        res = command(tmp_path, "sim.capacity", f"hydra.run.dir={tmp_path / name}", "capacity.mode=slo_scale",
                      *SIM_SMALL, "workload.rate=2", "workload.limit=60", "slo.ttft_s=0.5", "slo.tpot_s=0.05",
                      "capacity.slo_scale.rel_tol=0.3", f"scheduler={name}")
        assert res.returncode == 0, res.stderr
        found[name] = json.loads((tmp_path / name / "slo_scale.json").read_text())
    assert all(f["slo_scale"] is not None for f in found.values()), found  # the ratio below is of two scales
    t = main([str(tmp_path / "static"), str(tmp_path / "chunked"), str(sweep)])
    out = capsys.readouterr().out
    assert list(t["kind"]) == ["sim.capacity/slo_scale"] * 2 + ["sim.run"] * 2
    for i, name in enumerate(["static", "chunked"]):
        row = t.iloc[i]
        assert row["label"].startswith("sim.capacity/slo_scale") and f"scheduler={name}" in row["label"]
        assert row["slo_scale"] == found[name]["slo_scale"] and row["bound_by"] == found[name]["bound_by"]
        assert row["slo_scale/base"] == pytest.approx(found[name]["slo_scale"] / found["static"]["slo_scale"])
        assert math.isnan(row["requests_per_s"]) and math.isnan(row["capacity_requests_per_s"])
    assert t["slo_scale"].iloc[2:].isna().all()
    assert "sim.capacity/slo_scale runs: n/a (NaN) for requests_per_s," in out
    assert "sim.run runs: n/a (NaN) for capacity_requests_per_s, slo_scale, bound_by" in out


@pytest.mark.parametrize("args", [["EMPTY"], ["SWEEP", "--baseline", "scheduler=fifo"], ["SWEEP", "--metrics", "speed"]])
def test_bad_input_fails_in_one_line(sweep, tmp_path, args):
    (tmp_path / "empty").mkdir()
    args = [{"EMPTY": str(tmp_path / "empty"), "SWEEP": str(sweep)}.get(a, a) for a in args]
    res = command(tmp_path, "varlen.compare", *args)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("error: ")
    if args[0].endswith("empty"):
        assert f"{tmp_path / 'empty'}: not a run" in res.stderr and "summary.json, capacity.json or slo_scale.json" in res.stderr


def test_a_capacity_sweep_ends_with_the_table(tmp_path):
    res = command(tmp_path, "sim.capacity", "-m", f"hydra.sweep.dir={tmp_path / 'cap'}", "workload.limit=40",
                  "slo.tpot_s=0.2", "capacity.rel_tol=0.5", "progress.enabled=false", "scheduler=chunked,static")
    assert res.returncode == 0, res.stderr
    tail = res.stdout[res.stdout.index(f"capacity sweep {tmp_path / 'cap'}:"):]
    lines = tail.splitlines()
    assert lines[1].split() == ["label", "kind", "capacity_requests_per_s", "bound_by", "criterion",
                                "capacity_requests_per_s/base"]
    found = {json.loads(f.read_text())["scheduler"]: json.loads(f.read_text())
             for f in (tmp_path / "cap").rglob("capacity.json")}
    assert set(found) == {"chunked", "static"}
    for line, name in zip(lines[2:4], ["chunked", "static"]):
        cells = line.split()
        assert cells[0] == f"scheduler={name}" and cells[3] == found[name]["bound_by"]
        assert cells[4] == found[name]["criterion"] == "slo_attainment"
        assert float(cells[2]) == pytest.approx(found[name]["capacity_requests_per_s"], rel=1e-3)
    # sim.report does not read capacity sweeps: it says which command does, in one line.
    res = command(tmp_path, "sim.report", str(tmp_path / "cap"))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "python -m varlen.compare" in res.stderr


def test_an_slo_scale_sweep_ends_with_its_own_table_and_a_mixed_one_says_so(tmp_path):
    """`sim.capacity -m capacity.mode=slo_scale`: the table shows each run's scale, its rate, bound_by
    and criterion (not an empty capacity column); a sweep over both modes says they differ."""
    small = [*(o for o in SIM_SMALL if not o.startswith(("workload.rate=", "workload.limit="))), "workload.rate=2",
             "workload.limit=60", "slo.ttft_s=0.5", "slo.tpot_s=0.05",
             "capacity.slo_scale.rel_tol=0.5", "capacity.rel_tol=0.5",
             "hydra.sweep.subdir=${hydra.job.num}"]  # job folders named by number: the overrides are too long
    res = command(tmp_path, "sim.capacity", "-m", f"hydra.sweep.dir={tmp_path / 'scale'}", *small,
                  "capacity.mode=slo_scale", "scheduler=chunked,static")
    assert res.returncode == 0, res.stderr
    tail = res.stdout[res.stdout.index(f"capacity sweep {tmp_path / 'scale'} (capacity.mode=slo_scale):"):]
    lines = tail.splitlines()
    assert lines[1].split() == ["label", "kind", "slo_scale", "rate_requests_per_s", "bound_by", "criterion",
                                "slo_scale/base", "rate_requests_per_s/base"]
    found = {json.loads(f.read_text())["scheduler"]: json.loads(f.read_text())
             for f in (tmp_path / "scale").rglob("slo_scale.json")}
    for line, name in zip(lines[2:4], ["chunked", "static"]):
        cells = line.split()
        assert cells[0] == f"scheduler={name}" and cells[4:6] == [found[name]["bound_by"], "slo_attainment"]
        assert float(cells[2]) == pytest.approx(found[name]["slo_scale"], rel=1e-3) and float(cells[3]) == 2
    assert "mixes" not in res.stdout

    res = command(tmp_path, "sim.capacity", "-m", f"hydra.sweep.dir={tmp_path / 'mixed'}", *small,
                  "capacity.mode=rate,slo_scale")
    assert res.returncode == 0, res.stderr
    tail = res.stdout[res.stdout.index(f"capacity sweep {tmp_path / 'mixed'}:"):]
    assert "this sweep mixes capacity.mode=rate and capacity.mode=slo_scale runs" in tail
    header = tail.splitlines()[2].split()
    assert header[2:7] == ["capacity_requests_per_s", "slo_scale", "rate_requests_per_s", "bound_by", "criterion"]
    assert "sim.capacity runs: n/a (NaN) for slo_scale, rate_requests_per_s" in tail
    assert "sim.capacity/slo_scale runs: n/a (NaN) for capacity_requests_per_s" in tail


def test_runs_whose_cost_is_partly_estimated_say_so_under_the_table(tmp_path, capsys):
    """A capacity run's cost_notes (what its cost model predicted or estimated) are printed under
    the table, naming the run; a run without any adds no line."""
    for name, notes in (("estimated", ["linear: estimated (roofline)"]), ("measured", [])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "capacity.json").write_text(json.dumps(
            {"scheduler": name, "capacity_requests_per_s": 2.0, "bound_by": "throughput", "criterion": "slo_attainment",
             "cost_model": "measured", "cost_notes": notes}))
    main([str(tmp_path / "estimated"), str(tmp_path / "measured")])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "not from measurements" in ln]
    assert lines == ["[estimated]: cost measured, not from measurements: linear: estimated (roofline)"], out
