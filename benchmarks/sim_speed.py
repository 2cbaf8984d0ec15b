"""Simulator speed: requests simulated per second of wall time on the whole Azure conversation
trace (19,366 requests) with the chunked policy, Llama-3-8B on an H100 (roofline by default;
`--costs roofline,measured` for each cost model named).

    python benchmarks/sim_speed.py [--budgets 512,2048] [--cores compiled,pure] [--modes off,on]
                                   [--costs roofline] [--repeats 3] [--rate R] [--limit N] [--profile]

For each token budget (scheduler.max_num_batched_tokens: 512 is the engine's CPU default and
Sarathi-Serve's strict setting, 2048 a common GPU setting) the trace runs with each core (the
mypyc-compiled one and pure Python, varlen/compiled.py) and each mode (`off`: one step at a
time, fast_forward=false; `on`: the decode fast-forward, the default). Every run is its own
process (which core an import gets is decided once per process), and the runs are interleaved
repeat by repeat, because this VM's speed drifts by up to 20%. The table shows the fastest
(min) and the median event-loop time, requests/s, end to end (trace loading, simulation,
summary metrics) time and requests/s, and the speed-up against the pure core stepping one
step at a time. All runs' summaries must agree exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# This checkout's packages, not an installed one's: run from a worktree, time that worktree's code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMING_KEYS = ("sim_wall_s", "sim_requests_per_wall_s", "e2e_wall_s")


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints its summary row as JSON."""
    import cProfile
    import pstats

    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config
    from varlen.compiled import status

    overrides = [f"scheduler={args.scheduler}", "workload=azure_conv", "output.requests=false",
                 f"scheduler.max_num_batched_tokens={args.budget}", f"fast_forward={args.mode == 'on'}",
                 f"cost.model={args.cost}"]
    if args.rate:
        overrides.append(f"workload.rate={args.rate}")
    if args.limit:
        overrides.append(f"workload.limit={args.limit}")
    w0 = time.perf_counter()
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    res, row = simulate_config(cfg)
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    row["e2e_wall_s"] = time.perf_counter() - w0
    row["ff_steps"] = sum(r.engine.num_fast_forwarded_steps for r in res.replicas)
    row["core"] = status()
    print(json.dumps(row))


def run_child(argv: list[str], core: str, budget: str, mode: str, cost: str) -> dict:
    env = {**os.environ, "VARLEN_PURE": "1" if core == "pure" else ""}
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", "--budget", budget, "--mode", mode,
                           "--cost", cost], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({core}, budget {budget}, fast_forward {mode}, cost {cost}):\n{proc.stderr[-3000:]}")
    if proc.stderr.strip():
        print(proc.stderr, file=sys.stderr)
    row = json.loads(proc.stdout.splitlines()[-1])
    if not row["core"].startswith(core):
        raise SystemExit(f"asked for the {core} core, the run got: {row['core']} "
                         "(build the compiled core with `python -m varlen.compile`)")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="512,2048", help="comma-separated max_num_batched_tokens values")
    p.add_argument("--cores", default="compiled,pure", help="compiled, pure or both (varlen/compiled.py)")
    p.add_argument("--modes", default="off,on", help="fast_forward off, on, or both")
    p.add_argument("--rate", type=float, default=None, help="target req/s (default: the trace's own, 5.53)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--scheduler", default="chunked")
    p.add_argument("--costs", default="roofline", help="comma-separated cost.model values (roofline, measured)")
    p.add_argument("--profile", action="store_true", help="cProfile each run (pure Python only is visible)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (min and median shown)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--cost", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    argv = sys.argv[1:]
    cores, modes = args.cores.split(","), args.modes.split(",")
    print(f"{'cost':>8} {'budget':>6} {'core':>8} {'fast_fwd':>8} {'steps':>7} {'ff steps':>8} {'mean B':>6} {'loop s min':>10} "
          f"{'median':>6} {'loop req/s':>10} {'e2e s min':>9} {'e2e req/s':>9} {'vs pure/off':>11}")
    n = row = None
    for cost, budget in [(c, b) for c in args.costs.split(",") for b in args.budgets.split(",")]:
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            for core in cores:
                for mode in modes:
                    runs.setdefault((core, mode), []).append(run_child(argv, core, budget, mode, cost))
        base = runs.get(("pure", "off"))
        base_loop = min(r["sim_wall_s"] for r in base) if base else None
        for (core, mode), rows in runs.items():
            row, n = rows[0], rows[0]["requests"]
            loop = sorted(r["sim_wall_s"] for r in rows)
            e2e = min(r["e2e_wall_s"] for r in rows)
            ratio = f"{base_loop / loop[0]:.1f}x" if base_loop else "-"
            print(f"{cost:>8} {budget:>6} {core:>8} {mode:>8} {row['steps']:>7} {row['ff_steps']:>8} {row['mean_batch_size']:>6.1f} "
                  f"{loop[0]:>10.2f} {loop[len(loop) // 2]:>6.2f} {n / loop[0]:>10.0f} {e2e:>9.2f} {n / e2e:>9.0f} "
                  f"{ratio:>11}", flush=True)
        all_rows = [r for rows in runs.values() for r in rows]
        ref = all_rows[0]
        differ = sorted({k for r in all_rows for k in ref if k not in TIMING_KEYS + ("ff_steps", "core")
                         and r[k] != ref[k] and ref[k] == ref[k]})
        print(f"{'':>15} summaries of all {len(all_rows)} runs " + ("identical" if not differ else f"DIFFER in {differ}"))
    print(f"{n} requests, simulated {row['sim_time_s']:.0f} s of serving; goal >= 10,000 requests/s; "
          "Vidur: 2,048 requests in 32 s = 64 requests/s")


if __name__ == "__main__":
    main()
