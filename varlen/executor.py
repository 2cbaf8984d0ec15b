"""The real executor: persistent batch buffers → ModelRunner forward → Sampler."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from varlen.batch import BatchBuffers
from varlen.engine import Executor
from varlen.kv.base import KVAllocator
from varlen.model_runner import ModelRunner
from varlen.request import Request
from varlen.sampler import Sampler


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
        # Per row, as Python ints (a numpy scalar costs more to read than the rest of a decode's
        # bookkeeping): tokens written to the buffer, and blocks of the table copied to it.
        self.tokens_written = [0] * max_num_seqs
        self.blocks_written = [0] * max_num_seqs
        self.timings: dict[str, float] = defaultdict(float)  # wall seconds per phase
        self._checked_kv: KVAllocator | None = None
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])  # decode tokens to write: rows, columns, ids

    def _row(self, req: Request, kv: KVAllocator) -> int:
        row = self.rows.get(req.req_id)
        if row is None:
            row = self.rows[req.req_id] = self.free_rows.pop()
            self.tokens_written[row] = 0
            self.blocks_written[row] = 0
            self.buffers.num_blocks[row] = 0
        written = self.tokens_written[row]
        num_tokens = req.num_tokens
        if written < num_tokens:
            p = req.num_prompt_tokens
            if num_tokens - written == 1 and written >= p:  # a decode: the token sampled last step,
                pending = self._pending  # written with the step's others in one assignment
                pending[0].append(row)
                pending[1].append(written)
                pending[2].append(req.output_token_ids[written - p])
            else:
                self.buffers.set_tokens(row, written, req.token_ids(written))
            self.tokens_written[row] = num_tokens
        table = kv.block_table(req)
        have = self.blocks_written[row]
        if len(table) != have:  # blocks are only ever appended while a request holds its row
            self.buffers.block_tables[row, have:len(table)] = table[have:]
            self.buffers.num_blocks[row] = self.blocks_written[row] = len(table)
        return row

    def execute(self, scheduled: Sequence[tuple[Request, int]], kv: KVAllocator) -> list[int | None]:
        if kv is not self._checked_kv:  # an allocator that frees K/V early must match the model
            self.runner.check_kv_allocator(kv)
            self._checked_kv = kv
        t0 = time.perf_counter()
        # One pass over the requests, plain lists, one array each: the per-step Python is most
        # of a small model's step overhead.
        rows, cached, new, wants, sampled_reqs = [], [], [], [], []
        self._pending = ([], [], [])
        try:
            for r, n in scheduled:
                rows.append(self._row(r, kv))
                c = r.num_computed_tokens
                cached.append(c)
                new.append(n)
                w = c + n == r.num_tokens
                wants.append(w)
                if w:
                    sampled_reqs.append(r)
        finally:  # what _row counted as written is written, whatever happens to the step
            pr, pc, pv = self._pending
            if pr:
                self.buffers.tokens[pr, pc] = pv
        ints = np.array((rows, cached, new), np.int64)  # one conversion for the three
        batch = self.buffers.build(ints[0], ints[1], ints[2], np.array(wants, bool), self.runner.block_size,
                                   self.runner.num_blocks, req_ids=[r.req_id for r, _ in scheduled])
        t1 = time.perf_counter()
        logits = self.runner.execute(batch)
        t2 = time.perf_counter()
        sampled = self.sampler.sample(logits, sampled_reqs)
        if len(sampled) == len(wants):  # every request sampled (a decode step)
            out: list[int | None] = list(sampled)
        else:
            tokens = iter(sampled)
            out = [next(tokens) if w else None for w in wants]
        t3 = time.perf_counter()
        self.timings["batch_build"] += t1 - t0
        self.timings["forward"] += t2 - t1
        self.timings["sample"] += t3 - t2
        return out

    def release(self, req: Request) -> None:
        row = self.rows.pop(req.req_id, None)
        if row is not None:
            self.free_rows.append(row)
        self.sampler.release(req)
