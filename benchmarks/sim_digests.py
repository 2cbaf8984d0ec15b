"""Digests of whole simulations: a sha256 of each run's CSVs and summary.json (less its wall-time
fields) for the default `python -m sim.run` and synthetic runs on 10 and 100 replicas under the
chunked, sarathi, vllm_v0 and continuous policies, with and without prefix caching, preemptions,
fast_forward=false and Mooncake, and fleets split into cells (cluster.cells). The oracle for a
change meant to leave every result as it was:

    python benchmarks/sim_digests.py /work/main > before.txt
    python benchmarks/sim_digests.py $PWD > after.txt && diff before.txt after.txt

ROOT: the checkout whose code runs (its own compiled core if built); names after it: only those cases.
"""
import hashlib, json, os, subprocess, sys, tempfile
from pathlib import Path
root = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1])
only = sys.argv[2:]
SYN = ["workload=synthetic", "workload.limit=3000", "cluster.router=least_outstanding", "output.steps=true"]
CASES = {
    "default": [],
    "default_steps": ["output.steps=true", "output.step_detail=true"],
    "syn10_chunked": SYN + ["cluster.replicas=10", "workload.rate=171.44"],
    "syn100_chunked": SYN + ["cluster.replicas=100", "workload.rate=1714.4"],
    "syn10_chunked_hot": SYN + ["cluster.replicas=10", "workload.rate=400", "engine.num_blocks=3000"],
    "syn10_vllm_v0": SYN + ["cluster.replicas=10", "workload.rate=150", "scheduler=vllm_v0"],
    "syn10_vllm_v0_hot": SYN + ["cluster.replicas=10", "workload.rate=400", "scheduler=vllm_v0", "engine.num_blocks=3000"],
    "syn10_sarathi": SYN + ["cluster.replicas=10", "workload.rate=171.44", "scheduler=sarathi"],
    "syn10_sarathi_hot": SYN + ["cluster.replicas=10", "workload.rate=400", "scheduler=sarathi", "engine.num_blocks=3000"],
    "syn10_continuous": SYN + ["cluster.replicas=10", "workload.rate=150", "scheduler=continuous"],
    "syn10_noprefix": SYN + ["cluster.replicas=10", "workload.rate=300", "allocator.enable_prefix_caching=false", "engine.num_blocks=3000"],
    "syn10_tokens_rr": SYN + ["cluster.replicas=10", "workload.rate=300", "workload.token_ids=true", "cluster.router=round_robin", "engine.num_blocks=4000"],
    "syn100_noff": SYN + ["cluster.replicas=100", "workload.rate=1714.4", "fast_forward=false", "workload.limit=1500"],
    "mooncake": ["workload=mooncake_conv", "workload.limit=1500", "cluster.replicas=4", "cluster.router=least_outstanding", "output.steps=true"],
    # cluster.cells: the merge of the cells' columns (with and without steps.csv), token-level output, disaggregated pools, a prefix front door
    "cells4_syn100": SYN + ["cluster.replicas=25", "cluster.cells=4", "workload.rate=1714.4"],
    "cells4_syn100_nosteps": SYN + ["cluster.replicas=25", "cluster.cells=4", "workload.rate=1714.4", "output.steps=false"],
    "cells3_tokens": SYN + ["cluster.replicas=4", "cluster.cells=3", "workload.rate=200", "engine.num_blocks=3000", "output.token_times=true", "workload.limit=1500"],
    "cells2_disagg": ["workload=synthetic", "workload.limit=1000", "workload.rate=60", "cluster.mode=disaggregated", "cluster.prefill_replicas=1", "cluster.decode_replicas=2", "cluster.cells=2"],
    "cells2_mooncake": ["workload=mooncake_conv", "workload.limit=1500", "cluster.replicas=2", "cluster.cells=2", "cluster.router=least_outstanding"],
}
for name, ov in CASES.items():
    if only and name not in only:
        continue
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, "-m", "sim.run", f"hydra.run.dir={tmp}", *ov], cwd=root,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
        if p.returncode:
            print(name, "FAILED", p.stderr.strip().splitlines()[-1:], flush=True)
            continue
        h = hashlib.sha256()
        parts = []
        for f in sorted(Path(tmp).glob("*.csv")):
            h.update(f.name.encode()); h.update(f.read_bytes()); parts.append(f.name)
        s = json.loads((Path(tmp) / "summary.json").read_text())
        s = {k: v for k, v in s.items() if "wall" not in k}
        h.update(json.dumps(s, sort_keys=True).encode())
        print(f"{name:22s} {h.hexdigest()[:16]} steps={s.get('steps')} pre={s.get('preemptions')} fin={s.get('finished')} {'+'.join(parts)}", flush=True)
