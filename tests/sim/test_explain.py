"""sim.explain: the parts of a step add up to its time for every shipped model, hardware and
cost model; the CLI writes explain.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sim.cost.fitted import ProfiledCostModel
from sim.cost.hardware import HardwareSpec, load_model_config
from sim.cost.replay import ReplayCostModel
from sim.explain import PARTS, breakdown
from sim.cost.profiles import load_profiles
from sim.cost.registry import build_cost_model

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted(p.stem for p in (ROOT / "conf/sim_model").glob("*.yaml") if p.stem != "local")
HARDWARE = sorted(p.stem for p in (ROOT / "conf/hardware").glob("*.yaml"))
STEP = ([700, 1, 1, 1], [0, 30, 900, 5000])


def _model(name: str) -> dict:
    return load_model_config(yaml.safe_load((ROOT / f"conf/sim_model/{name}.yaml").read_text())["config"])


def _check(parts: dict) -> None:
    assert set(parts) == {*PARTS, "total_s"}
    split = [v for k, v in parts.items() if k != "total_s" and v is not None]
    assert split and all(v >= 0 for v in split)
    assert sum(split) == pytest.approx(parts["total_s"], rel=1e-9)


@pytest.mark.parametrize("hw", HARDWARE)
@pytest.mark.parametrize("model", MODELS)
def test_parts_sum_to_total_for_every_model_hardware_and_cost_model(model: str, hw: str) -> None:
    cfg, spec = _model(model), HardwareSpec.load(hw)
    roof = breakdown(build_cost_model({"model": "roofline"}, cfg, spec, None), *STEP)
    _check(roof)
    assert roof["embedding_s"] is None and roof["communication_s"] == 0.0  # the gather sits in lm_head_s
    if spec.profile_gpu in load_profiles().gpus:
        meas = breakdown(build_cost_model({"model": "measured"}, cfg, spec, None), *STEP)
        _check(meas)
        assert None not in meas.values() and meas["linear_s"] > meas["lm_head_s"] > 0
    else:  # no tables for this GPU: the roofline's parts (test_measured_cost.py checks they are labelled)
        meas = breakdown(build_cost_model({"model": "measured"}, cfg, spec, None), *STEP)
        _check(meas)
        assert meas.keys() == roof.keys()
        for k, v in roof.items():
            assert meas[k] is None if v is None else meas[k] == pytest.approx(v, rel=1e-12), k
    fitted = ProfiledCostModel(coef={"const": 1e-3, "new_tokens": 2e-5, "num_seqs": 1e-4, "attn_work": 1e-9,
                                     "cached_tokens": 1e-7, "prefill_seqs": 5e-4})
    p = breakdown(fitted, *STEP)
    _check(p)
    assert p["overhead_s"] == pytest.approx(1e-3 + 4e-4 + 5e-4) and p["lm_head_s"] is None


@pytest.mark.parametrize("model", ["roofline", "measured"])
def test_parallel_breakdown_has_communication(model: str) -> None:
    m = build_cost_model({"model": model}, _model("llama3_70b"), HardwareSpec.load("a100_80gb_sxm"),
                         {"tensor": 4, "pipeline": 2})
    parts = breakdown(m, *STEP)
    _check(parts)
    assert parts["communication_s"] > 0


def test_replay_splits_nothing_and_bad_steps_fail() -> None:
    parts = breakdown(ReplayCostModel([0.25]), [5], [0])
    assert parts["total_s"] == 0.25 and all(parts[k] is None for k in PARTS)
    with pytest.raises(ValueError, match="step.new has 2 requests but step.cached has 1"):
        breakdown(ReplayCostModel([0.25]), [5, 1], [0])


def test_cli_prints_the_table_and_writes_explain_json(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "sim.explain", f"hydra.run.dir={tmp_path}", "sim_model=llama2_70b",
           "hardware=h100_sxm", "parallel.tensor=4", "cost.model=measured", "step.new=[512,1,1]", "step.cached=[0,100,2000]"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "linear: measured: h100/meta-llama/Llama-2-70b-hf TP4" in out.stdout and "total_s" in out.stdout
    assert "  per step" in out.stdout and "  x 3 requests" in out.stdout and "  x 1 prefills" in out.stdout
    d = json.loads((tmp_path / "explain.json").read_text())
    t = d["overhead_terms"]
    assert t["per_step_s"] + t["requests_s"] + t["prefills_s"] == pytest.approx(d["overhead_s"])
    d = json.loads((tmp_path / "explain.json").read_text())
    assert sum(d[k] for k in PARTS) == pytest.approx(d["total_s"], rel=1e-9)
    assert (d["tensor"], d["step_new"], d["step_cached"]) == (4, [512, 1, 1], [0, 100, 2000])
    bad = subprocess.run([*cmd[:4], "sim_model=llama2_70b", "hardware=a100_80gb_sxm"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "138.0 GB of weights per GPU vs 72.0 GB usable" in bad.stderr
