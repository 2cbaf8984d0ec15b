"""The host's roofline, measured: achievable fp32 GEMM FLOP/s and memory read bandwidth, a
workload's minimum time from its step log, and the decode-attention micro-benchmark.

    python benchmarks/roofline.py                      # host peaks + decode attention, 64 requests x 1k context
    python benchmarks/roofline.py --threads 1 --batch 64 --context 1024 --backends torch_paged torch_sdpa

The decode micro-benchmark times one layer's attention call (the ~50M Qwen3 shape: 8 query heads,
4 KV heads, head dim 64, fp32, blocks of 16, block ids shuffled over the pool) for each backend,
best of `--repeats`, and reports the K/V bytes it must read per second as a fraction of the
read bandwidth measured just before it, in rounds (`--rounds`) so that drifting machine load hits both
alike. benchmarks/throughput.py uses `host_peaks` and `minimum_time` for its
end-to-end roofline fraction.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from varlen import registry  # noqa: E402
from varlen.batch import SeqSlice, build_batch  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()  # warm up (first-use builds, allocator, caches)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(repeats: int, mib: int = 512) -> float:
    """Read bandwidth (summing `mib` MiB, far past any cache) with torch's current thread count."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / best_of(lambda: x.sum(), repeats)


def host_peaks(repeats: int = 5, gemm_n: int = 1024, mib: int = 512) -> dict[str, float]:
    """fp32 GEMM FLOP/s (square `gemm_n` matmul) and read bandwidth (summing `mib` MiB, far past
    any cache), with torch's current thread count, best of `repeats`. The GEMM rate is the faster
    of the two kernels this torch has (MKL's sgemm behind torch.mm; oneDNN with a packed weight,
    what varlen's and vLLM's CPU linear layers use), so no contender can beat the roofline by
    picking the other one; both are returned."""
    a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
    out = torch.empty(gemm_n, gemm_n)
    t_mm = best_of(lambda: torch.mm(a, b, out=out), repeats)
    rates = dict(flops_mkl=2 * gemm_n**3 / t_mm)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), gemm_n)
        t_dnn = best_of(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats)
        rates["flops_onednn"] = 2 * gemm_n**3 / t_dnn
    return dict(flops=max(rates.values()), **rates, read_bw=read_bandwidth(repeats, mib))


@dataclass
class Shape:
    """What the roofline needs of a model: parameter counts and attention sizes."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linear_params: int  # weights of the decoder layers' linear maps (per token: 2 FLOPs each)
    elem: int = 4

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Shape":
        cfg = model.config
        head = model.get_output_embeddings()
        lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.vocab_size,
                   lin, next(model.parameters()).element_size())

    def step(self, new: Iterable[int], cached: Iterable[int], sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one step: linear layers over every new token, attention of each new
        token over the keys it sees (causal), the LM head at the sampled rows; the weights read
        once, each request's K/V read once per layer."""
        new, cached = np.asarray(list(new), dtype=np.float64), np.asarray(list(cached), dtype=np.float64)
        rows = new.sum()
        pairs = (new * cached + new * (new + 1) / 2).sum()  # (query, visible key) pairs
        flops = (2 * self.linear_params * rows + 4 * self.layers * self.q_heads * self.head_dim * pairs
                 + 2 * self.hidden * self.vocab * sampled)
        kv = 2 * self.layers * self.kv_heads * self.head_dim * self.elem * (new + cached).sum()
        weights = (self.linear_params + self.hidden * self.vocab) * self.elem
        return flops, weights + kv


def minimum_time(shape: Shape, steps: Iterable, peaks: dict[str, float]) -> dict[str, float]:
    """The schedule's roofline: each step takes at least max(FLOPs / GEMM peak, bytes / bandwidth)."""
    total = flops_s = bytes_s = 0.0
    n = 0
    for rec in steps:
        sampled = rec.num_sampled if rec.num_sampled >= 0 else len(rec.new_tokens)
        f, b = shape.step(rec.new_tokens, rec.cached_tokens, sampled)
        tf, tb = f / peaks["flops"], b / peaks["read_bw"]
        total += max(tf, tb)
        flops_s += tf
        bytes_s += tb
        n += 1
    return dict(min_s=total, compute_s=flops_s, memory_s=bytes_s, steps=n)


