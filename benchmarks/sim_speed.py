"""Simulator speed: requests simulated per second of wall time on the whole Azure conversation
trace (19,366 requests) with the chunked policy, Llama-3-8B on an H100 (roofline).

    python benchmarks/sim_speed.py [--budgets 512,2048] [--rate R] [--limit N] [--profile] [--only on|off]

For each token budget (scheduler.max_num_batched_tokens: 512 is the engine's CPU default and
Sarathi-Serve's strict setting, 2048 a common GPU setting) the trace runs twice: stepping one
step at a time (fast_forward=false) and with the decode fast-forward (the default). One table:
the event loop's wall time and requests/s, and end to end (trace loading, simulation, summary
metrics) wall and CPU time; the two modes' summaries must agree exactly. This VM's speed
varies by up to 20% between identical runs, so each mode runs --repeats times (interleaved)
and the table shows the fastest (min) and the median loop time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from hydra import compose, initialize_config_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="512,2048", help="comma-separated max_num_batched_tokens values")
    p.add_argument("--rate", type=float, default=None, help="target req/s (default: the trace's own, 5.53)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--scheduler", default="chunked")
    p.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    p.add_argument("--only", choices=("on", "off"), help="run one mode (fast_forward on or off)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode (min and median shown)")
    args = p.parse_args()

    from sim.run import CONF, simulate_config
    from varlen.traces import default_traces_dir

    if not (default_traces_dir() / "AzureLLMInferenceTrace_conv.csv").is_file():
        raise SystemExit(f"needs the Azure conversation trace in {default_traces_dir()}")
    base = [f"scheduler={args.scheduler}", "sim_workload=azure_conv", "output.requests=false"]
    if args.rate:
        base.append(f"workload.rate={args.rate}")
    if args.limit:
        base.append(f"workload.limit={args.limit}")
    print(f"{'budget':>6} {'fast_fwd':>8} {'steps':>7} {'ff steps':>8} {'mean B':>6} {'loop s min':>10} "
          f"{'median':>6} {'loop req/s':>10} {'e2e s min':>9} {'e2e req/s':>9}")
    for budget in args.budgets.split(","):
        results: dict[str, list] = {}
        modes = [m for m in ("off", "on") if not args.only or args.only == m]
        for _ in range(args.repeats):
            for mode in modes:
                with initialize_config_dir(CONF, version_base="1.3"):
                    cfg = compose("sim", overrides=[*base, f"scheduler.max_num_batched_tokens={budget}",
                                                    f"fast_forward={mode == 'on'}"])
                w0 = time.perf_counter()
                prof = cProfile.Profile() if args.profile else None
                if prof:
                    prof.enable()
                res, row = simulate_config(cfg)
                if prof:
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
                row["e2e_wall_s"] = time.perf_counter() - w0
                row["ff_steps"] = sum(r.engine.num_fast_forwarded_steps for r in res.replicas)
                results.setdefault(mode, []).append(row)
                del res
        for mode, rows in results.items():
            row, n = rows[0], rows[0]["requests"]
            loop = sorted(r["sim_wall_s"] for r in rows)
            e2e = min(r["e2e_wall_s"] for r in rows)
            print(f"{budget:>6} {mode:>8} {row['steps']:>7} {row['ff_steps']:>8} {row['mean_batch_size']:>6.1f} "
                  f"{loop[0]:>10.2f} {loop[len(loop) // 2]:>6.2f} {n / loop[0]:>10.0f} {e2e:>9.2f} {n / e2e:>9.0f}",
                  flush=True)
        if len(results) == 2:
            off, on = results["off"][0], results["on"][0]
            differ = [k for k in off if k not in ("sim_wall_s", "sim_requests_per_wall_s", "e2e_wall_s", "ff_steps")
                      and off[k] != on[k] and off[k] == off[k]]
            ratio = min(r["sim_wall_s"] for r in results["off"]) / min(r["sim_wall_s"] for r in results["on"])
            print(f"{'':>6} {'ratio':>8} {'':>7} {'':>8} {'':>6} {ratio:>9.1f}x "
                  + ("summaries identical" if not differ else f"SUMMARIES DIFFER in {differ}"))
    print(f"{n} requests, simulated {row['sim_time_s']:.0f} s of serving; goal >= 10,000 requests/s; "
          "Vidur: 2,048 requests in 32 s = 64 requests/s")


if __name__ == "__main__":
    main()
