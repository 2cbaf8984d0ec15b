"""The real executor: persistent batch buffers → ModelRunner forward → Sampler."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from varlen.batch import BatchBuffers, ForwardBatch
from varlen.engine import Executor
from varlen.kv.base import KVAllocator
from varlen.model_runner import ModelRunner
from varlen.request import Request
from varlen.sampler import Sampler


def decode_inputs(scheduled: Sequence[tuple[Request, int]], rows: dict[object, int], covered: list[int]
                  ) -> tuple[list[Request], list[int], list[int], list[int], list[int]] | None:
    """A pure-decode step's inputs in one pass (requests, rows, positions, token ids, rows whose block
    table to copy first), or None unless each request brings its last known token on a row it holds."""
    reqs: list[Request] = []
    row_of: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    lacking: list[int] = []
    for r, n in scheduled:
        k = r.num_computed_tokens
        if n != 1 or k + 1 != r.num_tokens:
            return None
        row = rows.get(r.req_id)
        if row is None:
            return None
        out = r.output_token_ids
        tokens.append(out[-1] if out else int(r.prompt_token_ids[-1]))
        if k >= covered[row]:
            lacking.append(len(reqs))
        reqs.append(r)
        row_of.append(row)
        positions.append(k)
    return reqs, row_of, positions, tokens, lacking


def step_inputs(scheduled: Sequence[tuple[Request, int]], rows: dict[object, int], tokens_written: list[int],
                covered: list[int]) -> tuple[list[int], list[int], list[int], list[bool], list[Request], list[int],
                                             list[int], list[int], list[int]]:
    """Any step's inputs in one pass: each request's row, counts and whether it samples; the rows to set
    up first (`todo`); and the token writes that bring the other rows up to date."""
    row_of: list[int] = []
    cached: list[int] = []
    new: list[int] = []
    wants: list[bool] = []
    sampled: list[Request] = []
    todo: list[int] = []
    write_rows: list[int] = []
    write_cols: list[int] = []
    write_ids: list[int] = []
    i = 0
    for r, n in scheduled:
        c = r.num_computed_tokens
        num_tokens = r.num_tokens
        row = rows.get(r.req_id, -1)
        row_of.append(row)
        cached.append(c)
        new.append(n)
        w = c + n == num_tokens
        wants.append(w)
        if w:
            sampled.append(r)
        if row < 0 or c + n > covered[row]:
            todo.append(i)
        else:
            written = tokens_written[row]
            p = r.num_prompt_tokens
            if written < p:
                todo.append(i)
            else:
                out = r.output_token_ids
                for pos in range(written, num_tokens):
                    write_rows.append(row)
                    write_cols.append(pos)
                    write_ids.append(out[pos - p])
        i += 1
    return row_of, cached, new, wants, sampled, todo, write_rows, write_cols, write_ids


class ModelExecutor(Executor):
    """Keeps one buffer row per running request, updated incrementally: a decode step writes one
    token and, every block_size steps, one block id per request."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int, sampler: Sampler | None = None):
        self.runner = runner
        self.sampler = Sampler() if sampler is None else sampler
        bs = runner.block_size
        self.buffers = BatchBuffers(max_num_seqs, max_model_len + 1, -(-(max_model_len + 1) // bs))
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Per row, Python ints (cheaper to read than numpy scalars): tokens and table blocks written.
        self.tokens_written = [0] * max_num_seqs
        self.blocks_written = [0] * max_num_seqs
        self.slots_covered = [0] * max_num_seqs
        self.timings: dict[str, float] = defaultdict(float)  # wall seconds per phase
        self._checked_kv: KVAllocator | None = None
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])  # decode tokens to write: rows, columns, ids

    def _row(self, req: Request, kv: KVAllocator) -> int:
        row = self.rows.get(req.req_id)
        if row is None:
            row = self.rows[req.req_id] = self.free_rows.pop()
            self.tokens_written[row] = 0
            self.blocks_written[row] = self.slots_covered[row] = 0
            self.buffers.num_blocks[row] = 0
        written = self.tokens_written[row]
        num_tokens = req.num_tokens
        if written < num_tokens:
            p = req.num_prompt_tokens
            if num_tokens - written == 1 and written >= p:
                pending = self._pending
                pending[0].append(row)
                pending[1].append(written)
                pending[2].append(req.output_token_ids[written - p])
            else:
                self.buffers.set_tokens(row, written, req.token_ids(written))
            self.tokens_written[row] = num_tokens
        self._copy_blocks(req, row, kv)
        return row

    def _copy_blocks(self, req: Request, row: int, kv: KVAllocator) -> None:
        """Bring the buffer's copy of `req`'s block table up to date."""
        table = kv.block_table(req)
        have = self.blocks_written[row]
        n = len(table)
        if n != have:  # blocks are only ever appended while a request holds its row
            added = table[have:]
            pool = self.runner.num_blocks
            if n > have and (min(added) < 0 or max(added) >= pool):  # so every id in the buffer is in the pool
                raise ValueError(f"request {req.req_id!r} has block ids outside the pool [0, {pool}): "
                                 f"{[int(b) for b in table]} (a bug of the KV allocator)")
            self.buffers.block_tables[row, have:n] = added
            self.buffers.num_blocks[row] = self.blocks_written[row] = n
            self.slots_covered[row] = n * self.runner.block_size

    def execute(self, scheduled: Sequence[tuple[Request, int]], kv: KVAllocator) -> list[int | None]:
        if kv is not self._checked_kv:  # an allocator that frees K/V early must match the model
            self.runner.check_kv_allocator(kv)
            self._checked_kv = kv
        t0 = time.perf_counter()
        decode = self._decode_step(scheduled, kv)
        if decode is not None:
            batch, sampled_reqs = decode
            t1 = time.perf_counter()
            logits = self.runner.execute(batch)
            t2 = time.perf_counter()
            out: list[int | None] = list(self.sampler.sample(logits, sampled_reqs))
            t3 = time.perf_counter()
            timings = self.timings
            timings["batch_build"] += t1 - t0
            timings["forward"] += t2 - t1
            timings["sample"] += t3 - t2
            return out
        rows, cached, new, wants, sampled_reqs, todo, wr, wc, wv = step_inputs(
            scheduled, self.rows, self.tokens_written, self.slots_covered)
        if wr:
            self.buffers.tokens[wr, wc] = wv
            written = self.tokens_written
            for row, col in zip(wr, wc):
                written[row] = col + 1
        if todo:
            self._pending = ([], [], [])
            try:
                for i in todo:
                    rows[i] = self._row(scheduled[i][0], kv)
            finally:  # what _row counted as written is written, whatever happens to the step
                pr, pc, pv = self._pending
                if pr:
                    self.buffers.tokens[pr, pc] = pv
        ints = np.array((rows, cached, new), np.int64)
        batch = self.buffers.build(ints[0], ints[1], ints[2], np.array(wants, bool), self.runner.block_size,
                                   self.runner.num_blocks, req_ids=[r.req_id for r, _ in scheduled])
        t1 = time.perf_counter()
        logits = self.runner.execute(batch)
        t2 = time.perf_counter()
        sampled = self.sampler.sample(logits, sampled_reqs)
        if len(sampled) == len(wants):
            out = list(sampled)
        else:
            tokens = iter(sampled)
            out = [next(tokens) if w else None for w in wants]
        t3 = time.perf_counter()
        self.timings["batch_build"] += t1 - t0
        self.timings["forward"] += t2 - t1
        self.timings["sample"] += t3 - t2
        return out

    def _decode_step(self, scheduled: Sequence[tuple[Request, int]],
                     kv: KVAllocator) -> tuple[ForwardBatch, list[Request]] | None:
        """The batch of a pure-decode step (decode_inputs), or None if it is not one; same batch as
        BatchBuffers.build's (tests/engine/test_incremental_batch.py)."""
        got = decode_inputs(scheduled, self.rows, self.slots_covered)
        if got is None:
            return None
        reqs, rows, ks, toks, lacking = got
        covered = self.slots_covered
        for i in lacking:
            row = rows[i]
            self._copy_blocks(reqs[i], row, kv)
            if ks[i] >= covered[row]:
                return None  # the table is short: the checked path says so
        ints = np.array((rows, ks, toks), np.int64)
        return self.buffers.decode_batch(ints[0], ints[1], ints[2], self.runner.block_size, max(ks)), reqs

    def release(self, req: Request) -> None:
        row = self.rows.pop(req.req_id, None)
        if row is not None:
            self.free_rows.append(row)
        self.sampler.release(req)
