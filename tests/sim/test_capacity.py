"""Sustainable capacity (sim.capacity): every probe must be in a steady state as well as pass the
capacity criterion (a plug-in group, conf/criterion); the answer is verified below it and says
which condition bound it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.capacity import bisect_rate, bound_by
from sim.criteria import Criterion, NormalizedLatency, SloAttainment, SteadyState, TbtP99SchedDelay, \
    build_criterion, checked, steady_state

# ShareGPT-like lengths (the vLLM paper's means), a 7B model on an A100 (no OPT-13B yaml ships),
# vLLM V0 scheduling, the SLOs.
SHAREGPT = ["workload=synthetic", "workload.limit=200", "workload.prompt_len=lognormal:161:1.0",
            "workload.output_len=lognormal:338:1.0", "sim_model=llama2_7b", "hardware=a100_80gb_sxm",
            "scheduler=vllm_v0", "slo.ttft_s=0.25", "slo.tpot_s=0.1", "engine.max_model_len=2048",
            "capacity.rel_tol=0.1"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    from sim.run import CONF

    with initialize_config_dir(CONF, version_base="1.3"):
        return hydra_compose("sim", overrides=[*SHAREGPT, *overrides])


def fifo_table(arrival_rate: float, service_rate: float, n: int = 200) -> pd.DataFrame:
    """One server, evenly spaced arrivals, a fixed service time: served in arrival order."""
    arrival = np.arange(n) / arrival_rate
    start, finish = np.empty(n), np.empty(n)
    free = 0.0
    for i, a in enumerate(arrival):
        start[i] = max(a, free)
        free = finish[i] = start[i] + 1 / service_rate
    return pd.DataFrame({"arrival": arrival, "first_scheduled": start, "finish": finish})


@settings(max_examples=10, deadline=None)
@given(st.floats(1, 50), st.floats(0.3, 3))
def test_steady_state_tells_a_queue_that_keeps_up_from_one_that_grows(arrival_rate, load):
    verdict = steady_state(fifo_table(arrival_rate, arrival_rate / load))
    if load <= 0.9:
        assert verdict.ok, verdict.reason
    elif load >= 1.15:
        assert not verdict.ok and verdict.bound_by in ("throughput", "queue_growth"), verdict.reason


def test_a_burst_whose_latency_outlasts_the_window_is_not_shown_sustainable():
    t = fifo_table(100.0, 1000.0)
    t["finish"] = t["arrival"] + 10.0  # all served at once, each taking longer than the whole arrival window
    v = steady_state(t)
    assert not v.ok and v.bound_by == "throughput" and "cannot be judged" in v.reason


@pytest.mark.parametrize("key, value", [("min_completion_ratio", 1.5), ("max_queue_growth", -1),
                                        ("min_window_requests", 0), ("warmup", 0.1)])
def test_steady_state_settings_are_checked(key, value):
    with pytest.raises(ValueError, match=key):
        SteadyState.of({key: value})


def test_bisection_verifies_below_and_withdraws_an_answer_that_fails_there():
    # Passing is not monotone: 10..12 passes (a burst), 6..10 fails, below 6 passes.
    best, probes = bisect_rate(lambda r: (r < 6 or 10 <= r <= 12, {"bound_by": None if r < 6 or 10 <= r <= 12
                                                                   else "throughput"}), 1, 11, rel_tol=0.05)
    assert best < 6 and any(not p["meets"] and p["rate"] < 11 for p in probes)
    assert bound_by(best, probes, 11) == "throughput"
    with pytest.raises(ValueError, match="verify_below"):
        bisect_rate(lambda r: (True, {}), 1, 2, verify_below=[1.5])


def test_criteria_read_the_request_table_and_summary():
    t = pd.DataFrame({"finish_reason": ["length", "length", "stop"], "ttft": [0.1, 0.5, 0.1],
                      "tpot": [0.05, 0.05, np.nan], "max_tbt": [0.3, 0.05, np.nan],
                      "normalized_latency": [0.2, 0.05, 0.02]})
    assert SloAttainment(0.6, ttft_s=0.2).check(t, {}).ok  # 2 of 3
    v = SloAttainment(0.6, ttft_s=0.2, tbt_s=0.1).check(t, {})  # the stall fails the first: 1 of 3
    assert not v.ok and v.bound_by == "slo_attainment"
    assert NormalizedLatency(0.1).check(t, {}).ok  # mean 0.09
    assert not NormalizedLatency(0.05).check(t, {}).ok
    t.loc[2, "finish_reason"] = "rejected"
    assert not NormalizedLatency(1.0).check(t, {}).ok  # every request must finish
    ok = TbtP99SchedDelay(0.1, 2.0)
    t.loc[2, "finish_reason"] = "stop"
    assert ok.check(t, {"tbt_p99": 0.09, "scheduling_delay_p50": 1.0}).ok
    v = ok.check(t, {"tbt_p99": 0.09, "scheduling_delay_p50": 2.5})
    assert not v.ok and v.bound_by == "tbt_p99_sched_delay" and "scheduling delay" in v.reason


def test_criteria_are_a_plugin_group_by_name_preset_or_class_path(tmp_path, monkeypatch):
    ctx = {"slo": {"ttft_s": 1.0, "tpot_s": 0.1, "tbt_s": 0.2}, "capacity": {"attainment": 0.95}}
    c = build_criterion("slo_attainment", None, ctx)
    assert isinstance(c, SloAttainment) and c.attainment == 0.95 and c.slos["tbt_s"] == 0.2
    d = build_criterion("distserve", None, ctx)
    assert d.attainment == 0.9 and d.slos == {"ttft_s": 1.0, "tpot_s": 0.1, "tbt_s": None}
    assert build_criterion("tbt_p99_sched_delay", None, ctx).tbt_p99_s == 0.2
    assert build_criterion("normalized_latency", {"max_s_per_token": 0.3}, ctx).max_s_per_token == 0.3
    assert isinstance(build_criterion("sim.criteria.NormalizedLatency", {"max_s_per_token": 0.3}, ctx),
                      NormalizedLatency)
    with pytest.raises(ValueError, match="slo.tbt_s"):
        build_criterion("tbt_p99_sched_delay", None, {**ctx, "slo": {**ctx["slo"], "tbt_s": None}})
    with pytest.raises(ValueError, match="unknown criterion 'nope'"):
        build_criterion("nope", None, ctx)
    # A user's criterion from VARLEN_CONFIG_PATH; what it returns is checked where it enters.
    (tmp_path / "criterion").mkdir()
    (tmp_path / "criterion" / "mine.yaml").write_text(f"_target_: {__name__}.Sloppy\n")
    monkeypatch.setenv("VARLEN_CONFIG_PATH", str(tmp_path))
    mine = build_criterion("mine", None, ctx)
    with pytest.raises(TypeError, match="must return sim.criteria.Verdict"):
        checked(mine, pd.DataFrame(), {})
    with pytest.raises(ValueError, match="not a capacity criterion"):
        build_criterion("collections.OrderedDict", None, ctx)


class Sloppy(Criterion):
    def check(self, requests, summary):
        return True  # not a Verdict: must not be read as a pass


def test_two_replicas_report_no_more_than_about_twice_one_and_run_there_is_steady():
    """The issue's case, small: before, two replicas reported the top of the search range (a
    200-request burst fits their KV pools); now each probe must be steady, so the answer is a
    rate the run sustains."""
    from sim.capacity import capacity_search
    from sim.run import _simulate_paused
    from varlen.metrics import request_table

    caps = {}
    for replicas in (1, 2):
        cfg = compose(f"cluster.replicas={replicas}")
        best, probes = capacity_search(cfg, {"scheduler": "vllm_v0", "allocator": "paged"})
        assert best is not None and best < cfg.capacity.high
        assert bound_by(best, probes, cfg.capacity.high) in ("throughput", "queue_growth", "slo_attainment")
        caps[replicas] = best
    assert caps[2] <= 2.1 * caps[1]  # a test tolerance: nothing in the search caps it
    cfg = compose("cluster.replicas=2", f"workload.rate={caps[2]}")
    res, row, lat = _simulate_paused(cfg, None, False)
    assert steady_state(request_table(res.requests, lat)).ok and row["slo_attainment"] >= 0.9


def test_capacity_command_writes_bound_by(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sim.capacity", *SHAREGPT, "workload.limit=100", "capacity.high=32",
                          "capacity.criterion=normalized_latency", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert result["criterion"] == "normalized_latency" and result["bound_by"]
    assert f"bound_by {result['bound_by']}" in out.stdout
    probes = pd.read_csv(tmp_path / "capacity_probes.csv")
    assert {"bound_by", "reason"} <= set(probes.columns)


def test_the_criterion_is_named_with_its_thresholds():
    """The header and capacity.json say what a capacity is relative to: the SLOs and share for
    slo_attainment (spelled out for the JSON), another criterion's own thresholds."""
    from sim.capacity import criterion, criterion_text

    cfg = compose("slo.ttft_s=0.5")
    assert criterion_text(cfg, criterion(cfg)) == \
        "criterion slo_attainment (the SLO below for 90% of requests), steady state required"
    assert criterion_text(cfg, criterion(cfg), spelled=True) == \
        "criterion slo_attainment (SLO TTFT <= 0.5 s, TPOT <= 0.1 s for 90% of requests), steady state required"
    cfg = compose("capacity.criterion=normalized_latency", "+capacity.criterion_options.max_s_per_token=0.3")
    assert criterion_text(cfg, criterion(cfg)) == \
        "criterion normalized_latency (max_s_per_token=0.3), steady state required"
