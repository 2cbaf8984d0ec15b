"""Simulator speed: requests simulated per second of wall time on the whole Azure conversation
trace (19,366 requests) with the chunked policy, Llama-3-8B on an H100 (roofline).

    python benchmarks/sim_speed.py [--rate 5.53] [--limit N] [--profile] [--only on|off]

Runs the trace twice, stepping one step at a time (fast_forward=false) and with the decode
fast-forward (the default), and prints one table: wall and CPU time (the CPU is shared here, so
CPU time is the steadier figure), steps, fast-forwarded steps, request-steps (one request in one
step), requests per second and the ratio between the modes; the two runs' summaries must agree.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from hydra import compose, initialize_config_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=None, help="target req/s (default: the trace's own, 5.53)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--scheduler", default="chunked")
    p.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    p.add_argument("--only", choices=("on", "off"), help="run one mode (fast_forward on or off)")
    args = p.parse_args()

    from sim.run import CONF, simulate_config
    from varlen.traces import default_traces_dir

    if not (default_traces_dir() / "AzureLLMInferenceTrace_conv.csv").is_file():
        raise SystemExit(f"needs the Azure conversation trace in {default_traces_dir()}")
    overrides = [f"scheduler={args.scheduler}", "sim_workload=azure_conv"]
    if args.rate:
        overrides.append(f"workload.rate={args.rate}")
    if args.limit:
        overrides.append(f"workload.limit={args.limit}")
    results = {}
    for mode in ("off", "on"):
        if args.only and args.only != mode:
            continue
        with initialize_config_dir(CONF, version_base="1.3"):
            cfg = compose("sim", overrides=[*overrides, f"fast_forward={mode == 'on'}"])
        c0, w0 = time.process_time(), time.perf_counter()
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        res, row = simulate_config(cfg)
        if prof:
            prof.disable()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        results[mode] = (res, row, cpu, wall)
        if prof:
            print(f"fast_forward={mode}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)

    res, row, _, _ = next(iter(results.values()))
    n = row["requests"]
    req_steps = sum(len(s.req_ids) for s in res.steps)
    print(f"{n} requests, {row['steps']} steps, {req_steps} request-steps, mean batch {row['mean_batch_size']:.1f}, "
          f"simulated {row['sim_time_s']:.0f} s of serving")
    print(f"{'fast_forward':>12} {'ff steps':>9} {'loop s':>8} {'loop req/s':>11} {'us/step':>8} "
          f"{'e2e wall s':>11} {'e2e CPU s':>10} {'e2e req/s':>10}")
    for mode, (res, row, cpu, wall) in results.items():
        ff = sum(r.engine.num_fast_forwarded_steps for r in res.replicas)
        print(f"{mode:>12} {ff:>9} {row['sim_wall_s']:>8.2f} {row['sim_requests_per_wall_s']:>11.0f} "
              f"{row['sim_wall_s'] / row['steps'] * 1e6:>8.1f} {wall:>11.2f} {cpu:>10.2f} {n / wall:>10.0f}")
    if len(results) == 2:
        (_, off, _, _), (_, on, _, _) = results["off"], results["on"]
        print(f"{'ratio':>12} {'':>9} {off['sim_wall_s'] / on['sim_wall_s']:>8.2f}x "
              f"(event loop; end to end {results['off'][3] / results['on'][3]:.2f}x wall, "
              f"{results['off'][2] / results['on'][2]:.2f}x CPU)")
        differ = [k for k in off if not k.startswith("sim_wall") and k != "sim_requests_per_wall_s"
                  and off[k] != on[k] and off[k] == off[k]]
        print("summaries identical" if not differ else f"SUMMARIES DIFFER in {differ}")
    print("goal >= 10,000 requests/s; Vidur: 2,048 requests in 32 s = 64 requests/s")

if __name__ == "__main__":
    main()