def decode_problem(batch: int, context: int, q_heads: int = 8, kv_heads: int = 4, head_dim: int = 64,
                   block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0):
    """`batch` decodes, each after `context - 1` cached tokens, blocks shuffled over the pool."""
    per = -(-context // block_size)
    rng = np.random.default_rng(seed)
    ids = rng.permutation(batch * per)
    seqs = [SeqSlice([5], context - 1, ids[i * per:(i + 1) * per]) for i in range(batch)]
    fb = build_batch(seqs, block_size, batch * per)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, batch * per, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
    return fb, cache, q, k, v, kv_bytes


def decode_attention_call(backend: str, problem):
    """A no-argument callable running one layer's decode attention of `problem` on `backend`."""
    fb, cache, q, k, v, _ = problem
    b = registry.build("backend", backend)
    nb, bs, hkv, d = cache.shape[1:]
    own = b.allocate_kv_cache(1, nb, bs, hkv, d, cache.dtype, "cpu")[0]  # its layout; values: any
    cache = own.view(-1).copy_(cache.view(-1)).view(own.shape)
    meta = b.prepare(fb, "cpu")
    scale = q.shape[-1] ** -0.5
    return lambda: b.forward(q, k, v, cache, meta, scale)


def decode_attention_time(backend: str, problem, repeats: int) -> float:
    return best_of(decode_attention_call(backend, problem), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5,
                    help="decode table: rounds of (bandwidth, each backend) measured back to back")
    ap.add_argument("--backends", nargs="+", default=["torch_paged", "torch_sdpa"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    peaks = host_peaks()
    kernels = ", ".join(f"{k.removeprefix('flops_')} {v / 1e9:.1f}" for k, v in peaks.items() if k.startswith("flops_"))
    print(f"host ({a.threads} threads): fp32 GEMM {peaks['flops'] / 1e9:.1f} GFLOP/s (the faster of: {kernels}), "
          f"read bandwidth {peaks['read_bw'] / 1e9:.1f} GB/s")
    print_decode_table(a.backends, a.batch, a.context, a.repeats, a.rounds)


def print_decode_table(names: list[str], batch: int, context: int, repeats: int, rounds: int) -> None:
    """Each round measures the read bandwidth, then every backend (best of `repeats` calls each), back
    to back, so that a round's ratio compares like with like on a machine whose load drifts; the
    table gives the median round's ratio and the best round's."""
    problem = decode_problem(batch, context)
    kv_bytes = problem[-1]
    calls = {n: decode_attention_call(n, problem) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    bws = []
    for _ in range(rounds):
        bws.append(read_bandwidth(3))
        for n, fn in calls.items():
            times[n].append(best_of(fn, repeats))
            ratios[n].append(kv_bytes / times[n][-1] / bws[-1])
    base = min(times["torch_sdpa"]) if "torch_sdpa" in times else None
    print(f"\ndecode attention, one layer: {batch} requests x {context} context, 8/4 heads x 64, fp32, "
          f"{kv_bytes / 2**20:.0f} MiB of K/V; {rounds} rounds of (read bandwidth: "
          f"{' '.join(f'{b / 1e9:.1f}' for b in bws)} GB/s; each backend, best of {repeats})")
    print(f"{'backend':<12} {'best ms':>8} {'GB/s':>7} {'of measured bw (median round, best round)':>43} "
          f"{'speedup vs torch_sdpa':>22}")
    for n in names:
        t = min(times[n])
        ratio = f"{base / t:.2f}x" if base else "-"
        share = f"{float(np.median(ratios[n])):.0%}, {max(ratios[n]):.0%}"
        print(f"{n:<12} {t * 1e3:>8.2f} {kv_bytes / t / 1e9:>7.1f} {share:>43} {ratio:>22}")


if __name__ == "__main__":
    main()
