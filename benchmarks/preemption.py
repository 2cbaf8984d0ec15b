"""Preemption under KV pressure: chunked prefill with vLLM V1's chunk admission (a first chunk that
fits is admitted, whatever the rest of the prompt needs) against varlen's chunked policy (a
chunked admission needs room for the whole rest: SchedulerPolicy._rest_fits), with continuous
batching (whole prompts) for reference, on a slice of the Azure conversation trace (Llama-3-8B on
an H100, roofline; prefix caching off, as for every Azure trace) with a KV pool far smaller than
the load needs.

    python benchmarks/preemption.py [--limit 1000] [--rate 20] [--blocks 300,600] [--plot out.png]

Columns: preemptions (all, and the most of one request), tokens computed beyond what each
request needs once (recomputed after preemptions, % of needed), output tokens/s of simulated
serving, TTFT p50/p90, and the wall time of the simulation.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script is in, not an installed one

from schedulers import ChunkedPolicy, ContinuousPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from varlen.assembly import build_engine
from varlen.kv import PagedAllocator
from varlen.sampling_params import SamplingParams
from varlen.settings import EngineSizes
from varlen.traces import load_trace
from varlen.workload import trace_requests

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 8192


class V1ChunkAdmission(ChunkedPolicy):
    """Chunked prefill admitting a request when its first chunk fits (vLLM V1's rule)."""

    repeats_decode_batches = True  # _rest_fits plays no part in a decode run

    def _rest_fits(self, kv, req, hit):
        return True


POLICIES = {"chunked, V1 chunk admission": (V1ChunkAdmission, 512), "chunked (varlen)": (ChunkedPolicy, 512),
            "continuous": (ContinuousPolicy, MAX_LEN)}


def run(policy_cls, budget: int, num_blocks: int, reqs, cost) -> tuple[dict, list[int]]:
    def make(clock):
        engine = build_engine(EngineSizes(num_blocks, 16, MAX_LEN),
                              policy_cls(max_num_seqs=256, max_num_batched_tokens=budget),
                              partial(PagedAllocator, enable_prefix_caching=False),
                              lambda _p, _n: CostModelExecutor(cost, clock), engine_class=FastForwardEngine, clock=clock)
        return engine, engine.executor

    t0 = time.perf_counter()
    res = simulate(reqs, make)
    wall = time.perf_counter() - t0
    need = sum(r.num_prompt_tokens + len(r.output_token_ids) - 1 for r in res.requests)
    done = sum(sum(s.new_tokens) for s in res.steps)
    ttft = np.array([r.token_times[0] - r.arrival for r in res.requests if r.token_times])
    pre = [r.num_preemptions for r in res.requests]
    out_tokens = sum(len(r.output_token_ids) for r in res.requests)
    span = max(r.finish_time for r in res.requests) - min(r.arrival for r in res.requests)
    return dict(preemptions=sum(pre), max_per_request=max(pre), recomputed=100 * (done - need) / need,
                tok_s=out_tokens / span, ttft50=float(np.median(ttft)), ttft90=float(np.percentile(ttft, 90)),
                wall=wall), pre


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="target arrival rate, req/s")
    p.add_argument("--blocks", default="300,600", help="KV pool sizes in 16-token blocks")
    p.add_argument("--plot", help="write preemptions per request (sorted) for each run to this PNG")
    args = p.parse_args()
    tr = load_trace("azure_conv", limit=args.limit, max_model_len=MAX_LEN, rate=args.rate)
    conf = yaml.safe_load((ROOT / "conf" / "sim_model" / "llama3_8b.yaml").read_text())
    cost = RooflineCostModel(conf["config"], "h100_sxm")
    print(f"{'blocks':>6} {'policy':<28} {'preempt':>7} {'max/req':>7} {'recomp %':>8} {'tok/s':>6} "
          f"{'ttft p50':>8} {'ttft p90':>8} {'wall s':>6} {'recomp vs V1':>12}")
    curves = {}
    for blocks in map(int, args.blocks.split(",")):
        base = None
        for name, (cls, budget) in POLICIES.items():
            reqs = trace_requests(tr, 128256, SamplingParams(ignore_eos=True), token_ids=False)
            row, pre = run(cls, budget, blocks, reqs, cost)
            base = base or row
            curves[(blocks, name)] = sorted(pre, reverse=True)
            ratio = row["recomputed"] / base["recomputed"] if base["recomputed"] else float("nan")
            print(f"{blocks:>6} {name:<28} {row['preemptions']:>7} {row['max_per_request']:>7} "
                  f"{row['recomputed']:>8.1f} {row['tok_s']:>6.0f} {row['ttft50']:>8.1f} {row['ttft90']:>8.1f} "
                  f"{row['wall']:>6.2f} {ratio:>11.3f}x", flush=True)
    print(f"{args.limit} requests of the Azure conversation trace at {args.rate} req/s, Llama-3-8B on an H100 "
          "(roofline), 256 seats; budget 512 (chunked) or whole prompts (continuous)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (blocks, name), ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, label=f"{name}, {blocks} blocks")
        ax.set(xscale="log", xlabel="requests, most preempted first", ylabel="preemptions of the request",
               title="Preemptions per request under KV pressure")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
