import numpy as np
import pytest
from hypothesis import given, strategies as st

from varlen.batch import SeqSlice, build_batch


def test_worked_exercise_mixed_decode_prefill_chunk():
    # cached 30 + decode 1; new prompt of 6; cached 16 + 4 of a 40-token prompt (not finished: no logits)
    b = build_batch([
        SeqSlice([7], 30, list(range(8))),
        SeqSlice(list(range(100, 106)), 0, [8, 9]),
        SeqSlice(list(range(200, 204)), 16, list(range(10, 20)), needs_logits=False),
    ], block_size=4)
    assert b.query_start_loc.tolist() == [0, 1, 7, 11]
    assert b.seq_lens.tolist() == [31, 6, 20]
    assert b.positions.tolist() == [30, *range(6), *range(16, 20)]
    assert b.logits_indices.tolist() == [0, 6]
    assert b.input_ids.tolist() == [7, *range(100, 106), *range(200, 204)]
    assert (b.max_query_len, b.max_seq_len) == (6, 31)
    # slot = block_tables[pos // 4] * 4 + pos % 4
    assert b.slot_mapping.tolist() == [7 * 4 + 2, 32, 33, 34, 35, 36, 37, 14 * 4, 57, 58, 59]
    assert b.block_tables.dtype == np.int32 and b.block_tables.shape == (3, 8)
    assert b.block_tables[1].tolist() == [8, 9, 0, 0, 0, 0, 0, 0]


