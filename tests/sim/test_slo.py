"""Stall-aware SLOs: `slo.tbt_s`, a request meets it when no gap between two consecutive output
tokens exceeds it; in the summary (tbt_p99, tbt_attainment), goodput, the settings' checks, the
capacity search and the report's plots."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from varlen.cli import SettingError, check_slo
from varlen.metrics import request_latencies, request_table, summarize
from varlen.request import FinishReason, Request, Status


def finished(rid: str, times: list[float], arrival: float = 0.0) -> Request:
    r = Request(rid, [1, 2, 3], arrival=arrival)
    r.token_times = list(times)
    r.output_token_ids = [5] * len(times)
    r.status = Status.FINISHED
    r.finish_reason = FinishReason.LENGTH
    r.finish_time = times[-1] if times else arrival
    return r


@given(st.lists(st.lists(st.floats(0, 5), max_size=6), max_size=8))
def test_longest_gap_per_request_matches_a_plain_loop(gap_lists):
    reqs, t = [], 0.0
    for i, gaps in enumerate(gap_lists):
        times = list(np.cumsum([t, *gaps])) if gaps or i % 2 else []  # some requests with no token
        t = (times[-1] if times else t) + 0.5
        reqs.append(finished(f"r{i}", times))
    got = request_latencies(reqs)["max_tbt"]
    for r, g in zip(reqs, got):
        want = max(np.diff(r.token_times)) if len(r.token_times) > 1 else np.nan
        assert (np.isnan(g) and np.isnan(want)) or g == pytest.approx(want, abs=1e-12)


def test_tbt_slo_fails_a_stall_the_mean_hides_and_goodput_needs_every_slo():
    smooth = finished("smooth", [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    stalled = finished("stalled", [1.0, 1.02, 1.04, 1.44, 1.46, 1.48])  # mean gap 0.096, one of 0.4
    late = finished("late", [5.0, 5.1], arrival=0.0)  # TTFT 5 s, no stall
    one = finished("one", [2.0])  # a single token: no gap to exceed
    reqs = [smooth, stalled, late, one]
    row = summarize(reqs, [], 1, tpot_slo=0.1)
    assert row["slo_attainment"] == 1.0 and "tbt_attainment" not in row  # the mean hides the stall
    row = summarize(reqs, [], 1, tbt_slo=0.2)
    assert row["tbt_attainment"] == 0.75 and row["slo_attainment"] == 0.75
    row = summarize(reqs, [], 1, ttft_slo=2.0, tpot_slo=0.1, tbt_slo=0.2)
    assert row["slo_attainment"] == 0.5  # smooth and one: late misses TTFT, stalled misses TBT
    assert row["goodput_requests_per_s"] == pytest.approx(2 / row["duration_s"])
    gaps = np.concatenate([np.diff(r.token_times) for r in reqs if len(r.token_times) > 1])
    assert row["tbt_p99"] == pytest.approx(np.percentile(gaps, 99))
    table = request_table(reqs).set_index("req_id")
    assert table.loc["stalled", "max_tbt"] == pytest.approx(0.4) and np.isnan(table.loc["one", "max_tbt"])


@pytest.mark.parametrize("value", [0, -1, "fast", float("inf"), True])
def test_tbt_slo_is_checked_like_the_others(value):
    cfg = OmegaConf.create({"slo": {"ttft_s": None, "tpot_s": None, "tbt_s": value}})
    with pytest.raises(SettingError, match=r"slo\.tbt_s=.*seconds"):
        check_slo(cfg)
    check_slo(OmegaConf.create({"slo": {"ttft_s": None, "tpot_s": None, "tbt_s": 0.2}}))


def test_both_commands_default_to_no_tbt_slo():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "conf"
    for f in ("run/config.yaml", "sim/sim.yaml"):
        slo = OmegaConf.load(root / f).slo
        assert "tbt_s" in slo and slo.tbt_s is None, f


def small_sim(*overrides: str):
    from hydra import compose, initialize_config_dir

    from sim.run import CONF

    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("sim", overrides=["workload=synthetic", "workload.limit=40", "sim_model=tiny",
                                         "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=2048",
                                         *overrides])


def test_sim_summary_and_capacity_search_use_the_tbt_slo():
    from sim.capacity import capacity_search, check_capacity_settings
    from sim.run import simulate_config

    cfg = small_sim("slo.ttft_s=null", "slo.tpot_s=null", "slo.tbt_s=1000", "workload.rate=2")
    _, row = simulate_config(cfg)
    assert row["tbt_attainment"] == 1.0 and row["slo_attainment"] == 1.0 and row["tbt_p99"] > 0
    cfg = small_sim("slo.ttft_s=null", "slo.tpot_s=null", f"slo.tbt_s={row['tbt_p99'] / 1e3}", "workload.rate=2")
    _, row = simulate_config(cfg)
    assert row["tbt_attainment"] == 0.0
    # A TBT-only SLO is enough for a capacity search; an impossible one is met at no rate.
    check_capacity_settings(cfg)
    probes: list = []
    best, _ = capacity_search(cfg, {"scheduler": "chunked", "allocator": "paged"}, probes)
    assert best is None and "tbt_p99" in probes[0]
    with pytest.raises(SettingError, match="slo.tbt_s"):
        check_capacity_settings(small_sim("slo.ttft_s=null", "slo.tpot_s=null"))


def test_report_draws_the_tbt_cdf_and_reads_runs_without_it(tmp_path):
    from sim.report import report

    for i, with_column in enumerate((True, False)):
        d = tmp_path / f"run{i}"
        d.mkdir()
        json.dump({"scheduler": "sarathi", "allocator": "paged", "rate": 2.0, "requests_per_s": 1.9,
                   "ttft_p90": 0.1, "e2e_p50": 1.0, "tbt_p99": 0.05}, (d / "summary.json").open("w"))
        cols = {"ttft": [0.1, 0.2], "tpot": [0.01, 0.02]}
        if with_column:
            cols["max_tbt"] = [0.05, 0.3]
        pd.DataFrame(cols).to_csv(d / "requests.csv", index=False)
        pd.DataFrame({"replica": [0, 0], "time": [0.0, 1.0], "kv_usage": [0.1, 0.2]}).to_csv(d / "kv_usage.csv")
    df = report([tmp_path])
    assert (tmp_path / "tbt_cdf.png").stat().st_size > 0 and "tbt_p99" in df


def test_summary_reports_scheduling_delay_longest_gap_percentiles_and_normalized_latency():
    reqs = [finished("a", [1.0, 1.1, 1.5], arrival=0.0), finished("b", [3.0, 3.1, 3.2, 3.3], arrival=2.0),
            finished("c", [4.0], arrival=3.5)]
    for r, s in zip(reqs, (0.5, 2.75, 3.9)):
        r.first_scheduled = s
    row = summarize(reqs, [], 1)
    delays = [0.5, 0.75, 0.4]
    assert row["scheduling_delay_p50"] == pytest.approx(np.percentile(delays, 50))
    assert row["scheduling_delay_p99"] == pytest.approx(np.percentile(delays, 99))
    for q in (50, 90, 99):  # over each request's longest gap: a and b (c has none)
        assert row[f"max_tbt_p{q}"] == pytest.approx(np.percentile([0.4, 0.1], q))
    assert row["normalized_latency_mean"] == pytest.approx(np.mean([1.5 / 3, 1.3 / 4, 0.5 / 1]))
    table = request_table(reqs).set_index("req_id")
    assert table["scheduling_delay"].tolist() == pytest.approx(delays)
