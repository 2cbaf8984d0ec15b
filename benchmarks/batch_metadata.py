"""Metadata build: vectorised `build_batch` vs a straightforward per-token Python loop.

    python benchmarks/batch_metadata.py

Mixed steps (a quarter of the requests prefill a chunk of up to 512 tokens, the rest decode one
token; the last row is pure decode) with cached contexts up to a maximum. Prints the time per build and the ratio, and shows
that the vectorised cost follows the number of requests, not the number of cached tokens.
"""

from __future__ import annotations

import time

import numpy as np

from varlen.batch import BatchBuffers, SeqSlice, build_batch

BLOCK = 16


def workload(n_req: int, max_ctx: int, prefill_every: int = 4, seed: int = 0) -> list[SeqSlice]:
    rng = np.random.default_rng(seed)
    seqs, next_block = [], 0
    for i in range(n_req):
        cached = int(rng.integers(0, max_ctx))
        new = int(rng.integers(1, 513)) if prefill_every and i % prefill_every == 0 else 1
        nb = -(-(cached + new) // BLOCK)
        seqs.append(SeqSlice(rng.integers(0, 32000, new), cached, np.arange(next_block, next_block + nb),
                             needs_logits=True, req_id=i))
        next_block += nb
    return seqs


def per_token_loop(seqs: list[SeqSlice]) -> dict:
    """The obvious implementation: one Python iteration per new token."""
    input_ids, positions, slots, qsl, seq_lens, logits = [], [], [], [0], [], []
    width = max(len(s.block_table) for s in seqs)
    tables = []
    for s in seqs:
        for j, tok in enumerate(s.token_ids):
            pos = s.num_cached + j
            input_ids.append(int(tok))
            positions.append(pos)
            slots.append(int(s.block_table[pos // BLOCK]) * BLOCK + pos % BLOCK)
        qsl.append(qsl[-1] + len(s.token_ids))
        seq_lens.append(s.num_cached + len(s.token_ids))
        tables.append(list(s.block_table) + [0] * (width - len(s.block_table)))
        if s.needs_logits:
            logits.append(qsl[-1] - 1)
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slots, query_start_loc=qsl,
                seq_lens=seq_lens, block_tables=tables, logits_indices=logits)


def best_of(fn, *args, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def persistent(seqs: list[SeqSlice], max_ctx: int) -> tuple[BatchBuffers, tuple]:
    """What a serving loop holds between steps: each request's tokens and block table in a row."""
    buf = BatchBuffers(len(seqs), max_ctx + 513, -(-(max_ctx + 513) // BLOCK))
    for i, s in enumerate(seqs):
        buf.set_tokens(i, s.num_cached, s.token_ids)
        buf.block_tables[i, :len(s.block_table)] = s.block_table  # as ModelExecutor keeps its rows
        buf.num_blocks[i] = len(s.block_table)
    args = (np.arange(len(seqs)), np.array([s.num_cached for s in seqs]),
            np.array([len(s.token_ids) for s in seqs]), np.ones(len(seqs), bool), BLOCK)
    return buf, args


def main() -> None:
    print("build_batch: list of per-request slices; BatchBuffers.build: persistent rows (the engine's path)")
    print(f"{'requests':>8} {'max ctx':>8} {'new tok':>8} {'cached tok':>11} {'loop ms':>9} "
          f"{'build_batch ms':>15} {'ratio':>7} {'buffers ms':>11} {'ratio':>7}")
    for n_req, max_ctx, every in [(512, 4096, 4), (128, 4096, 4), (2048, 4096, 4), (512, 512, 4),
                                  (512, 32768, 4), (512, 4096, 0)]:
        seqs = workload(n_req, max_ctx, every)
        buf, args = persistent(seqs, max_ctx)
        ref, got, fast = per_token_loop(seqs), build_batch(seqs, BLOCK), buf.build(*args)
        for b in (got, fast):
            assert ref["slot_mapping"] == b.slot_mapping.tolist() and ref["positions"] == b.positions.tolist()
            assert ref["input_ids"] == b.input_ids.tolist()
        t_loop, t_vec, t_buf = best_of(per_token_loop, seqs), best_of(build_batch, seqs, BLOCK), \
            best_of(buf.build, *args)
        print(f"{n_req:>8} {max_ctx:>8} {got.num_tokens:>8} {int(got.num_cached.sum()):>11} "
              f"{t_loop * 1e3:>9.2f} {t_vec * 1e3:>15.3f} {t_loop / t_vec:>6.1f}x "
              f"{t_buf * 1e3:>11.3f} {t_loop / t_buf:>6.1f}x")


if __name__ == "__main__":
    main()
