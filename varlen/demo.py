"""One mixed varlen step on the embedded tiny model, checked against each request run alone.

    python -m varlen.demo [--arch qwen3|llama] [--backend torch_ref] [--block-size 4]

Step 1 prefills A (30 tokens) and the first 16 tokens of C. Step 2 is the mixed step: A decodes
one token, B prefills all 6 of its tokens, C computes its next 4-token chunk.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from varlen import registry
from varlen.attention_api import BackendUnavailable
from varlen.batch import SeqSlice, build_batch
from varlen.model_runner import ModelRunner, load_model
from varlen.tiny_model import ARCHITECTURES, ensure_tiny_model


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(prog="python -m varlen.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3", choices=sorted(ARCHITECTURES))
    p.add_argument("--backend", default="torch_ref", help=f"one of {', '.join(registry.names('backend'))}, "
                                                          f"or a backend class's dotted path")
    p.add_argument("--block-size", type=int, default=4, help="tokens per KV block (>= 1)")
    a = p.parse_args(argv)
    if a.block_size < 1:
        p.exit(2, f"error: --block-size {a.block_size} is not valid; give tokens per KV block >= 1 (e.g. 4)\n")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    path = ensure_tiny_model(a.arch)
    bs = a.block_size
    lens = {"A": 31, "B": 6, "C": 20}  # tokens each request holds in the KV cache after step 2
    need = {k: -(-n // bs) for k, n in lens.items()}
    num_blocks = 2 * sum(need.values())
    try:
        backend = registry.build("backend", a.backend)
        runner = ModelRunner(path, backend, bs, num_blocks=num_blocks)
    except (ValueError, BackendUnavailable) as e:
        p.exit(2, f"error: --backend {a.backend!r}: {' '.join(str(e).split())}\n")
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    A, B, C = (rng.integers(3, vocab, n).tolist() for n in (31, 6, 40))
    blocks = rng.permutation(num_blocks).tolist()  # scattered block ids, on purpose
    tables = {}
    for k in lens:
        tables[k], blocks = blocks[:need[k]], blocks[need[k]:]
    runner.execute(build_batch([SeqSlice(A[:30], 0, tables["A"], False, "A"),
                                SeqSlice(C[:16], 0, tables["C"], False, "C")], bs))
    batch = build_batch([SeqSlice(A[30:], 30, tables["A"], True, "A"),
                         SeqSlice(B, 0, tables["B"], True, "B"),
                         SeqSlice(C[16:20], 16, tables["C"], True, "C")], bs)
    logits = runner.execute(batch)
    oracle = load_model(path, torch.float32, "cpu", attn_implementation="sdpa")
    print(f"mixed step on {path} ({a.arch}), backend={a.backend}, block_size={bs}")
    print(f"  query_start_loc={batch.query_start_loc.tolist()} seq_lens={batch.seq_lens.tolist()}")
    print(f"  positions={batch.positions.tolist()} logits_indices={batch.logits_indices.tolist()}")
    print(f"  {'request':8} {'kind':16} {'new':>4} {'cached':>6} {'max |err| vs alone':>20}")
    worst = 0.0
    with torch.inference_mode():
        for row, (name, seq, kind, new, cached) in enumerate([
                ("A", A[:31], "decode", 1, 30), ("B", B, "full prefill", 6, 0),
                ("C", C[:20], "prefill chunk", 4, 16)]):
            alone = oracle(torch.tensor([seq])).logits[0, -1]
            err = (logits[row] - alone).abs().max().item()
            worst = max(worst, err)
            print(f"  {name:8} {kind:16} {new:>4} {cached:>6} {err:>20.2e}")
    print(f"  worst error {worst:.2e} ({'OK' if worst <= 1e-4 else 'MISMATCH'}, tolerance 1e-4 in fp32)")
    return worst


if __name__ == "__main__":
    raise SystemExit(0 if main() <= 1e-4 else 1)
