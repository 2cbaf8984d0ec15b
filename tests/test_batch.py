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
])
def test_bad_request_is_named(seq, pool, msg):
    good = SeqSlice([1, 2], 0, [1], req_id="ok")
    with pytest.raises(ValueError, match=msg):
        build_batch([good, seq], block_size=4, num_blocks=pool)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        build_batch([SeqSlice([1], 0, [0])], block_size=0)
