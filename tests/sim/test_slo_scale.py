"""DistServe's SLO scale (python -m sim.capacity capacity.mode=slo_scale): the tightest scale of the
SLOs at which the criterion still passes at a given rate, with sim.capacity's steady-state check."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.capacity import probe_rate
from sim.slo_scale import ScaleResult, scaled_meets, search_scale

# A 7B model on an A100 with vLLM V0 scheduling, ShareGPT-like lengths (as tests/sim/test_capacity.py).
TRACE = ["workload=synthetic", "workload.limit=150", "workload.prompt_len=lognormal:161:1.0",
         "workload.output_len=lognormal:338:1.0", "sim_model=llama2_7b", "hardware=a100_80gb_sxm",
         "scheduler=vllm_v0", "slo.ttft_s=0.1", "slo.tpot_s=0.02", "engine.max_model_len=2048",
         "capacity.criterion=distserve", "capacity.mode=slo_scale", "progress.enabled=false"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    from sim.run import CONF

    with initialize_config_dir(CONF, version_base="1.3"):
        return hydra_compose("sim", overrides=[*TRACE, *overrides])


def threshold(at: float, bound: str = "slo_attainment"):
    calls: list[float] = []

    def meets_at(s: float) -> tuple[bool, dict]:
        calls.append(s)
        return (s >= at, {"bound_by": None if s >= at else bound})
    return meets_at, calls


@settings(max_examples=10, deadline=None)
@given(st.floats(0.11, 9.9), st.sampled_from([0.01, 0.05, 0.2]))
def test_the_search_brackets_the_tightest_passing_scale(at: float, tol: float) -> None:
    meets_at, calls = threshold(at)
    r = search_scale(meets_at, 0.1, 10.0, tol)
    assert r.scale is not None and at <= r.scale <= at * (1 + tol) and r.bound_by == "slo_attainment"
    assert r.sustained and len(calls) == len(r.probes) <= 2 + math.ceil(math.log2(math.log(100) / math.log1p(tol))) + 1


def test_the_ends_of_the_range() -> None:
    assert search_scale(threshold(0.01)[0], 0.1, 10.0) == ScaleResult(0.1, "search_low", [
        {"slo_scale": 10.0, "meets": True, "bound_by": None}, {"slo_scale": 0.1, "meets": True, "bound_by": None}], True)
    r = search_scale(threshold(50.0)[0], 0.1, 10.0)
    assert r.scale is None and r.bound_by == "slo_attainment" and r.sustained and len(r.probes) == 1
    r = search_scale(threshold(50.0, "throughput")[0], 0.1, 10.0)  # the rate itself is not sustained
    assert r.scale is None and r.bound_by == "throughput" and not r.sustained and len(r.probes) == 1
    with pytest.raises(ValueError, match="0 < low < high"):
        search_scale(threshold(1.0)[0], 1.0, 1.0)


def test_the_scale_found_is_the_attainment_quantile_of_the_run() -> None:
    """The schedule does not read the SLOs, so the tightest scale at which 90% of requests meet TTFT and
    TPOT is the 90% quantile of each request's max(ttft / TTFT, tpot / TPOT): the search brackets it."""
    from sim.run import _simulate_paused
    from varlen.metrics import request_table

    cfg = compose("workload.rate=3", "workload.limit=100")
    res, _, lat = _simulate_paused(cfg, None, False)
    t = request_table(res.requests, lat)
    done = t["finish_reason"].isin(["length", "stop"]).to_numpy()
    need = np.maximum(t["ttft"].to_numpy(float) / 0.1, np.nan_to_num(t["tpot"].to_numpy(float) / 0.02))
    need = np.sort(np.where(done, need, np.inf))
    exact = need[math.ceil(0.9 * len(need)) - 1]
    r = search_scale(scaled_meets(cfg, None, None, probe_rate), 0.25, 8.0, 0.2)
    assert 0.25 < exact < 8
    assert r.sustained and r.scale is not None and exact <= r.scale <= exact * 1.2 + 1e-12, (exact, r)
    assert cfg.slo.ttft_s == 0.1 and cfg.slo.tpot_s == 0.02  # restored after the search


def test_an_unsustained_rate_fails_at_every_scale_after_one_probe() -> None:
    cfg = compose("workload.rate=200")
    r = search_scale(scaled_meets(cfg, None, None, probe_rate), 0.1, 10.0, 0.05)
    assert r.scale is None and not r.sustained and r.bound_by in ("throughput", "queue_growth")
    assert len(r.probes) == 1


def test_command_prints_the_scale_and_writes_json(tmp_path, monkeypatch, capsys) -> None:
    from tests.cli.test_cli_errors import run_main

    code, stdout, stderr = run_main("sim.capacity", [*TRACE, "workload.rate=3", "workload.limit=100",
                                                     "capacity.slo_scale.low=0.5", "capacity.slo_scale.high=8",
                                                     "capacity.slo_scale.rel_tol=0.2", f"hydra.run.dir={tmp_path}"],
                                    monkeypatch, capsys)
    assert code == 0, stderr
    out = SimpleNamespace(stdout=stdout)
    d = json.loads((tmp_path / "slo_scale.json").read_text())
    assert d["mode"] == "slo_scale" and d["rate_requests_per_s"] == 3 and d["criterion"] == "distserve"
    assert d["scaled_ttft_s"] == pytest.approx(0.1 * d["slo_scale"]) and d["sustained"] is True
    # The pass test in words, with the SLOs as given (scale 1), as capacity.json has it.
    assert d["criterion_text"] == ("criterion distserve (SLO TTFT <= 0.1 s, TPOT <= 0.02 s for 90% of requests), "
                                   "steady state required; every SLO x slo_scale")
    assert f"tightest SLO scale at 3 req/s: {d['slo_scale']:.3g}" in out.stdout
    probes = pd.read_csv(tmp_path / "slo_scale_probes.csv")
    assert len(probes) == d["probes"] and {"slo_scale", "meets", "bound_by"} <= set(probes.columns)


@pytest.mark.parametrize("overrides, message", [
    (["workload.rate=null"], "workload.rate=None.*searches the SLO scale at this one rate"),
    (["workload.rate=3", "capacity.slo_scale.high=0.05"], "capacity.slo_scale.high=0.05"),
    (["workload.rate=3", "capacity.mode=fastest"], "capacity.mode=fastest: give one of rate, slo_scale"),
])
def test_bad_settings_are_one_line_naming_them(overrides: list, message: str) -> None:
    from sim.capacity import check_capacity_settings
    from varlen.cli import SettingError

    with pytest.raises(SettingError, match=message):
        check_capacity_settings(compose(*overrides))


def test_the_rate_search_and_sim_search_refuse_the_scale_mode() -> None:
    from sim.capacity import capacity_search
    from sim.search import check_search_settings
    from varlen.cli import SettingError

    with pytest.raises(SettingError, match="capacity.mode=slo_scale: this is the rate search"):
        capacity_search(compose("workload.rate=3"))
    with pytest.raises(SettingError, match="sim.search bisects each design's rate"):
        check_search_settings(compose("workload.rate=3"))
