"""StepLog.columns() is computed once per log and shared: read-only arrays, recomputed after an
append, and a concatenation's columns are its parts' end to end (what the metrics read)."""

import numpy as np
import pytest

from varlen.steplog import DecodeRun, StepLog, StepRecord, step_columns


def _log(t0: float, n_runs: int = 2) -> StepLog:
    log = StepLog()
    log.append(StepRecord(0, t0, 0.5, ["a", "b"], [7, 3], [0, 0], 0, 32, 10, 1, 2, 2))
    step = 1
    for k in range(n_runs):
        start = t0 + 1.0 + 2 * k
        log.append(DecodeRun(step, start, [start + 0.1, start + 0.25, start + 0.3], ["a", "b"], [7 + k, 3 + k],
                             [32, 32, 48], 10 + k, 15 + k, 0, 2))
        step += 3
    return log


def _by_records(log: StepLog) -> dict:
    return step_columns(list(log))  # read off the expanded records, one by one


def test_columns_cached_read_only_and_refreshed_by_append():
    log = _log(0.0)
    a = log.columns()
    for k, v in _by_records(log).items():
        np.testing.assert_array_equal(a[k], v)
    assert log.columns()["start"] is a["start"]  # computed once
    with pytest.raises(ValueError):
        a["duration"][0] = 1.0  # shared by every caller: nobody may change it
    log.append(StepRecord(7, 10.0, 0.5, ["c"], [4], [0], 0, 48, 4, 0, 1, 1))
    b = log.columns()
    assert len(b["start"]) == len(log) == len(a["start"]) + 1
    for k, v in _by_records(log).items():
        np.testing.assert_array_equal(b[k], v)


@pytest.mark.parametrize("warm", [False, True])
def test_concat_columns_join_the_parts(warm):
    logs = [_log(0.0), _log(100.0, 1), StepLog()]
    if warm:
        for log in logs:
            log.columns()
    both = StepLog.concat(logs)
    c = both.columns()
    for k, v in _by_records(both).items():
        np.testing.assert_array_equal(c[k], v)
    # A part that grows after the concatenation no longer speaks for it.
    logs[0].append(StepRecord(9, 50.0, 0.5, ["c"], [4], [0], 0, 48, 4, 0, 1, 1))
    fresh = StepLog.concat(logs[1:])
    for k, v in _by_records(fresh).items():
        np.testing.assert_array_equal(fresh.columns()[k], v)
    again = both.columns()
    for k, v in _by_records(both).items():
        np.testing.assert_array_equal(again[k], v)


def test_columns_without_token_sums():
    log = _log(0.0)
    lean = log.columns(tokens=False)
    assert set(lean) == set(_by_records(log)) - {"num_new_tokens", "num_cached_tokens"}
    full = log.columns()  # asks for more than was computed: computed again, in full
    assert set(full) == set(_by_records(log))
    for k, v in _by_records(log).items():
        np.testing.assert_array_equal(full[k], v)
        if k in lean:
            np.testing.assert_array_equal(lean[k], v)
    assert set(log.columns(tokens=False)) == set(lean)
    both = StepLog.concat([StepLog([*log.entries]), _log(50.0)])
    assert set(both.columns(tokens=False)) == set(lean)


def test_packed_columns_are_numpys_own_conversion():
    """The folds pack their lists with struct: the same int64 and float64 arrays np.array makes (nan,
    negatives, int64's ends, nothing), writable like them."""
    from varlen.steplog import _floats, _ints

    for ints in ([], [0], [3, -7, 2**63 - 1, -(2**63)], list(range(5000))):
        got, want = _ints(ints), np.array(ints, np.int64)
        assert got.dtype == want.dtype and np.array_equal(got, want) and got.flags.writeable
    for floats in ([], [0.5], [float("nan"), -1e300, 3.0, float("inf")]):
        got, want = _floats(floats), np.array(floats, np.float64)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True) and got.flags.writeable


def test_a_log_reading_no_batches_holds_columns_the_same_as_entries():
    """StepLog(keep=False) with no sink holds each entry's figures as columns (append, append_step,
    append_run alike): its columns are those of the same entries kept, across folds too."""
    kept = _log(0.0, 3)
    entries = list(kept.entries)
    by_entries = StepLog(entries, keep=False)
    direct = StepLog(keep=False)
    for e in entries:
        if isinstance(e, DecodeRun):
            direct.append_run(e.start, e.ends, len(e.req_ids), e.kv_reserved_slots, e.kv_live_before,
                              e.last_kv_live_tokens, e.num_waiting)
        else:
            direct.append_step(e.start, e.duration, len(e.req_ids), e.kv_reserved_slots, e.kv_live_tokens,
                               e.num_waiting)
    want = kept.columns(tokens=False)
    for log in (by_entries, direct):
        assert not log.entries and len(log) == len(kept)
        got = log.columns(tokens=False)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    direct.flush()  # folded: the held columns become a chunk, then more entries after it
    direct.append_step(20.0, 0.5, 1, 16, 4, 0)
    kept.append(StepRecord(len(kept), 20.0, 0.5, ["c"], [4], [0], 0, 16, 4, 0, 1, 1))
    for k, v in kept.columns(tokens=False).items():
        np.testing.assert_array_equal(direct.columns(tokens=False)[k], v)
    with pytest.raises(RuntimeError, match="append a StepRecord"):
        StepLog().append_step(0.0, 0.5, 1, 16, 4, 0)  # a kept log reads batches: a record it is
    with pytest.raises(RuntimeError, match="append a DecodeRun"):
        StepLog(keep=False, sink=lambda entries: None).append_run(0.0, [0.5], 1, [16], 4, 5, 0)
