"""The model's linear layers on the two CPU kernels varlen can use (varlen/linear_kernels.py):
torch's F.linear (MKL sgemm on the dense weight) and oneDNN's matmul on a weight packed once.

    python benchmarks/linear_kernels.py                 # the 50M benchmark shape, 2 threads
    python benchmarks/linear_kernels.py --model tiny --threads 1

For each distinct (out, in) shape of the model's nn.Linear layers (the LM head included) and each
row count M (decode batches to prefill chunks): GFLOP/s of each kernel, best of --repeats, measured
alternately in this run, and the ratio. The last column is the largest difference between the two
results relative to the largest output (rounding only).

    python benchmarks/linear_kernels.py --merged --threads 1   # then --threads 2

`--merged`: one decoder layer's linear layers on the packed kernel as the model has them (q, k, v, o,
gate, up, down: 7 GEMMs) against q/k/v merged into one GEMM and gate/up into one (4 GEMMs, what vLLM
runs), at each row count, alternately, best of --repeats rounds of 20 calls: wall time and process CPU
time (the OpenMP workers included) per layer, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import model_dir  # noqa: E402
from varlen.linear_kernels import _PACK_ROWS, _onednn_linear, onednn_unavailable  # noqa: E402
from varlen.model_runner import load_model  # noqa: E402


def best(fn, repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def merged_vs_separate(cfg, rows: list[int], repeats: int) -> None:
    """One decoder layer's GEMMs on packed oneDNN: separate (as the model has them) vs q/k/v and gate/up merged."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    gen = torch.Generator().manual_seed(0)

    def packed(n: int, k: int) -> tuple[torch.Tensor, int]:
        return torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=gen), _PACK_ROWS), k

    layouts = {"separate (7)": [packed(q, h), packed(kv, h), packed(kv, h), packed(h, q), packed(inter, h),
                                packed(inter, h), packed(h, inter)],
               "merged (4)": [packed(q + 2 * kv, h), packed(h, q), packed(2 * inter, h), packed(h, inter)]}
    print(f"one decoder layer's linear layers (hidden {h}, q {q}, k/v {kv}, intermediate {inter}), packed oneDNN, "
          f"{torch.get_num_threads()} threads; best of {repeats} rounds of 20 calls, alternating")
    print(f"{'M':>5} {'separate wall us':>17} {'merged':>8} {'ratio':>6} {'separate CPU us':>16} {'merged':>8} "
          f"{'ratio':>6}")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {h, q, inter}}
        best = {name: [float("inf"), float("inf")] for name in layouts}
        for name, ws in layouts.items():  # warm: oneDNN builds a primitive per new row count
            for w, k in ws:
                _onednn_linear(w, None, xs[k])
        for _ in range(repeats):
            for name, ws in layouts.items():
                t, c = time.perf_counter(), time.process_time()
                for _ in range(20):
                    for w, k in ws:
                        _onednn_linear(w, None, xs[k])
                b = best[name]
                b[0] = min(b[0], (time.perf_counter() - t) / 20)
                b[1] = min(b[1], (time.process_time() - c) / 20)
        (sw, sc), (mw, mc) = best.values()
        print(f"{m:>5} {sw * 1e6:>17.1f} {mw * 1e6:>8.1f} {sw / mw:>5.2f}x {sc * 1e6:>16.1f} {mc * 1e6:>8.1f} "
              f"{sc / mc:>5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["big", "tiny"], default="big")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,64,128,512,2048")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--merged", action="store_true",
                    help="one decoder layer: separate q/k/v/o/gate/up/down GEMMs vs q/k/v and gate/up merged")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    why = onednn_unavailable(torch.device("cpu"), torch.float32)
    if why is not None:
        sys.exit(f"oneDNN packed kernel unavailable here: {why}")
    model = load_model(model_dir(a.model), torch.float32, "cpu")
    if a.merged:
        merged_vs_separate(model.config, [int(r) for r in a.rows.split(",")], a.repeats)
        return
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"model {a.model}: linear shapes (out x in) {shapes}; fp32, {a.threads} threads, best of {a.repeats}")
    print(f"{'M':>5} {'out x in':>12} {'F.linear GFLOP/s':>17} {'oneDNN packed':>14} {'ratio':>6} {'max rel diff':>13}")
    gen = torch.Generator().manual_seed(0)
    totals = [0.0, 0.0]
    for m in [int(r) for r in a.rows.split(",")]:
        for n, k in shapes:
            w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
            t_torch = best(lambda: F.linear(x, w), a.repeats)
            t_dnn = best(lambda: _onednn_linear(packed, None, x), a.repeats)
            want = F.linear(x, w)
            diff = float((_onednn_linear(packed, None, x) - want).abs().max() / want.abs().max())
            flops = 2 * m * n * k / 1e9
            totals[0] += t_torch
            totals[1] += t_dnn
            print(f"{m:>5} {f'{n}x{k}':>12} {flops / t_torch:>17.1f} {flops / t_dnn:>14.1f} {t_torch / t_dnn:>5.2f}x "
                  f"{diff:>13.1e}")
    print(f"all shapes and row counts, summed time: F.linear {totals[0] * 1e3:.1f} ms, oneDNN packed "
          f"{totals[1] * 1e3:.1f} ms: {totals[0] / totals[1]:.2f}x")


if __name__ == "__main__":
    main()
