"""The flat varlen batch: every request's new tokens end to end, plus the metadata that says who
is who. Prefill, chunk and decode are all "n new tokens after k cached ones": one `build_batch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(slots=True)
class SeqSlice:
    """One request's share of a step: `token_ids` are new, `num_cached` tokens precede them in the KV cache."""

    token_ids: Sequence[int] | np.ndarray
    num_cached: int
    block_table: Sequence[int] | np.ndarray
    needs_logits: bool = True
    req_id: object = None


@dataclass(slots=True)
class ForwardBatch:
    """Host-side (numpy) description of one forward pass over B requests and N tokens."""

    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    query_start_loc: np.ndarray  # [B+1] int32, a.k.a. cu_seqlens_q
    seq_lens: np.ndarray  # [B] int32: cached + new
    slot_mapping: np.ndarray  # [N] int64: block_id * block_size + offset of each new token
    block_tables: np.ndarray  # [B, W] int32; entries past a request's last needed block are unspecified
    logits_indices: np.ndarray  # [M] int64: token index whose logits are wanted
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def num_cached(self) -> np.ndarray:
        return self.seq_lens - self.query_lens

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def layout(
    input_ids: np.ndarray, num_cached: np.ndarray, num_new: np.ndarray, block_tables: np.ndarray,
    needs_logits: np.ndarray, block_size: int, *, table_lens: np.ndarray | None = None,
    num_blocks: int | None = None, req_ids: Sequence[object] | None = None,
) -> ForwardBatch:
    """The vectorised core: metadata of B requests from per-request arrays (`block_tables` rows may
    be wider than needed; `table_lens` counts their real entries). ValueError names a bad request."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B = int(num_new.shape[0])
    if B == 0:
        raise ValueError("a batch needs at least one request")
    q = num_new.astype(np.int64, copy=False)
    k = num_cached.astype(np.int64, copy=False)
    seq_lens = q + k
    need = -(-seq_lens // block_size)
    lens = table_lens if table_lens is not None else np.full(B, block_tables.shape[1])
    W = int(need.max())
    tables = block_tables[:, :W]
    bad = (q < 1) | (k < 0) | (lens < need)
    # One cheap pass; the per-request mask only when something is off (stale entries may follow).
    if tables.size and (tables.min() < 0 or (num_blocks is not None and tables.max() >= num_blocks)):
        used = np.arange(tables.shape[1])[None, :] < need[:, None]  # a short table is narrower than W
        bad |= (((tables < 0) | (tables >= (num_blocks if num_blocks is not None else np.inf))) & used).any(1)
    bad = np.flatnonzero(bad)
    if bad.size:
        i = int(bad[0])
        who = f"request {req_ids[i]!r}" if req_ids is not None else f"request #{i}"
        if q[i] < 1:
            why = "has no new tokens (every request in a step must bring at least one)"
        elif k[i] < 0:
            why = f"has a negative number of cached tokens ({k[i]})"
        elif lens[i] < need[i]:
            why = (f"has a block table of {lens[i]} blocks but {seq_lens[i]} tokens need "
                   f"{need[i]} blocks of {block_size}; allocate more blocks before the step")
        else:
            why = f"has block ids outside the pool [0, {num_blocks}): {tables[i, :need[i]].tolist()}"
        raise ValueError(f"{who} {why}")
    if int(q.sum()) != input_ids.shape[0]:
        raise ValueError(f"{input_ids.shape[0]} input ids given for {int(q.sum())} new tokens")

    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    N = int(qsl[-1])
    req_of_token = np.repeat(np.arange(B), q)
    positions = np.arange(N, dtype=np.int64) - np.repeat(qsl[:-1] - k, q)
    tables = tables.astype(np.int32, copy=False)
    slot_mapping = tables[req_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    return ForwardBatch(
        input_ids=input_ids.astype(np.int64, copy=False),
        positions=positions,
        query_start_loc=qsl.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        slot_mapping=slot_mapping,
        block_tables=tables,
        logits_indices=qsl[1:][needs_logits] - 1,
        max_query_len=int(q.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
    )


def build_batch(
    seqs: Sequence[SeqSlice], block_size: int, num_blocks: int | None = None
) -> ForwardBatch:
    """Lay `seqs` end to end and compute the step's metadata (the convenient list-of-requests form)."""
    if not seqs:
        raise ValueError("a batch needs at least one request")
    tokens = [np.asarray(s.token_ids, dtype=np.int64).reshape(-1) for s in seqs]
    tables = [np.asarray(s.block_table, dtype=np.int64).reshape(-1) for s in seqs]
    lens = np.array([t.shape[0] for t in tables], dtype=np.int64)
    padded = np.zeros((len(seqs), max(1, int(lens.max()))), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, : t.shape[0]] = t
    return layout(
        np.concatenate(tokens),
        np.array([s.num_cached for s in seqs], dtype=np.int64),
        np.array([t.shape[0] for t in tokens], dtype=np.int64),
        padded, np.array([s.needs_logits for s in seqs], dtype=bool), block_size,
        table_lens=lens, num_blocks=num_blocks, req_ids=[s.req_id for s in seqs])