@given(st.data())
def test_metadata_matches_per_token_definition(data):
    bs = data.draw(st.integers(1, 9), label="block_size")
    n = data.draw(st.integers(1, 8), label="num_requests")
    seqs, ids = [], iter(np.random.default_rng(data.draw(st.integers(0, 99))).permutation(10_000).tolist())
    for i in range(n):
        k = data.draw(st.integers(0, 50))
        q = data.draw(st.integers(1, 20))
        table = [next(ids) for _ in range(-(-(k + q) // bs) + data.draw(st.integers(0, 2)))]
        seqs.append(SeqSlice(list(range(q)), k, table, data.draw(st.booleans()), req_id=i))
    b = build_batch(seqs, bs)
    # The per-token definition, spelled out with plain loops.
    pos, slots, logits, t = [], [], [], 0
    for s in seqs:
        for j in range(len(s.token_ids)):
            p = s.num_cached + j
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        t += len(s.token_ids)
        if s.needs_logits:
            logits.append(t - 1)
    assert b.positions.tolist() == pos
    assert b.slot_mapping.tolist() == slots
    assert b.logits_indices.tolist() == logits
    for i, s in enumerate(seqs):
        need = -(-(s.num_cached + len(s.token_ids)) // bs)
        assert b.block_tables[i, :need].tolist() == list(s.block_table[:need])


@pytest.mark.parametrize("seq, pool, msg", [
    (SeqSlice([], 3, [0], req_id="a"), None, "request 'a' has no new tokens"),
    (SeqSlice([1], -1, [0], req_id="b"), None, "request 'b' has a negative number of cached tokens"),
    (SeqSlice([1, 2, 3], 4, [0], req_id="c"), None, "request 'c' has a block table of 1 blocks but 7 tokens need 2"),
    (SeqSlice([1], 0, [5], req_id="d"), 4, r"request 'd' has block ids outside the pool \[0, 4\)"),
    (SeqSlice([1], 0, [-1], req_id="e"), None, "request 'e' has block ids outside the pool"),
    # A table too short, next to ids outside the pool: said as such (was a numpy broadcast error).
    (SeqSlice([1] * 9, 0, [1, 9], req_id="f"), 4, "request 'f' has a block table of 2 blocks but 9 tokens need 3"),
])
def test_bad_request_is_named(seq, pool, msg):
    good = SeqSlice([1, 2], 0, [1], req_id="ok")
    with pytest.raises(ValueError, match=msg):
        build_batch([good, seq], block_size=4, num_blocks=pool)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        build_batch([SeqSlice([1], 0, [0])], block_size=0)


def _buffers_and_slices(data, decode_only: bool):
    """A BatchBuffers holding random requests in random rows, some of them scheduled, and the
    same step as SeqSlices (what build_batch takes)."""
    from varlen.batch import BatchBuffers

    bs = data.draw(st.integers(1, 9), label="block_size")
    rows_total, max_len = 8, 64
    buf = BatchBuffers(rows_total, max_len, -(-max_len // bs))
    rng = np.random.default_rng(data.draw(st.integers(0, 99), label="seed"))
    buf.tokens[:] = rng.integers(0, 1000, buf.tokens.shape)
    low, high = data.draw(st.sampled_from([(0, 50), (-3, 200)]), label="stale ids")  # some out of any pool
    buf.block_tables[:] = rng.integers(low, high, buf.block_tables.shape)  # stale entries past each table
    n = data.draw(st.integers(1, rows_total), label="num_requests")
    rows = rng.permutation(rows_total)[:n]
    seqs, cached, new, wants = [], [], [], []
    for i, row in enumerate(rows.tolist()):
        q = 1 if decode_only else data.draw(st.integers(1, 12))
        k = data.draw(st.integers(0, max_len - q))
        held = -(-(k + q) // bs) - data.draw(st.sampled_from([0, 0, 0, 0, 1]))  # sometimes a block short
        held = max(held, 0)
        buf.block_tables[row, :held] = rng.integers(0, 100, held)
        buf.num_blocks[row] = held
        w = data.draw(st.booleans())
        seqs.append(SeqSlice(buf.tokens[row, k:k + q].tolist(), k, buf.block_tables[row, :held].tolist(), w,
                             req_id=f"r{i}"))
        cached.append(k), new.append(q), wants.append(w)
    arrays = (rows.astype(np.int64), np.array(cached, np.int64), np.array(new, np.int64), np.array(wants, bool))
    return buf, bs, arrays, seqs


@pytest.mark.parametrize("decode_only", [True, False])
@given(data=st.data())
def test_batch_buffers_build_equals_build_batch(decode_only, data):
    """BatchBuffers.build (its pure-decode fast path included) gives build_batch's ForwardBatch
    for the same step, or the same error naming the same request."""
    buf, bs, (rows, cached, new, wants), seqs = _buffers_and_slices(data, decode_only)
    pool = data.draw(st.sampled_from([None, 100, 50]), label="num_blocks")
    ids = [s.req_id for s in seqs]
    try:
        want = build_batch(seqs, bs, pool)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            buf.build(rows, cached, new, wants, bs, pool, req_ids=ids)
        assert str(got.value) == str(e)
        return
    got = buf.build(rows, cached, new, wants, bs, pool, req_ids=ids)
    _same_batch(got, want, seqs, bs)
    if decode_only:
        fast = buf._decode(rows, cached, wants, bs, pool)  # taken unless a stale id looks out of the pool
        assert fast is not None or buf.block_tables[rows].min() < 0 or pool is not None
        if fast is not None:
            _same_batch(fast, want, seqs, bs)


def test_decode_fast_path_is_taken_on_a_clean_step():
    from varlen.batch import BatchBuffers

    buf = BatchBuffers(4, 64, 16)
    buf.block_tables[:] = np.arange(64).reshape(4, 16)
    buf.num_blocks[:] = [3, 1, 16, 2]
    buf.tokens[:] = np.arange(256).reshape(4, 64)
    rows, k = np.array([2, 0, 3]), np.array([63, 10, 4])
    fast = buf._decode(rows, k, np.array([True, False, True]), 4, 64)
    assert fast is not None and fast.input_ids.tolist() == [191, 10, 196]
    assert fast.slot_mapping.tolist() == [47 * 4 + 3, 2 * 4 + 2, 49 * 4 + 0] and fast.logits_indices.tolist() == [0, 2]


def _same_batch(got, want, seqs, bs):
    for f in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping", "logits_indices"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), f
    assert (got.max_query_len, got.max_seq_len, got.block_size) == (want.max_query_len, want.max_seq_len, bs)
    assert got.block_tables.shape == want.block_tables.shape and got.block_tables.dtype == want.block_tables.dtype
    for i, s in enumerate(seqs):  # entries past a request's last needed block are unspecified
        need = -(-(s.num_cached + len(s.token_ids)) // bs)
        assert got.block_tables[i, :need].tolist() == want.block_tables[i, :need].tolist()
