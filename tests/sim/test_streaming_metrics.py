"""Memory bounded by what is in flight (issue 26): without token-level output (output.token_times,
the default false) a simulation releases each request as it ends, keeps its figures as columns and
its gaps as an exact value -> count table, and keeps only per-step columns of the step log; every
summary figure and requests.csv column equals the token-level run's, bit for bit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.release import RELEASED, Release
from sim.run import CONF, _simulate_paused, write_outputs
from varlen.metrics import GapCounts, RequestResults, request_columns, step_table
from varlen.request import FinishReason, Request
from varlen.steplog import DecodeRun, StepLog, StepRecord

WALL = ("sim_wall_s", "sim_requests_per_wall_s")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1e-3, 0.0125, 0.0125 + 1e-17, 0.3, 7.0, 1 / 3]), max_size=40),
                min_size=1, max_size=6),
       st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_gap_table_percentiles_are_numpy_percentiles_bit_for_bit(parts, qs):
    g = GapCounts()
    g.FOLD = 7  # fold often: merges of tables are exercised
    for p in parts:
        g.add(np.array(p))
    everything = np.concatenate([np.array(p, np.float64) for p in parts])
    want = [float(v) for v in np.percentile(everything, qs)] if len(everything) else [float("nan")] * len(qs)
    got = g.percentiles(qs)
    assert len(g) == len(everything)
    assert np.array_equal(got, want, equal_nan=True)


def test_gap_table_folds_geometrically_not_every_fold_rows():
    """A long run's distinct gaps grow with its steps: the buffer is folded into the table once it is
    as large as the table, so the table is re-sorted O(log) times, not once every FOLD rows."""
    g = GapCounts()
    g.FOLD = 8
    folds = []
    fold = g._fold
    g._fold = lambda: (folds.append(len(g._values)), fold())[1]  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    parts = [rng.random(8) for _ in range(2000)]  # 16,000 distinct gaps, 8 at a time
    for p in parts:
        g.add(p)
    assert len(folds) <= 16  # a fixed threshold of 8 rows folds 2,000 times
    assert g.percentiles([0, 37.5, 50, 99, 100]) == [float(x) for x in np.percentile(np.concatenate(parts),
                                                                                      [0, 37.5, 50, 99, 100])]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=12), min_size=1, max_size=8),
       st.sampled_from([[0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 3.0, 3.1, 7.0, 1 / 3, 0.1, 0.3],
                        [0.0, 0.1, 0.2, 0.30000000000000004, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, float("nan")]]),
       st.booleans(), st.integers(1, 8), st.integers(1, 30))
def test_gap_table_from_timelines_counts_every_gap_as_the_plain_gaps_do(picks, grid, ascending, fold, chunk):
    """add_timelines (gaps between neighbouring shared times counted, the rest sorted; in chunks of
    whole timelines) gives the table of the plain gaps, whatever the timelines: steps skipped, times
    repeated or out of order."""
    lines = [[grid[k] for k in (sorted(p) if ascending else p)] for p in picks]
    want = GapCounts()
    for line in lines:
        want.add(np.diff(np.array(line, np.float64)))
    everything = np.concatenate([np.diff(np.array(line, np.float64)) for line in lines])
    for walk in (True, False):  # shared times walked (until a chunk mostly leaves the walk), or gaps sorted
        g = GapCounts()
        g.FOLD, g.CHUNK, g.walk = fold, chunk, walk
        g.add_timelines(np.array([t for line in lines for t in line], np.float64), np.array([len(x) for x in lines]))
        assert len(g) == len(want) == sum(max(len(x) - 1, 0) for x in lines)
        (v, c), (wv, wc) = g.table(), want.table()
        assert np.array_equal(v, wv, equal_nan=True) and np.array_equal(c, wc)
        qs = [0, 50, 90, 99, 100]
        assert np.array_equal(g.percentiles(qs), want.percentiles(qs), equal_nan=True)
        plain = [float(x) for x in np.percentile(everything, qs)] if len(everything) else [float("nan")] * len(qs)
        assert np.array_equal(g.percentiles(qs), plain, equal_nan=True)  # the plain computation, not the table only


def test_gap_table_walks_shared_times_until_the_timelines_interleave():
    one = GapCounts()  # one replica: every request's times are neighbouring step times
    one.add_timelines(np.array([0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0]), np.array([3, 4]))
    assert one.walk and one.table()[0].tolist() == [1.0] and one.table()[1].tolist() == [5]
    two = GapCounts()  # two replicas' steps interleaved: each timeline skips the other's times
    two.add_timelines(np.array([0.0, 1.0, 2.0, 0.5, 1.5, 2.5]), np.array([3, 3]))
    assert not two.walk and two.table()[1].tolist() == [4]


def _run(overrides: list[str], token_times: bool, tmp_path=None):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides + [f"output.token_times={str(token_times).lower()}",
                                                    "progress.enabled=false"])
    out = None if tmp_path is None else tmp_path / ("tokens" if token_times else "columns")
    if out is not None:
        out.mkdir()
    res, row, results = _simulate_paused(cfg, {"scheduler": "chunked", "allocator": "paged"}, False,
                                         steps_to=out if cfg.output.steps else None)
    if out is not None:
        write_outputs(res, row, out, cfg, results)
    return res, {k: v for k, v in row.items() if k not in WALL}, results


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), replicas=st.integers(1, 3), rate=st.sampled_from([5.0, 40.0, 200.0]),
       blocks=st.sampled_from([None, 300]), limit=st.integers(5, 60))
def test_streaming_summary_and_requests_equal_the_stored_token_computation(seed, replicas, rate, blocks, limit):
    over = ["workload=synthetic", f"workload.seed={seed}", f"workload.limit={limit}", f"workload.rate={rate}",
            "workload.output_len=uniform:1:200", "workload.prompt_len=uniform:16:900", f"cluster.replicas={replicas}",
            "cluster.router=least_outstanding", "slo.tbt_s=0.05", *([f"engine.num_blocks={blocks}"] if blocks else [])]
    tok_res, tok_row, _ = _run(over, True)
    col_res, col_row, col_results = _run(over, False)
    assert isinstance(col_res.requests, RequestResults) and not isinstance(tok_res.requests, RequestResults)
    assert _same(col_row, tok_row)
    want, got = request_columns(tok_res.requests), request_columns(col_res.requests, col_results)
    assert list(want) == list(got)
    for k in want:
        assert np.array_equal(np.asarray(want[k]), np.asarray(got[k]),
                              equal_nan=np.asarray(want[k]).dtype.kind == "f"), k


def _same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert x == y or (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y)), (k, x, y)
    return True


def test_run_outputs_equal_token_level_outputs(tmp_path):
    over = ["workload=synthetic", "workload.limit=150", "workload.rate=30", "cluster.replicas=2",
            "cluster.router=least_outstanding", "engine.num_blocks=400", "output.steps=true", "output.step_detail=true"]
    tok_res, tok_row, _ = _run(over, True, tmp_path)
    col_res, col_row, _ = _run(over, False, tmp_path)
    assert not any(rep.engine.steps.keep for rep in col_res.replicas)
    assert col_row["preemptions"] > 0 and _same(col_row, tok_row)
    for name in ("requests.csv", "steps.csv", "kv_usage.csv"):
        assert (tmp_path / "columns" / name).read_bytes() == (tmp_path / "tokens" / name).read_bytes(), name
    assert not list((tmp_path / "columns").glob("*.part"))  # the streamed parts joined and removed
    frames = []  # steps.csv as pandas writes step_table's rows (every replica ran steps)
    for rep in tok_res.replicas:
        t = step_table(rep.engine.steps, detail=True)
        t.insert(0, "replica", rep.index)
        frames.append(t)
    pd.concat(frames).to_csv(tmp_path / "want_steps.csv", index=False)
    assert (tmp_path / "columns" / "steps.csv").read_bytes() == (tmp_path / "want_steps.csv").read_bytes()


def test_release_folds_ended_requests_and_drops_them():
    reqs = [Request(f"r{i}", [0] * 4, arrival=float(i)) for i in range(600)]
    ended = set(range(0, 600, 3))
    for i in ended:
        reqs[i].token_times += [i + 1.0, i + 1.5, i + 3.0]
        reqs[i].output_token_ids += [1, 1, 1]
        reqs[i].finish(FinishReason.LENGTH, i + 3.0)
    rel = Release(reqs, reqs, None)
    rel.fold(500)
    assert [i for i, r in enumerate(reqs) if r is RELEASED] == [i for i in sorted(ended) if i < 500]
    assert sorted(rel.held) == [i for i in range(500) if i not in ended]
    res = rel.results
    assert res.req_id[3] == "r3" and res.first_token[3] == 4.0 and res.max_tbt[3] == 1.5 and res.tpot[3] == 1.0
    assert res.req_id[1] == ""  # not ended: not folded yet
    rel.fold(520)  # few new arrivals: not worth a pass yet
    assert reqs[501] is not RELEASED
    res = rel.close()  # the run is over: everything folded, ended or not
    assert all(r is RELEASED for r in reqs) and res.req_id == [f"r{i}" for i in range(600)]
    assert res.finish_reasons()[1] is None and res.finish_reasons()[0] == "length"
    assert len(res.itl) == 2 * len(ended)


def _entries(n: int):
    for k in range(n):
        if k % 3:
            yield DecodeRun(4 * k, 10.0 * k, [10.0 * k + 0.1 * (j + 1) for j in range(3)], [f"a{k}", f"b{k}"],
                            [5, 9], [32, 32, 48], 14, 20, k % 5, 2)
        else:
            yield StepRecord(4 * k, 10.0 * k, 0.5, [f"a{k}"] * 30, [7] * 30, [0] * 30, 1, 32, 10, 1, 2, 2)


def test_column_only_step_log_folds_as_it_goes_into_the_same_columns():
    kept, seen = StepLog(_entries(900)), []
    log = StepLog(keep=False, sink=seen.extend)
    for e in _entries(900):
        log.append(e)
    assert len(log.entries) < 300 and len(log) == len(kept)  # folded as it went
    cols, want = log.columns(tokens=False), kept.columns(tokens=False)
    assert cols.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(cols[k], want[k])
    assert cols["num_seqs"].dtype == np.int32 and cols["start"].dtype == np.float64  # counts kept compact
    assert len(log._chunks) == 1  # the folds joined in place by columns(): the log holds one copy
    log.flush()
    assert seen == kept.entries and log.entries == []  # the sink saw every entry, in order
    for k, v in log.columns(tokens=False).items():
        np.testing.assert_array_equal(v, want[k])
    with pytest.raises(RuntimeError, match="output.token_times=true"):
        list(log)
    with pytest.raises(RuntimeError, match="token sums"):  # not kept: columns only the metrics read
        log.columns()
    both = StepLog.concat([log, StepLog(keep=False)])
    np.testing.assert_array_equal(both.columns(tokens=False)["start"], want["start"])


def test_column_only_step_log_keeps_counts_that_do_not_fit_int32_as_int64():
    big = StepRecord(0, 0.0, 0.5, ["a"], [1], [0], 0, 2**40, 10, 1, 1, 1)
    log = StepLog([big, StepRecord(1, 0.5, 0.5, ["a"], [1], [1], 0, 7, 11, 0, 1, 1)], keep=False)
    log.flush()
    c = log.columns(tokens=False)
    assert c["kv_reserved_slots"].dtype == np.int64 and c["kv_reserved_slots"].tolist() == [2**40, 7]
    assert c["num_seqs"].dtype == np.int32


@pytest.mark.parametrize("key", ["token_times", "timeline"])
def test_a_bad_token_level_switch_is_one_line(key):
    from varlen.cli import SettingError

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["workload.limit=5", f"output.{key}=3"])
    with pytest.raises(SettingError, match=f"output.{key}=3: give true or false"):
        _simulate_paused(cfg, None, False)


def _ended(n: int, tokens: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", [0] * 4, arrival=float(i))
        k = int(rng.integers(0, tokens + 1))
        r.token_times += np.cumsum(rng.choice([0.25, 0.5, 2.0], k)).tolist()
        r.output_token_ids += [1] * k
        r.finish(FinishReason.LENGTH if i % 7 else FinishReason.ABORTED, r.token_times[-1] if k else 0.0)
        reqs.append(r)
    return reqs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.floats(allow_nan=False), st.integers(-2**53, 2**53)), max_size=30), max_size=8))
def test_timelines_flatten_to_the_times_end_to_end(timelines):
    import itertools

    from varlen.metrics import _flatten

    want = np.fromiter(itertools.chain.from_iterable(timelines), np.float64)
    got = _flatten(timelines)
    assert got.dtype == np.float64 and got.tobytes() == want.tobytes()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.floats(-1e6, 1e6) | st.sampled_from([0.0, 0.25, 1 / 3]), max_size=12), max_size=10))
def test_timeline_figures_are_each_timelines_own(timelines):
    """First token, TPOT and longest gap of timelines end to end (empty, one time, out of order) are
    each one's own, computed alone; with gaps=True the gaps within timelines, end to end."""
    from varlen.metrics import _timeline_figures

    lens = np.array([len(t) for t in timelines], np.int64)
    flat = np.array([x for t in timelines for x in t], np.float64)
    first, tpot, max_tbt, itl = _timeline_figures(flat, lens, gaps=True)
    want = [(t[0] if t else np.nan, (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else np.nan,
             np.diff(np.array(t)).max() if len(t) > 1 else np.nan) for t in timelines]
    for got, k in ((first, 0), (tpot, 1), (max_tbt, 2)):
        assert np.array_equal(got, np.array([w[k] for w in want], np.float64).reshape(-1), equal_nan=True)
    gaps = [np.diff(np.array(t, np.float64)) for t in timelines]
    assert np.array_equal(itl, np.concatenate(gaps) if gaps else np.empty(0))
    assert np.array_equal(_timeline_figures(flat, lens)[2], max_tbt, equal_nan=True)


def test_request_results_fold_in_groups_of_token_times_into_the_same_rows():
    reqs = _ended(60, 40)
    whole, grouped = RequestResults(60), RequestResults(60)
    whole.TOKENS, grouped.TOKENS = 10**9, 7
    whole.add(range(60), reqs)
    grouped.add(range(60), reqs)
    for k in RequestResults._ARRAYS:
        assert np.array_equal(getattr(whole, k), getattr(grouped, k), equal_nan=getattr(whole, k).dtype.kind == "f"), k
    assert whole.req_id == grouped.req_id
    (v, c), (wv, wc) = grouped.itl.table(), whole.itl.table()
    assert np.array_equal(v, wv) and np.array_equal(c, wc) and len(grouped.itl) == len(whole.itl)


def test_requests_fold_in_one_pass_into_the_columns_their_fields_give_read_one_by_one():
    """RequestResults.add reads Requests in one compiled pass (results_columns); any other rows (sim.cells'
    records, a subclass) field by field: the same columns either way, streamed figures included."""
    from types import SimpleNamespace

    reqs = _ended(40, 6, seed=3)
    for i, r in enumerate(reqs):
        r.priority, r.num_preemptions, r.num_prefix_hit_tokens = i % 3, i % 2, 4 * (i % 4)
        if i % 5 == 0:
            r.first_scheduled = None  # NaN in the column
        if i % 2:  # streamed: its figures, not its times
            k = len(r.token_times)
            r.num_token_times, r.token_times = k, []
            if k:
                r.first_token_time, r.last_token_time, r.max_token_gap = i + 0.5, i + 0.5 + k, 1.25
    fields = ("req_id", "finish_reason", "finish_message", "arrival", "first_scheduled", "finish_time",
              "num_prompt_tokens", "num_output_tokens", "num_preemptions", "num_prefix_hit_tokens", "priority",
              "token_times", "num_token_times", "first_token_time", "last_token_time", "max_token_gap")
    rows = [SimpleNamespace(**{f: getattr(r, f) for f in fields}) for r in reqs]
    fast, slow = RequestResults(40), RequestResults(40)
    fast.add(range(39, -1, -1), reqs)
    slow.add(range(39, -1, -1), rows)
    for k in RequestResults._ARRAYS:
        assert np.array_equal(getattr(fast, k), getattr(slow, k), equal_nan=getattr(fast, k).dtype.kind == "f"), k
    assert fast.req_id == slow.req_id and fast.finish_message == slow.finish_message
    assert np.isnan(fast.first_scheduled[39]) and fast.priority[39 - 2] == 2 and fast.prefix_hit_tokens[39 - 3] == 12
    streamed = [i for i, r in enumerate(reqs) if r.num_token_times > 1]
    assert streamed and all(fast.max_tbt[39 - i] == 1.25 for i in streamed)
    (v, c), (sv, sc) = fast.itl.table(), slow.itl.table()
    assert np.array_equal(v, sv) and np.array_equal(c, sc)


def test_folding_many_ended_requests_at_once_needs_memory_for_a_group_only():
    import tracemalloc

    reqs = _ended(3000, 1200)  # ~1.8M token times: ~14 MB an array of them all
    res = RequestResults(3000)
    tracemalloc.start()
    try:
        res.add(range(3000), reqs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 25e6 and res.filled.all()  # all at once: ~40 MB


def test_gap_counts_from_lists_equal_those_from_arrays():
    """add_counts packs lists whole (an engine's streamed batches); arrays are read as they are."""
    rng = np.random.default_rng(4)
    values = (rng.integers(0, 50, 300) * 1e-3 + 0.1 / 3).tolist()
    counts = rng.integers(1, 9, 300).tolist()
    a, b = GapCounts(), GapCounts()
    a.add_counts(values, counts)
    b.add_counts(np.asarray(values), np.asarray(counts))
    (va, ca), (vb, cb) = a.table(), b.table()
    assert va.tobytes() == vb.tobytes() and ca.tolist() == cb.tolist() and len(a) == sum(counts)
