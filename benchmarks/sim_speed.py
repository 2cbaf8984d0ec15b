"""Simulator speed: requests simulated per second of wall time on the whole Azure conversation
trace (19,366 requests) with the chunked policy, Llama-3-8B on an H100 (roofline).

    python benchmarks/sim_speed.py [--rate 5.53] [--limit N] [--profile]

Reports wall and CPU time (the CPU is shared here, so CPU time is the steadier figure), steps,
request-steps (one request in one step) and the cost per step and per request-step.
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
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides)
    c0, w0 = time.process_time(), time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    res, row = simulate_config(cfg)
    if prof:
        prof.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    n = row["requests"]
    req_steps = sum(len(s.req_ids) for s in res.steps)
    print(f"{n} requests, {row['steps']} steps, {req_steps} request-steps, mean batch {row['mean_batch_size']:.1f}, "
          f"simulated {row['sim_time_s']:.0f} s of serving")
    print(f"event loop: {row['sim_wall_s']:.2f} s wall -> {row['sim_requests_per_wall_s']:.0f} requests/s, "
          f"{row['sim_wall_s'] / row['steps'] * 1e6:.1f} us/step, {row['sim_wall_s'] / req_steps * 1e6:.2f} us/request-step")
    print(f"end to end (trace load + simulation + metrics): {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"-> {n / wall:.0f} requests/s wall, {n / cpu:.0f} requests/s CPU")
    print(f"goal >= 10,000 requests/s; Vidur: 2,048 requests in 32 s = 64 requests/s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
