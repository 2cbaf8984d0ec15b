"""Fidelity of the `profiled` cost model: fit it on one real run, predict another.

Real runs: the engine on CPU (1 torch thread) with a small locally generated Qwen3 (big enough
that step time is mostly arithmetic, not Python noise), serving Azure conversation requests
with their arrivals. Run A (requests 0-39 at rate_a) is profiled; the fitted model then
simulates run B (requests 40-79 at rate_b) and the simulator's TTFT, TPOT and throughput are
compared with what the real engine measured on B.

    python benchmarks/sim_fidelity.py [--rate-a 1.5] [--rate-b 2.5] [--n 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from functools import partial

import numpy as np
import pandas as pd


def slice_trace(trace, lo: int, hi: int, rate: float):
    """Requests [lo, hi) of a trace, arrivals re-zeroed and scaled to `rate` req/s."""
    part = trace.requests[lo:hi]
    t0 = part[0].arrival_s
    span = part[-1].arrival_s - t0
    scale = (len(part) - 1) / span / rate
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in part]


def real_run(model_dir: str, backend: str, treqs, args):
    from schedulers import ChunkedPolicy
    from varlen import LLM
    from varlen.kv import PagedAllocator
    from varlen.sampling_params import SamplingParams
    from varlen.traces import Trace, TraceStats
    from varlen.workload import trace_requests

    make_policy = partial(ChunkedPolicy, max_num_seqs=args.seqs, max_num_batched_tokens=args.budget)
    llm = LLM(model_dir, backend=backend, scheduler=make_policy(), allocator="paged", block_size=16,
              num_blocks=args.blocks, max_model_len=args.max_len)
    reqs = trace_requests(Trace(list(treqs), TraceStats("slice", "azure")), llm.runner.config.vocab_size,
                          SamplingParams(ignore_eos=True, temperature=0.0), token_ids=False)
    from sim.validate import fresh_copies

    originals = fresh_copies(reqs)
    from varlen.clock import WallClock

    llm.engine.clock = WallClock()  # arrivals count from now, not from the model load
    t = time.perf_counter()
    llm.engine.run(reqs)
    kv = llm.engine.kv
    make_kv = partial(PagedAllocator, kv.num_blocks, kv.block_size, kv.max_model_len)
    return llm.engine, reqs, originals, make_policy, make_kv, time.perf_counter() - t


def headline(reqs, steps, slots) -> dict[str, float]:
    from varlen.metrics import summarize

    s = summarize(reqs, steps, slots)
    return {"TTFT p50 (ms)": s["ttft_p50"] * 1e3, "TTFT p90 (ms)": s["ttft_p90"] * 1e3,
            "TPOT p50 (ms)": s["tpot_p50"] * 1e3, "TPOT p90 (ms)": s["tpot_p90"] * 1e3,
            "e2e p50 (s)": s["e2e_p50"], "throughput (tok/s)": s["output_tokens_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--rate-a", type=float, default=1.5)
    p.add_argument("--rate-b", type=float, default=2.5)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--backend", default=None, help="default: torch_sdpa if present, else torch_ref")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from backends import BACKENDS  # noqa: F401  (only to list what exists)
    from sim.cost_models import ProfiledCostModel, profile_rows
    from sim.validate import simulate_like
    from varlen import LLM
    from varlen.tiny_model import write_tiny_model
    from varlen.traces import default_traces_dir, load_trace

    backend = args.backend or ("torch_sdpa" if "torch_sdpa" in BACKENDS else "torch_ref")
    if not (default_traces_dir() / "AzureLLMInferenceTrace_conv.csv").is_file():
        raise SystemExit(f"needs the Azure conversation trace in {default_traces_dir()}")
    trace = load_trace("azure_conv", limit=2 * args.n, max_model_len=args.max_len, over_length="clip")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(os.path.join(tmp, "m"), "qwen3", hidden_size=256, intermediate_size=768,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=32))
        LLM(model_dir, backend=backend).generate([[5] * 300, [7] * 20], None)  # warm the kernels up
        print(f"model: qwen3 hidden 256 x 4 layers, backend {backend}, chunked budget {args.budget}, "
              f"{args.seqs} seats, 1 torch thread")
        eng_a, reqs_a, _, _, _, wall_a = real_run(model_dir, backend, slice_trace(trace, 0, args.n, args.rate_a), args)
        rows = profile_rows(eng_a.steps)
        features = ("const", "new_tokens", "num_seqs", "attn_work", "cached_tokens", "logit_rows")
        cost = ProfiledCostModel.fit(rows, features=features)
        print(f"run A: {args.n} requests at {args.rate_a} req/s, {len(eng_a.steps)} steps, {wall_a:.1f} s; fit "
              f"R2 {cost.report.r2:.3f}, step MAPE {cost.report.mape:.1f}%\n  coefficients: "
              + ", ".join(f"{k} {v:.3g}" for k, v in cost.coefficients().items()))
        eng_b, reqs_b, originals_b, make_policy, make_kv, wall_b = real_run(
            model_dir, backend, slice_trace(trace, args.n, 2 * args.n, args.rate_b), args)
        print(f"run B: {args.n} other requests at {args.rate_b} req/s, {len(eng_b.steps)} steps, {wall_b:.1f} s; "
              f"model on B's steps: MAPE {cost.score(profile_rows(eng_b.steps)).mape:.1f}%")
    sim = simulate_like(originals_b, make_policy, make_kv, eng_b.max_model_len, cost)
    real = headline(reqs_b, eng_b.steps, eng_b.kv.capacity_tokens)
    pred = headline(sim.requests, sim.steps, sim.total_slots)
    df = pd.DataFrame({"real": real, "sim": pred})
    df["error %"] = (df["sim"] - df["real"]) / df["real"] * 100
    df.loc["steps"] = [len(eng_b.steps), sim.num_steps, (sim.num_steps - len(eng_b.steps)) / len(eng_b.steps) * 100]
    print("\nrun B, real vs simulated (profiled on run A):")
    print(df.to_string(float_format=lambda x: f"{x:.2f}"))
    worst = df.loc[["TTFT p50 (ms)", "TTFT p90 (ms)", "TPOT p50 (ms)", "throughput (tok/s)"], "error %"].abs().max()
    print(f"\nworst error over TTFT p50/p90, TPOT p50, throughput: {worst:.1f}% (goal <= 5%)")


if __name__ == "__main__":
    main()
