"""Published directions, reproduced by the simulator on the Azure conversation trace.

1. Orca / vLLM / Sarathi: iteration-level batching (continuous, chunked) serves far more load
   than request-level (static) batching under the same latency SLOs (capacity by bisection).
2. vLLM (PagedAttention): paged KV allocation keeps many more requests in flight than
   contiguous reservation of max_model_len per request (the paper: batches up to ~4x larger).
   Llama-2-7B (multi-head attention: 0.5 MiB of KV per token) on an A100 80GB with 30% of its
   memory for weights + KV (about 20k KV tokens, a memory-bound regime as in the paper), max_model_len
   4096, at a load that compute alone would serve.
3. KV-cache-aware routing (SGLang's cache-aware router, Mooncake's conductor): on the Mooncake
   conversation trace (shared prefixes by block hash ids), prefix_aware routing raises the prefix
   cache hit rate over round_robin and least_outstanding on 4 replicas, and near saturation cuts TTFT.

The papers' own comparisons (vLLM vs Orca and FasterTransformer, Sarathi-Serve vs vLLM, DistServe's
prefill/decode split vs colocation), on their models, GPUs and criteria, are benchmarks/papers.py's.
Capacities here are sim.capacity's: every probe steady and meeting the SLOs, verified below.

    python benchmarks/sim_directions.py [--limit 1000] [--only 3]
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
from hydra import compose, initialize_config_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=1000, help="first N requests of the trace")
    p.add_argument("--kv-rate", type=float, default=4.0, help="offered load for the allocator comparison")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--only", type=int, choices=(1, 2, 3), help="run one direction")
    p.add_argument("--route-rates", default="8,32", help="direction 3's offered loads (req/s, 4 replicas; "
                   "32 is near their saturation)")
    args = p.parse_args()
    wanted = {args.only} if args.only else {1, 2, 3}
    if args.skip_capacity:
        wanted -= {1}

    from sim.capacity import bound_by, capacity_search
    from sim.run import CONF, simulate_config
    base = ["workload=azure_conv", f"workload.limit={args.limit}"]
    rows = []
    with initialize_config_dir(CONF, version_base="1.3"):
        for sched in ("static", "continuous", "chunked") if 1 in wanted else ():
            cfg = compose("sim", overrides=base + [f"scheduler={sched}", "capacity.rel_tol=0.1"])
            best, probes = capacity_search(cfg, {"scheduler": sched, "allocator": "paged"})
            rows.append({"scheduler": sched, "capacity (req/s)": best, "bound_by": bound_by(best, probes, cfg.capacity.high),
                         "probes": len(probes)})
        cap = pd.DataFrame(rows)
        if rows:
            cap["vs static"] = cap["capacity (req/s)"] / cap.loc[0, "capacity (req/s)"]
            print(f"\n1. capacity at SLO TTFT <= {cfg.slo.ttft_s} s, TPOT <= {cfg.slo.tpot_s} s for "
                  f"{cfg.capacity.attainment:.0%} of requests (Llama-3-8B, H100, first {args.limit} requests):")
            print(cap.to_string(index=False, float_format=lambda x: f"{x:.3g}"))

        rows = []
        for alloc, extra in () if 2 not in wanted else (("paged", []), ("contiguous", ["allocator.reservation=max"]),
                             ("contiguous", ["allocator.reservation=pow2"])):
            cfg = compose("sim", overrides=base + ["scheduler=continuous", f"allocator={alloc}", *extra,
                                                   "sim_model=llama2_7b", "hardware=a100_80gb_sxm",
                                                   "engine.max_model_len=4096", "engine.gpu_memory_utilization=0.3",
                                                   f"workload.rate={args.kv_rate}"])
            _, row = simulate_config(cfg)
            name = alloc + (f" ({extra[0].split('=')[1]})" if extra else "")
            rows.append({"allocator": name, "mean batch": row["mean_batch_size"],
                         "throughput (tok/s)": row["output_tokens_per_s"], "TTFT p50 (s)": row["ttft_p50"],
                         "mean KV reserved": row["mean_kv_usage"], "preemptions": row["preemptions"],
                         "KV slots": row["num_blocks"] * row["block_size"]})
        if rows:
            kv = pd.DataFrame(rows)
            kv["batch vs contiguous(max)"] = kv["mean batch"] / kv.loc[1, "mean batch"]
            print(f"\n2. KV allocation at {args.kv_rate} req/s (Llama-2-7B, A100 80GB at 30% memory, "
                  f"max_model_len 4096, continuous):")
            print(kv.to_string(index=False, float_format=lambda x: f"{x:.3g}"))

        for k, run in ((3, lambda: routing(args, compose, simulate_config)),):
            if k in wanted:
                t0 = time.perf_counter()
                run()
                print(f"({time.perf_counter() - t0:.0f} s)")


def routing(args, compose, simulate_config) -> None:
    rows = []
    for rate in (float(x) for x in args.route_rates.split(",")):
        for router in ("round_robin", "least_outstanding", "prefix_aware"):
            cfg = compose("sim", overrides=["workload=mooncake_conv", f"workload.limit={args.limit}",
                                            f"workload.rate={rate}", "cluster.replicas=4", f"cluster.router={router}"])
            _, row = simulate_config(cfg)
            rows.append({"rate (req/s)": rate, "router": router, "prefix hit rate": row["prefix_hit_rate"],
                         "TTFT p50 (s)": row["ttft_p50"], "TTFT p90 (s)": row["ttft_p90"],
                         "TTFT p99 (s)": row["ttft_p99"], "SLO attainment": row["slo_attainment"]})
    t = pd.DataFrame(rows)
    first = t.groupby("rate (req/s)")["prefix hit rate"].transform("first")
    t["hit rate vs round_robin"] = t["prefix hit rate"] / first
    print(f"\n3. routing on the Mooncake conversation trace, 4 replicas (Llama-3-8B, "
          f"H100, chunked, paged with prefix caching, first {args.limit} requests; SGLang's cache-aware router, "
          f"Mooncake's conductor: routing by cached prefix raises the hit rate):")
    print(t.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main()
