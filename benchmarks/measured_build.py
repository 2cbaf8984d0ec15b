"""How stable is `cost.model=measured` from one build to the next: sim.profile's part only, no trace run.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 taskset -c 1 python3 benchmarks/measured_build.py --passes 6 --rows-out rows.jsonl
    python3 benchmarks/measured_build.py --rows-in rows.jsonl --per-build 1     # refit saved passes, no timing

Times the operator and attention tables once (as benchmarks/sim_fidelity.py's MeasuredProfiler), then
`--passes` passes of profile_engine's synthetic batches; each group of `--per-build` consecutive passes is
one build's engine data. For each build it prints the engine fit's coefficients and the predicted decode
step (1..8 requests, 300 cached tokens each), then their spread over the builds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (1, 2, 3, 4, 6, 8, 16, 32)
CACHED = 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=6, help="profile_engine passes to time")
    p.add_argument("--per-build", type=int, default=1, help="passes per build")
    p.add_argument("--rows-out", default=None, help="save the passes' step rows (JSON lines) to refit later")
    p.add_argument("--rows-in", default=None, help="refit saved rows (and their tables) instead of timing")
    p.add_argument("--tables", default=None, help="folder for (or of) the operator tables (default: a temp dir)")
    p.add_argument("--backend", default="auto",
                   help="attention backend (default auto: what backend=auto, the engine's default, picks here; printed)")
    p.add_argument("--budget", type=int, default=256, help="the engine's token budget (default: sim_fidelity's)")
    p.add_argument("--seqs", type=int, default=16, help="the engine's seats (default: sim_fidelity's)")
    p.add_argument("--max-len", type=int, default=1024, help="the engine's longest request (default: sim_fidelity's)")
    p.add_argument("--blocks", type=int, default=1024, help="the engine's KV blocks (default: sim_fidelity's)")
    p.add_argument("--fit-from", default=None,
                   help="fit with another sim/profile.py's fit_engine_overhead, to compare (e.g. `git show "
                        "main:sim/profile.py > old.py`)")
    a = p.parse_args()

    import torch

    from sim.cost.measured import MeasuredCostModel
    from sim.profile import (DEFAULT_TOKENS, fit_engine_overhead, profile_attention, profile_engine, profile_model,
                             resolve_backend, write_table)
    from throughput import model_dir

    torch.set_num_threads(1)
    if a.fit_from:
        import importlib.util
        import inspect

        spec = importlib.util.spec_from_file_location("fit_from", a.fit_from)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fit_engine_overhead = mod.fit_engine_overhead
        takes_groups = "groups" in inspect.signature(fit_engine_overhead).parameters
    else:
        takes_groups = True
    folder = model_dir("50m")
    a.backend, line = resolve_backend(a.backend, Path(folder))
    print(line, flush=True)
    cfg = json.loads((folder / "config.json").read_text())
    root = Path(a.tables or tempfile.mkdtemp(prefix="mbuild-"))
    passes: list[list] = []
    if a.rows_in:
        for line in Path(a.rows_in).read_text().splitlines():
            d = json.loads(line)
            while len(passes) <= d["pass"]:
                passes.append([])
            passes[d["pass"]].append((d["new"], d["cached"], d["s"], d["logits"]))
    else:
        tokens = tuple(t for t in DEFAULT_TOKENS if t <= 512)
        write_table(profile_model(folder, tokens, 7), root, "cpu_2core", "m")
        write_table(profile_attention(folder, a.backend, 7), root, "cpu_2core", "m", "attention")
        print(f"tables -> {root}", flush=True)
        groups_out: list[int] = []
        settings = {"max_num_seqs": a.seqs, "max_num_batched_tokens": a.budget, "max_model_len": a.max_len,
                    "num_blocks": a.blocks}
        rows = profile_engine(folder, a.backend, 3, passes=a.passes, groups_out=groups_out, settings=settings)
        passes = [[r for r, g in zip(rows, groups_out) if g == i] for i in range(a.passes)]
        print(f"{a.passes} passes, {len(rows)} steps", flush=True)
        if a.rows_out:
            with open(a.rows_out, "w") as f:
                for i, rows in enumerate(passes):
                    for new, cached, s, logits in rows:
                        f.write(json.dumps({"pass": i, "new": [int(x) for x in new],
                                            "cached": [int(x) for x in cached], "s": s, "logits": logits}) + "\n")
    k = a.per_build
    builds = [sum(passes[i:i + k], []) for i in range(0, len(passes) - k + 1, k)]
    groups = [sum(([j] * len(passes[j]) for j in range(i, i + k)), []) for i in range(0, len(passes) - k + 1, k)]
    keys = ("const_ms", "per_seq_ms", "per_prefill_ms", "ops_scale", "decode_ops_scale", "step_mape_pct")
    preds, coefs, ratios = [], [], []
    for i, rows in enumerate(builds):
        fit = fit_engine_overhead(rows, cfg, "cpu_2core", root, **({"groups": groups[i]} if takes_groups else {}))
        write_table([fit], root, "cpu_2core", "m", "overhead")
        cost = MeasuredCostModel(cfg, "cpu_2core", profiles=root)
        pred = [cost.step_time([1] * n, [CACHED] * n) * 1e3 for n in SIZES]
        # The model over the real steps it was fitted on (median by decode size): the fit's own error.
        ratio = {n: np.median([cost.step_time(r[0], r[1], r[3]) / r[2] for r in rows
                               if len(r[0]) == n and max(r[0]) == 1] or [np.nan]) for n in SIZES}
        preds.append(pred)
        coefs.append([fit[c] for c in keys])
        ratios.append([ratio[n] for n in SIZES])
        extra = "".join(f", {c} {fit[c]:.3g}" for c in ("spread_pct", "pass_speed_min", "pass_speed_max") if c in fit)
        extra += "".join(f", {c} {fit[c]}" for c in ("decode_scale_pinned", "decode_scale_note") if c in fit)
        print(f"build {i + 1} ({fit['steps']} steps): " + ", ".join(f"{c} {fit[c]:.3g}" for c in keys) + extra)
        print(f"  decode step at {CACHED} cached, ms: " + ", ".join(f"{n}: {v:.2f}" for n, v in zip(SIZES, pred))
              + "; model/real on its own steps: " + ", ".join(f"{n}: {ratio[n]:.3f}" for n in SIZES))
    P, C = np.array(preds), np.array(coefs)
    print(f"\nover {len(builds)} builds of {k} pass(es):")
    for j, c in enumerate(keys):
        print(f"  {c}: {C[:, j].min():.3g} .. {C[:, j].max():.3g}")
    R = np.array(ratios)
    print("  model/real on own steps: " + ", ".join(f"{n}: {R[:, j].min():.3f}..{R[:, j].max():.3f}"
                                                   for j, n in enumerate(SIZES) if not np.isnan(R[:, j]).all()))
    print("  decode step predicted, (max-min)/median %: "
          + ", ".join(f"{n}: {np.ptp(P[:, j]) / np.median(P[:, j]) * 100:.1f}" for j, n in enumerate(SIZES)))


if __name__ == "__main__":
    main()
