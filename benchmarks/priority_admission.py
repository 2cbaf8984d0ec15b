"""Scheduling overhead of the priority policy under overload: its ranked queues (O(log n) per
admission, schedulers/priority.py) against the straightforward policy that sorts both queues every
step (the reference, what it did before), with chunked (FCFS) as the floor, on a slice of the Azure
conversation trace at several times its rate (so thousands of requests wait), Llama-3-8B on an
H100 (roofline). Runs in this process's core (VARLEN_PURE=1 for pure Python; the compiled core
compiles the shipped policies only, so compare the reference under VARLEN_PURE=1).

    python benchmarks/priority_admission.py [--limit 4000] [--rate 30] [--repeats 3]

Priorities: `none` (all 0: the very schedule chunked makes) and `random` (0-3, seeded). All runs of
one setting must make the same decisions (token times compared); the table shows the fastest
simulation wall time of --repeats and ratios against chunked and against the reference.
"""

from __future__ import annotations

import argparse
import sys
import random
import time
from functools import partial
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script is in, not an installed one
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference policy the tests hold

from schedulers import ChunkedPolicy, PriorityPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from varlen.assembly import build_engine
from varlen.compiled import status
from varlen.kv import PagedAllocator
from varlen.sampling_params import SamplingParams
from varlen.settings import EngineSizes
from varlen.traces import load_trace
from varlen.workload import trace_requests
from test_scheduling_invariants import SortingPriority  # noqa: E402 (the same reference as the test)

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 8192


POLICIES = {"chunked": ChunkedPolicy, "priority (ranked)": PriorityPolicy, "priority (sorting ref)": SortingPriority}


def run(policy_cls, tr, priorities, cost):
    reqs = trace_requests(tr, 128256, SamplingParams(ignore_eos=True), token_ids=False)
    for r, p in zip(reqs, priorities):
        r.priority = p

    def make(clock):
        engine = build_engine(EngineSizes(27000, 16, MAX_LEN), policy_cls(max_num_seqs=256, max_num_batched_tokens=512),
                              partial(PagedAllocator, enable_prefix_caching=False),
                              lambda _p, _n: CostModelExecutor(cost, clock), engine_class=FastForwardEngine, clock=clock)
        return engine, engine.executor

    t0 = time.perf_counter()
    res = simulate(reqs, make)
    return time.perf_counter() - t0, res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=4000)
    p.add_argument("--rate", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    tr = load_trace("azure_conv", limit=args.limit, max_model_len=MAX_LEN, rate=args.rate)
    conf = yaml.safe_load((ROOT / "conf" / "sim_model" / "llama3_8b.yaml").read_text())
    cost = RooflineCostModel(conf["config"], "h100_sxm")
    rng = random.Random(0)
    settings = {"none": [0] * args.limit, "random": [rng.randrange(4) for _ in range(args.limit)]}
    print(f"core: {status()}")
    print(f"{'priorities':>10} {'policy':<24} {'steps':>7} {'max wait':>8} {'wall s min':>10} {'vs chunked':>10} "
          f"{'ref / this':>10} {'same decisions':>14}")
    for label, prios in settings.items():
        walls: dict[str, float] = {}
        results = {}
        for _ in range(args.repeats):
            for name, cls in POLICIES.items():
                wall, res = run(cls, tr, prios, cost)
                walls[name] = min(walls.get(name, float("inf")), wall)
                results[name] = res
        ref_times = [r.token_times for r in results["priority (sorting ref)"].requests]
        for name, res in results.items():
            same = [r.token_times for r in res.requests] == ref_times
            steps = res.replicas[0].engine.steps
            print(f"{label:>10} {name:<24} {len(steps):>7} {max(s.num_waiting for s in steps):>8} "
                  f"{walls[name]:>10.2f} {walls[name] / walls['chunked']:>9.2f}x "
                  f"{walls['priority (sorting ref)'] / walls[name]:>9.2f}x {str(same):>14}", flush=True)
    print(f"{args.limit} requests of the Azure conversation trace at {args.rate} req/s; best of {args.repeats}")


if __name__ == "__main__":
    main()
