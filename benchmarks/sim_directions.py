"""Published directions, reproduced by the simulator on the Azure conversation trace.

1. Orca / vLLM / Sarathi: iteration-level batching (continuous, chunked) serves far more load
   than request-level (static) batching under the same latency SLOs (capacity by bisection).
2. vLLM (PagedAttention): paged KV allocation keeps many more requests in flight than
   contiguous reservation of max_model_len per request (the paper: batches up to ~4x larger).
   Llama-2-7B (multi-head attention: 0.5 MiB of KV per token) on an A100 80GB with 30% of its
   memory for weights + KV (about 20k KV tokens, a memory-bound regime as in the paper), max_model_len
   4096, at a load that compute alone would serve.
3. Sarathi-Serve: under a strict time-between-tokens SLO, stall-free batching (`sarathi`: chunked
   prefill, decodes first, 512-token steps) sustains a higher rate than vLLM V0 (`vllm_v0`: prefill
   steps stall every running decode) and Orca (`orca`: whole prompts batched with the decodes,
   so a long prompt makes one long step for all of them). Capacity by bisection.

4. vLLM (PagedAttention, SOSP'23, Fig. 12: vLLM > Orca (Oracle) > Orca (Pow2) > Orca (Max)):
   the SLO capacity of paged allocation beats contiguous reservation of the true final length
   (oracle), which beats rounding to a power of two, which beats max_model_len, on a memory-bound
   setup (Llama-2-7B, A100 80GB, max_model_len 4096, continuous batching with an 8192-token budget).
5. DistServe (OSDI'24, Fig. 1 and 8): with tight TTFT and TPOT SLOs on a prefill-heavy trace (Azure
   code: ~2k-token prompts, short outputs), a prefill/decode split serves a higher rate than the
   same number of colocated GPUs (vLLM V0-style scheduling on both). Capacity by bisection.
6. KV-cache-aware routing (SGLang's cache-aware router, Mooncake's conductor): on the Mooncake
   conversation trace (shared prefixes by block hash ids), prefix_aware routing raises the prefix
   cache hit rate over round_robin and least_outstanding on 4 replicas, and near saturation cuts TTFT.

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
    p.add_argument("--only", type=int, choices=(1, 2, 3, 4, 5, 6), help="run one direction")
    p.add_argument("--tbt", type=float, default=0.1, help="direction 3's TBT SLO (s)")
    p.add_argument("--ttft", type=float, default=2.0, help="direction 3's TTFT SLO (s), met as well")
    p.add_argument("--pd-limit", type=int, default=600, help="direction 5's first N requests (Azure code)")
    p.add_argument("--route-rates", default="8,32", help="direction 6's offered loads (req/s, 4 replicas; "
                   "32 is near their saturation)")
    args = p.parse_args()
    wanted = {args.only} if args.only else {1, 2, 3, 4, 5, 6}
    if args.skip_capacity:
        wanted -= {1, 3, 4, 5}

    from sim.capacity import capacity_search
    from sim.run import CONF, simulate_config
    base = ["workload=azure_conv", f"workload.limit={args.limit}"]
    rows = []
    with initialize_config_dir(CONF, version_base="1.3"):
        for sched in ("static", "continuous", "chunked") if 1 in wanted else ():
            cfg = compose("sim", overrides=base + [f"scheduler={sched}", "capacity.rel_tol=0.1"])
            best, probes = capacity_search(cfg, {"scheduler": sched, "allocator": "paged"})
            rows.append({"scheduler": sched, "capacity (req/s)": best, "probes": len(probes)})
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

        rows = []
        slo = [f"slo.ttft_s={args.ttft}", "slo.tpot_s=null", f"slo.tbt_s={args.tbt}", "capacity.rel_tol=0.1"]
        for sched in ("vllm_v0", "orca", "sarathi") if 3 in wanted else ():
            cfg = compose("sim", overrides=base + [f"scheduler={sched}", *slo])
            best, probes = capacity_search(cfg, {"scheduler": sched, "allocator": "paged"})
            _, row = simulate_config(compose("sim", overrides=base + [f"scheduler={sched}", *slo,
                                                                      f"workload.rate={best or cfg.capacity.low}"]))
            rows.append({"scheduler": sched, "capacity (req/s)": best, "TBT p99 there (s)": row["tbt_p99"],
                         "TTFT p50 there (s)": row["ttft_p50"], "probes": len(probes)})
        if rows:
            tbt = pd.DataFrame(rows)
            tbt["sarathi vs this"] = tbt["capacity (req/s)"].iloc[-1] / tbt["capacity (req/s)"]
            print(f"\n3. capacity at SLO TTFT <= {args.ttft} s and TBT <= {args.tbt} s (no gap between two tokens "
                  f"over it) for "
                  f"{cfg.capacity.attainment:.0%} of requests (Llama-3-8B, H100, first {args.limit} requests; "
                  f"Sarathi-Serve, OSDI'24, Fig. 1 and 10: higher capacity under strict TBT SLOs):")
            print(tbt.to_string(index=False, float_format=lambda x: f"{x:.3g}"))

        for k, run in ((4, lambda: vllm_capacity(args, base, compose, capacity_search)),
                       (5, lambda: disaggregation(args, compose, capacity_search)),
                       (6, lambda: routing(args, compose, simulate_config))):
            if k in wanted:
                t0 = time.perf_counter()
                run()
                print(f"({time.perf_counter() - t0:.0f} s)")


def vllm_capacity(args, base, compose, capacity_search) -> None:
    rows = []
    setup = ["scheduler=continuous", "scheduler.max_num_batched_tokens=8192", "sim_model=llama2_7b",
             "hardware=a100_80gb_sxm", "engine.max_model_len=4096", "capacity.rel_tol=0.05", "capacity.high=16"]
    for name, alloc in (("paged", ["allocator=paged"]), ("contiguous (oracle)", ["allocator=contiguous",
                        "allocator.reservation=oracle"]), ("contiguous (pow2)", ["allocator=contiguous",
                        "allocator.reservation=pow2"]), ("contiguous (max)", ["allocator=contiguous",
                        "allocator.reservation=max"])):
        cfg = compose("sim", overrides=base + setup + alloc)
        best, probes = capacity_search(cfg, {"scheduler": "continuous", "allocator": name})
        rows.append({"allocator": name, "capacity (req/s)": best, "probes": len(probes)})
    cap = pd.DataFrame(rows)
    cap["vs contiguous (max)"] = cap["capacity (req/s)"] / cap["capacity (req/s)"].iloc[-1]
    print(f"\n4. capacity at SLO TTFT <= {cfg.slo.ttft_s} s, TPOT <= {cfg.slo.tpot_s} s for "
          f"{cfg.capacity.attainment:.0%} of requests (Llama-2-7B, A100 80GB, max_model_len 4096, continuous, "
          f"8192-token budget, first {args.limit} requests; vLLM, SOSP'23, Fig. 12: paged > oracle > pow2 > max):")
    print(cap.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


def disaggregation(args, compose, capacity_search) -> None:
    base = ["workload=azure_code", f"workload.limit={args.pd_limit}", "scheduler=vllm_v0",
            "sim_model=llama3_8b", "hardware=a100_80gb_sxm", "cluster.router=least_outstanding",
            "slo.ttft_s=1.0", "slo.tpot_s=0.04", "capacity.rel_tol=0.05", "capacity.high=16"]
    rows = []
    for gpus in (3, 4):
        for name, ov in ((f"colocated x{gpus}", [f"cluster.replicas={gpus}"]),
                         (f"{gpus - 1} prefill + 1 decode", ["cluster.mode=disaggregated",
                                                             f"cluster.prefill_replicas={gpus - 1}"])):
            cfg = compose("sim", overrides=base + ov)
            best, probes = capacity_search(cfg, {"scheduler": "vllm_v0", "allocator": "paged"})
            rows.append({"deployment": name, "GPUs": gpus, "goodput capacity (req/s)": best,
                         "per GPU": (best or 0.0) / gpus, "probes": len(probes)})
    t = pd.DataFrame(rows)
    t["vs colocated"] = t["goodput capacity (req/s)"] / t.groupby("GPUs")["goodput capacity (req/s)"].transform("first")
    print(f"\n5. capacity at SLO TTFT <= {cfg.slo.ttft_s} s, TPOT <= {cfg.slo.tpot_s} s for "
          f"{cfg.capacity.attainment:.0%} of requests (Llama-3-8B, A100 80GB, vllm_v0 scheduling, KV over NVLink, "
          f"Azure code, first {args.pd_limit} requests; DistServe, OSDI'24, Fig. 1 and 8: disaggregation "
          f"serves more under tight TTFT + TPOT SLOs):")
    print(t.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


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
    print(f"\n6. routing on the Mooncake conversation trace, 4 replicas (Llama-3-8B, "
          f"H100, chunked, paged with prefix caching, first {args.limit} requests; SGLang's cache-aware router, "
          f"Mooncake's conductor: routing by cached prefix raises the hit rate):")
    print(t.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main()
