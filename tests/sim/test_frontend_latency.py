"""engine.frontend_latency_s: a serving front end's fixed latency per request (sim/run.py frontend_delay).
The engine's run is unchanged; every request's TTFT, e2e and scheduling delay as its client sees them
grow by exactly the setting, TPOT does not, and it reaches the capacity criteria (they read the same
table); colocated and disaggregated alike. A bad value is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import sim.run as sim_run
from varlen.cli import SettingError
from varlen.metrics import request_columns

BASE = ["sim_model=llama3_8b", "workload=azure_conv", "workload.limit=40", "progress.enabled=false"]


def run(*overrides):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        cfg = compose("sim", [*BASE, *overrides])
    res, row, results = sim_run._simulate_paused(cfg, None, False)
    cols = request_columns(res.requests, results)
    again = request_columns(res.requests)  # what a caller without the run's latencies writes (sim.search)
    for key in ("arrival", "ttft", "e2e", "scheduling_delay", "tpot"):
        np.testing.assert_allclose(again[key], cols[key], rtol=0, atol=1e-12)
    return res, row, cols


@pytest.mark.parametrize("mode", [[], ["cluster.mode=disaggregated"], ["output.token_times=true"], ["cluster.cells=2"]])
def test_frontend_latency_adds_to_what_the_client_sees_and_nothing_else(mode):
    res0, row0, c0 = run(*mode)
    res1, row1, c1 = run(*mode, "engine.frontend_latency_s=0.05")
    assert row0["frontend_latency_s"] == 0 and row1["frontend_latency_s"] == 0.05
    assert res1.num_steps == res0.num_steps  # the engine's own run is the same
    np.testing.assert_allclose(c1["arrival"], c0["arrival"], rtol=0, atol=1e-9)  # the trace's, in both
    for key in ("ttft", "e2e", "scheduling_delay"):
        np.testing.assert_allclose(c1[key], c0[key] + 0.05, rtol=0, atol=1e-9)
    np.testing.assert_allclose(c1["tpot"], c0["tpot"])
    assert row1["ttft_p50"] == pytest.approx(row0["ttft_p50"] + 0.05)
    assert row1["tpot_p50"] == pytest.approx(row0["tpot_p50"])


def test_frontend_latency_decides_a_ttft_slo():
    """The SLO attainment (and so every capacity criterion, which reads the same table) sees it."""
    _, row0, c0 = run("slo.tpot_s=null")
    ttft = float(np.median(c0["ttft"]))
    _, row_met, _ = run("slo.tpot_s=null", f"slo.ttft_s={ttft + 1.0}")
    _, row_missed, _ = run("slo.tpot_s=null", f"slo.ttft_s={ttft + 1.0}", "engine.frontend_latency_s=2.0")
    assert row_met["slo_attainment"] > 0.9 and row_missed["slo_attainment"] < 0.5


@pytest.mark.parametrize("value", ["-0.01", "fast"])
def test_bad_frontend_latency_is_one_line(value):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        cfg = compose("sim", [*BASE, f"engine.frontend_latency_s={value}"])
    with pytest.raises(SettingError, match=r"engine.frontend_latency_s=.*must be a number >= 0") as e:
        sim_run.check_settings(cfg)
    assert "\n" not in str(e.value)