class BatchBuffers:
    """Per-request rows (token ids, block table) a serving loop updates in place, so a step's
    metadata is array gathers with no Python loop."""

    def __init__(self, max_rows: int, max_model_len: int, max_blocks_per_seq: int):
        self.tokens = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_tables = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)

    def set_tokens(self, row: int, start: int, token_ids: Sequence[int] | np.ndarray) -> None:
        self.tokens[row, start:start + len(token_ids)] = token_ids

    def build(self, rows: np.ndarray, num_cached: np.ndarray, num_new: np.ndarray, needs_logits: np.ndarray,
              block_size: int, num_blocks: int | None = None,
              req_ids: Sequence[object] | None = None) -> ForwardBatch:
        """The step's ForwardBatch from buffer rows (what layout makes of the same requests)."""
        q = num_new.astype(np.int64, copy=False)
        if block_size >= 1 and len(q) and needs_logits.dtype == bool and q.min() == 1 == q.max():
            fast = self._decode(rows, num_cached.astype(np.int64, copy=False), needs_logits, block_size, num_blocks)
            if fast is not None:
                return fast
        starts = np.cumsum(q) - q
        cols = np.arange(int(q.sum())) - np.repeat(starts - num_cached, q)
        input_ids = self.tokens[np.repeat(rows, q), cols]
        width = max(1, -(-int((num_cached + q).max()) // block_size))
        return layout(input_ids, num_cached, q, self.block_tables[rows, :width], needs_logits, block_size,
                      table_lens=self.num_blocks[rows], num_blocks=num_blocks, req_ids=req_ids)

    def _decode(self, rows: np.ndarray, k: np.ndarray, needs_logits: np.ndarray, block_size: int,
                num_blocks: int | None) -> ForwardBatch | None:
        """build() of a pure-decode step, cheaper, same result as layout's (tests/engine/test_batch.py);
        None when a check fails, so that layout names the bad request."""
        B = len(k)
        blk = k // block_size
        kmax = int(k.max())
        W = kmax // block_size + 1
        # layout's checks; negative ids wrap to huge unsigned ones.
        if blk.min() < 0 or (self.num_blocks[rows] <= blk).any():
            return None
        tables = self.block_tables[rows, :W]
        ids = tables.view(np.uint32)
        if tables.size and ids.max() >= (2**31 if num_blocks is None else min(num_blocks, 2**31)):
            return None  # maybe a stale entry past a request's last block: layout looks closer
        return self.decode_batch(rows, k.copy(), self.tokens[rows, k], block_size, kmax,
                                 logits_indices=np.flatnonzero(needs_logits), tables=tables)

    def decode_batch(self, rows: np.ndarray, k: np.ndarray, input_ids: np.ndarray, block_size: int, kmax: int, *,
                     logits_indices: np.ndarray | None = None, tables: np.ndarray | None = None) -> ForwardBatch:
        """A pure-decode step's ForwardBatch, unchecked (`_decode` checks): token `input_ids[i]` at
        position `k[i]` of row `rows[i]`; `k` becomes the batch's positions."""
        B = len(k)
        blk, offset = np.divmod(k, block_size)
        if tables is None:
            tables = self.block_tables[rows, :kmax // block_size + 1]
        slot_mapping = np.multiply(self.block_tables[rows, blk], block_size, dtype=np.int64)
        slot_mapping += offset
        return ForwardBatch(
            input_ids=input_ids,
            positions=k,
            query_start_loc=np.arange(B + 1, dtype=np.int32),
            seq_lens=np.add(k, 1, dtype=np.int32, casting="unsafe"),
            slot_mapping=slot_mapping,
            block_tables=tables,
            logits_indices=np.arange(B, dtype=np.int64) if logits_indices is None else logits_indices,
            max_query_len=1,
            max_seq_len=kmax + 1,
            block_size=block_size,
        )
