"""Leave-one-out validation of the measured cost model over the shipped operator tables.

Over every table (model, GPU, TP degree): the table held out (a TP degree not profiled, the same
shape's other TP degrees still seen) and the model shape held out at every TP degree (a model not
profiled on that GPU). Errors |predicted / measured - 1| per operator group and token range, next
to the sharded roofline's. All-reduce: each profiled size interpolated from the others, and each
worker count's curve predicted as for a count without a table.

    python benchmarks/sim_profiles.py            # prints the tables; --json PATH also writes them
    python benchmarks/sim_profiles.py --parallel # TP/PP sanity table of the 70B models (simulates the trace)

Goals (issue 14), held-out models, TP 1 to 8: every group but attention median <= 5% and max
<= 15%; all-reduce median <= 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.cost.hardware import HardwareSpec  # noqa: E402
from sim.cost.collectives import Collectives, interp_size  # noqa: E402
from sim.cost.gemm import gemm_dims, layer_op_ms  # noqa: E402
from sim.cost.profiles import GEMMS, LAYER_OPS, PER_LAYER, load_profiles  # noqa: E402

HARDWARE = {"a100": "a100_80gb_sxm", "h100": "h100_sxm", "a40": "a40"}
GROUPS = {
    "gemm (QKV, O, up, down)": GEMMS,
    "norms": ("input_layernorm", "post_attention_layernorm"),
    "rope, act, adds": ("attn_rope", "mlp_act", "add"),
    "layer, all but attention": LAYER_OPS,
    "embedding": ("emb",),
}
RANGES = [(1, 16), (17, 128), (129, 1024), (1025, 4096), (4097, 1 << 20)]


def _rng(lo: int, hi: int) -> str:
    return f"{lo}-{hi}" if hi < 1 << 20 else f">{lo - 1}"


def roofline_gemm_ms(hw: HardwareSpec, m: np.ndarray, n: int, k: int) -> np.ndarray:
    d = hw.dtype_bytes
    return np.maximum(2.0 * m * n * k / hw.flops, (n * k + m * (n + k)) * d / hw.bandwidth) * 1e3


def roofline_layer_ms(hw: HardwareSpec, key, tp: int, m: np.ndarray) -> np.ndarray:
    # The roofline's linear block (RooflineCostModel) of the TP-sharded shape.
    hd = key.head_dim
    q, kv = key.heads // tp * hd, max(key.kv_heads // tp, 1) * hd
    inter = key.intermediate // tp
    params = key.hidden * (q + 2 * kv) + q * key.hidden + (3 if key.gated else 2) * key.hidden * inter
    d = hw.dtype_bytes
    act = d * (4 * key.hidden + 2 * q + 2 * kv + 3 * inter)
    return np.maximum(2.0 * params * m / hw.flops, ((params + 2 * key.hidden) * d + act * m) / hw.bandwidth) * 1e3


SCENARIOS = {
    "held_out_table": "Tables held out one at a time (one model shape at one TP degree on one GPU), predicted from "
                      "every other table on that GPU, the same shape's other TP degrees included",
    "held_out_shape": "Model shapes held out (every TP degree 1, 2, 4, 8 of it), predicted from the GEMM shapes of "
                      "the other models profiled on the same GPU",
}


def operator_errors(scenario: str, cases: list[dict] | None = None) -> dict[tuple[str, int], dict[str, list[np.ndarray]]]:
    """|error| per (operator group, token range) and predictor, each table predicted with
    `scenario`'s tables hidden (SCENARIOS); `cases` (if given) gets one row per (GPU, held-out
    table, TP) with the whole layer's signed error where it is largest."""
    prof = load_profiles()
    errs: dict[tuple[str, int], dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for gpu in prof.gpus:
        hw = HardwareSpec.load(HARDWARE[gpu])
        for t in prof.compute(gpu):
            hd = t.key.head_dim
            for tp, (tok, times) in t.by_tp.items():
                # Llama-2-70B and Llama-3-70B share one shape: hiding one hides both.
                held = (t.key, tp) if scenario == "held_out_table" else t.key
                pred, _ = layer_op_ms(prof, gpu, t.key, hd, tp, tok, exclude=(held,))
                dims = gemm_dims(t.key, hd, tp)
                for g, ops in GROUPS.items():
                    ops = [o for o in ops if o in times]
                    meas = sum(PER_LAYER.get(o, 1) * times[o] for o in ops)
                    p = sum(PER_LAYER.get(o, 1) * pred[o] for o in ops)
                    roof = None
                    if g.startswith("gemm"):
                        roof = sum(roofline_gemm_ms(hw, tok, *dims[o]) for o in ops)
                    elif g.startswith("layer"):
                        roof = roofline_layer_ms(hw, t.key, tp, tok)
                    if cases is not None and g.startswith("layer"):
                        e = p / meas - 1
                        i = int(np.abs(e).argmax())
                        cases.append({"scenario": scenario, "gpu": gpu, "model": t.name, "tp": tp, "median_pct": float(np.median(np.abs(e))) * 100,
                                      "max_pct": float(e[i]) * 100, "at_tokens": int(tok[i])})
                    for lo, hi in RANGES:
                        sel = (tok >= lo) & (tok <= hi)
                        if sel.any():
                            errs[(g, lo)]["measured"].append(np.abs(p[sel] / meas[sel] - 1))
                            if roof is not None:
                                errs[(g, lo)]["roofline"].append(np.abs(roof[sel] / meas[sel] - 1))
    return errs


def all_reduce_errors() -> list[tuple[str, str, int, np.ndarray]]:
    """(node, how, workers, |error|) per measured all-reduce curve of a TP group inside a node:
    `size` = each profiled size predicted from the others (what any model sees: the tables do not
    depend on the model); `workers` = the whole curve held out, predicted as the model does for a
    worker count without a table (another count's curve scaled, else a ring over send/recv)."""
    prof = load_profiles()
    out = []
    for node in prof.nodes:
        tables = prof.network(node)
        if "all_reduce" not in tables:
            continue
        curves = tables["all_reduce"].curves
        for (w, dpn), (size, ms) in curves.items():
            if dpn != w:  # TP groups sit inside one node
                continue
            i = np.arange(1, len(size) - 1)
            loo = np.array([interp_size(np.delete(size, j), np.delete(ms, j), size[j])[()] for j in i])
            out.append((node, "size", w, np.abs(loo / ms[i] - 1)))
            held = Collectives(node, prof)
            held.tables = {**tables, "all_reduce": replace(tables["all_reduce"],
                                                           curves={k: v for k, v in curves.items() if k[0] != w})}
            out.append((node, "workers", w, np.abs(held.all_reduce_ms(size, w) / ms - 1)))
    return out


def _stats(xs: list[np.ndarray]) -> tuple[int, float, float, float]:
    a = np.concatenate(xs)
    return len(a), float(np.median(a)) * 100, float(np.percentile(a, 95)) * 100, float(a.max()) * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the tables here")
    ap.add_argument("--parallel", action="store_true", help="the TP/PP sanity table instead")
    ap.add_argument("--limit", type=int, default=3000, help="--parallel: requests of the Azure conversation trace")
    args = ap.parse_args()
    if args.parallel:
        parallel_table(args.limit)
        return
    rows = []
    for scenario in SCENARIOS:
        rows += operator_table(scenario)
        print()
    all_reduce(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def operator_table(scenario: str) -> list[dict]:
    cases: list[dict] = []
    errs = operator_errors(scenario, cases)
    rows: list[dict] = []
    print(f"{SCENARIOS[scenario]} (a100, h100, a40); |error| in %")
    print(f"{'operator group':<26}{'tokens':>11}{'points':>8}{'measured med':>14}{'p95':>6}{'max':>7}"
          f"{'roofline med':>14}{'p95':>6}{'max':>7}")
    for g in GROUPS:
        for lo, hi in [*RANGES, (1, 1 << 20)]:
            if lo == 1 and hi == 1 << 20:
                e = {k: [x for (gg, _), d in errs.items() if gg == g for x in d[k]] for k in ("measured", "roofline")}
                label = "all"
            else:
                e = errs.get((g, lo))
                label = _rng(lo, hi)
                if not e:
                    continue
            n, med, p95, mx = _stats(e["measured"])
            r = _stats(e["roofline"]) if e.get("roofline") else None
            rows.append({"scenario": scenario, "group": g, "tokens": label, "points": n,
                         "measured_median_pct": med, "measured_p95_pct": p95, "measured_max_pct": mx,
                         "roofline_median_pct": r[1] if r else None, "roofline_p95_pct": r[2] if r else None,
                         "roofline_max_pct": r[3] if r else None})
            rs = f"{r[1]:>14.1f}{r[2]:>6.1f}{r[3]:>7.1f}" if r else f"{'-':>14}{'-':>6}{'-':>7}"
            print(f"{g:<26}{label:>11}{n:>8}{med:>14.1f}{p95:>6.1f}{mx:>7.1f}{rs}")
    print("\nWhere the layer's (all but attention) error is largest: per GPU, held-out table and TP degree, "
          "signed error at its worst token count (+ = predicted slower)")
    print(f"{'gpu':<6}{'held-out table':<30}{'TP':>4}{'median %':>10}{'worst %':>9}{'at tokens':>11}")
    for c in sorted(cases, key=lambda c: -abs(c["max_pct"]))[:12]:
        print(f"{c['gpu']:<6}{c['model']:<30}{c['tp']:>4}{c['median_pct']:>10.1f}{c['max_pct']:>+9.1f}{c['at_tokens']:>11}")
        rows.append({"worst_case": True, **c})
    return rows


def all_reduce(rows: list[dict]) -> None:
    print("All-reduce (TP groups inside a node): |error| in %; 'size': each profiled size left out and "
          "interpolated (a held-out model's case); 'workers': the worker count's whole table left out")
    print(f"{'node':<22}{'workers':>8}{'points':>8}{'size med':>10}{'max':>8}{'workers med':>13}{'max':>8}")
    by: dict[tuple[str, int], dict[str, np.ndarray]] = defaultdict(dict)
    for node, how, w, e in all_reduce_errors():
        by[(node, w)][how] = e
    for (node, w), d in by.items():
        a, b = d["size"], d["workers"]
        rows.append({"scenario": "all_reduce", "node": node, "workers": w, "points": len(a),
                     "size_median_pct": float(np.median(a)) * 100, "size_max_pct": float(a.max()) * 100,
                     "workers_median_pct": float(np.median(b)) * 100, "workers_max_pct": float(b.max()) * 100})
        print(f"{node:<22}{w:>8}{len(a):>8}{np.median(a) * 100:>10.1f}{a.max() * 100:>8.1f}"
              f"{np.median(b) * 100:>13.1f}{b.max() * 100:>8.1f}")
    a = np.concatenate([d["size"] for d in by.values()])
    b = np.concatenate([d["workers"] for d in by.values()])
    print(f"{'all':<22}{'':>8}{len(a):>8}{np.median(a) * 100:>10.1f}{a.max() * 100:>8.1f}"
          f"{np.median(b) * 100:>13.1f}{b.max() * 100:>8.1f}")


def parallel_table(limit: int) -> None:
    """KV capacity, decode and 4k-prefill step times and the saturated throughput on the Azure
    conversation trace (its first `limit` requests, arriving at 100/s), per 70B model, GPU,
    parallelism and cost model."""
    from hydra import compose, initialize_config_dir

    from sim.cost.hardware import load_model_config
    from sim.cost.registry import build_cost_model
    from sim.parallel import Parallelism, capacity
    from sim.run import CONF, simulate_config

    print(f"TP/PP sanity: decode step = 64 requests at 2k context each; prefill = one 4096-token prompt; "
          f"throughput = first {limit} requests of the Azure conversation trace at 100 req/s (saturated), chunked")
    print(f"{'model':<11}{'hardware':<15}{'TPxPP':>6}{'KV tokens':>11}{'cost':>10}{'decode ms':>11}{'prefill ms':>12}"
          f"{'out tok/s':>11}{'req/s':>8}{'sim s':>7}")
    for model in ("llama2_70b", "llama3_70b"):
        for hw in ("a100_80gb_sxm", "h100_sxm"):
            for tp, pp in ((2, 1), (4, 1), (8, 1), (4, 2)):
                with initialize_config_dir(CONF, version_base="1.3"):
                    base = [f"sim_model={model}", f"hardware={hw}", f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                            f"workload.limit={limit}", "workload.rate=100", "output.requests=false"]
                    cfgs = {cm: compose("sim", overrides=[*base, f"cost.model={cm}"]) for cm in ("roofline", "measured")}
                for cm, cfg in cfgs.items():
                    c = cfg_dict = __import__("omegaconf").OmegaConf.to_container(cfg, resolve=True)
                    mc = load_model_config(c["sim_model"]["config"])
                    spec = HardwareSpec.from_dict(c["hardware"])
                    cap = capacity(mc, spec, Parallelism(tp, pp), 0.9)
                    m = build_cost_model(c["cost"], mc, spec, cfg_dict["parallel"])
                    dec = m.step_time([1] * 64, [2048] * 64) * 1e3
                    pre = m.step_time([4096], [0]) * 1e3
                    _, row = simulate_config(cfg)
                    print(f"{model:<11}{hw:<15}{f'{tp}x{pp}':>6}{cap.kv_tokens:>11}{cm:>10}{dec:>11.1f}{pre:>12.1f}"
                          f"{row['output_tokens_per_s']:>11.0f}{row['requests_per_s']:>8.2f}{row['sim_wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
