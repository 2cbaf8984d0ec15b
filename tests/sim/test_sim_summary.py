"""A simulation's summary and tables, computed the fast way (one flattening of every token time
shared by the summary and requests.csv, step columns, tables written without pandas), equal what
the obvious per-request and per-step loops and pandas' own tables give."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from sim.run import CONF, _simulate_paused, write_outputs
from varlen.metrics import kv_usage_table, request_latencies, request_table, summarize
from varlen.request import FinishReason


@pytest.fixture(scope="module")
def run():
    # Two replicas and a small pool: preemptions, decode runs and several step logs; token-level output
    # (the Request objects kept) to check the figures against loops over their token times.
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["workload.limit=400", "workload.rate=40", "cluster.replicas=2",
                                        "engine.num_blocks=600", "slo.tbt_s=0.05", "output.token_times=true"])
    res, row, lat = _simulate_paused(cfg, {"scheduler": "chunked", "allocator": "paged"}, False)
    return cfg, res, row, lat

def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")

def test_summary_equals_the_obvious_loops(run):
    cfg, res, row, _ = run
    reqs = res.requests
    assert row["preemptions"] > 0 and row["finished"] == len(reqs) == 400
    ttft = [r.token_times[0] - r.arrival for r in reqs]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in reqs if len(r.token_times) > 1]
    gaps = [g for r in reqs for g in np.diff(r.token_times).tolist()]
    e2e = [r.finish_time - r.arrival for r in reqs]
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", gaps), ("e2e", e2e)):
        for q in (50, 90, 99):
            assert row[f"{name}_p{q}"] == _pct(xs, q), (name, q)
    assert row["tbt_p99"] == _pct(gaps, 99)
    ok_tbt = [len(r.token_times) < 2 or max(np.diff(r.token_times)) <= 0.05 for r in reqs]
    assert row["tbt_attainment"] == sum(ok_tbt) / len(reqs)
    ok = [t <= 2.0 and (p is None or p <= 0.1) and b for t, p, b in zip(
        ttft, [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else None
               for r in reqs], ok_tbt)]
    assert row["slo_attainment"] == sum(ok) / len(reqs)
    span = max(r.finish_time for r in reqs) - min(r.arrival for r in reqs)
    assert row["duration_s"] == span and row["requests_per_s"] == len(reqs) / span
    assert row["output_tokens_per_s"] == sum(r.num_output_tokens for r in reqs) / span
    steps = [s for rep in res.replicas for s in rep.engine.steps]  # each StepRecord, one by one
    slots = res.total_slots
    assert row["peak_kv_usage"] == max(s.kv_reserved_slots for s in steps) / slots
    assert row["mean_batch_size"] == pytest.approx(np.mean([len(s.req_ids) for s in steps]), rel=1e-12)
    busy = sum(s.duration for s in steps)
    assert row["mean_kv_usage"] == pytest.approx(sum(s.kv_reserved_slots * s.duration for s in steps) / busy / slots,
                                                 rel=1e-9)
    assert row["steps"] == len(steps)

def test_tables_written_without_pandas_equal_pandas_tables(run, tmp_path):
    cfg, res, row, lat = run
    write_outputs(res, row, tmp_path, cfg, lat)
    want = request_table(res.requests)  # pandas, latencies computed anew
    want["replica"] = want["req_id"].map(res.routed)
    want.to_csv(tmp_path / "want_requests.csv", index=False)
    assert (tmp_path / "requests.csv").read_bytes() == (tmp_path / "want_requests.csv").read_bytes()
    kv = []
    for rep in res.replicas:
        t = kv_usage_table(rep.engine.steps, rep.engine.kv.capacity_tokens, cfg.output.kv_points)
        t.insert(0, "replica", rep.index)
        kv.append(t)
    pd.concat(kv).to_csv(tmp_path / "want_kv.csv", index=False)
    assert (tmp_path / "kv_usage.csv").read_bytes() == (tmp_path / "want_kv.csv").read_bytes()

def test_shared_latencies_give_the_same_summary_when_some_requests_did_not_finish(run):
    _, res, _, _ = run
    reqs = res.requests[:50]
    lat = request_latencies(reqs)
    want = summarize(reqs, res.steps, res.total_slots, 2.0, 0.1, 0.05)
    assert summarize(reqs, res.steps, res.total_slots, 2.0, 0.1, 0.05, latencies=lat) == want
    aborted = reqs[7]
    saved = aborted.finish_reason
    try:
        aborted.finish_reason = FinishReason.ABORTED  # its tokens must leave the percentiles
        want = summarize(reqs, res.steps, res.total_slots, 2.0, 0.1, 0.05)
        got = summarize(reqs, res.steps, res.total_slots, 2.0, 0.1, 0.05, latencies=lat)
    finally:
        aborted.finish_reason = saved
    assert got == want and got["aborted"] == 1 and got["finished"] == 49
    others = [r for r in reqs if r is not aborted]
    assert got["itl_p50"] == _pct([g for r in others for g in np.diff(r.token_times).tolist()], 50)


def test_percentiles_and_median_are_numpys_bit_for_bit():
    from varlen.metrics import median, percentiles

    rng = np.random.default_rng(7)
    for t in range(400):
        n = int(rng.integers(1, 40))
        x = [rng.random(n) * 1e3, rng.integers(0, 5000, n), np.round(rng.random(n), 2), rng.random(n)][t % 4]
        if t % 4 == 3:
            x[rng.integers(0, n)] = np.nan
        for qs in ((50, 90, 99), (50, 99), (0, 100, 12.5, 33.3)):
            got, want = np.array(percentiles(x, qs)), np.percentile(x, qs)
            assert got.tobytes() == want.tobytes(), (x, qs)
        if t % 4 == 1:
            assert np.float64(median(x)).tobytes() == np.float64(np.median(x)).tobytes(), x
