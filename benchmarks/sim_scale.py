"""Simulator scale: wall time, requests/s and peak memory as the fleet grows (issue 26's grid).

    python benchmarks/sim_scale.py [--quick] [--time-limit 600] [--capacity R] [--points 10000x1,100000x100x4]

Synthetic requests (the default lengths) on `replicas` replicas of Llama-3-8B on an H100, chunked
policy, `least_outstanding` routing, arriving at 80% of the fleet's capacity: 0.8 x replicas x one
replica's sustainable rate at the default SLOs (found first by sim.capacity's bisection on 2,000
requests, or given with --capacity). The grid: requests {10k, 100k, 1M} x replicas {1, 10, 100},
plus 1,000 replicas at 1M, plus 1M on 100 replicas split into 4 cells (cluster.cells=4, 25 replicas
each, simulated one after another in the process: cells_on=local, or --cells-on ray); --quick runs 10k x {1, 10, 100} only. Each point is its own process
(peak memory is the process's own getrusage), stopped after --time-limit seconds. A point whose
estimated memory (sim/memory.py's per-request estimate plus the replicas' engines) exceeds the
memory available is skipped with the estimate, before it starts; one the child's own memory guard
refuses is shown as refused. --azure adds the whole Azure conversation trace as one command,
`python -m sim.run` from start to exit (goal: >= 10,000 requests/s of wall time).
Goal: 1M requests on 100 replicas in <= 60 s wall on one core and <= 2 GB peak; requests/s of wall
time at 1,000 replicas >= 0.5x that at 10 (equal load per replica).
    taskset -c 1 python benchmarks/sim_scale.py --azure      # the whole grid, one core
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# This checkout's packages, not an installed one's: run from a worktree, time that worktree's code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = ([(n, r, 1) for n in (10_000, 100_000, 1_000_000) for r in (1, 10, 100)]
        + [(1_000_000, 1000, 1), (1_000_000, 100, 4)])
QUICK = [(10_000, r, 1) for r in (1, 10, 100)]
LOAD = 0.8
VIDUR = "Vidur: 330-455 requests/s of wall time on this machine (issue 26, whole Azure conversation trace)"
# Resident bytes one replica's engine holds (the cost model is shared, the policy small; the KV
# allocator's per-block lists grow with the blocks used, not with the pool) for
# Llama-3-8B on an H100: fitted to the peak RSS of 10,000 requests on 10 and 1,000 replicas
# (87 and 224 MB; 0.96e6 while the lists were sized to the pool's 26,674 blocks); sim/memory.py's
# estimate covers the requests only.
BYTES_PER_REPLICA = 0.14e6
BASE_BYTES = 300e6  # the interpreter, its imports and the workload generator


def estimate_bytes(requests: int, replicas: int) -> float:
    """Peak memory a point is expected to need: its requests (sim/memory.py) and its replicas."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sim import memory
    from sim.run import CONF
    from varlen.workload import load_workload

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides(min(requests, memory.SAMPLE), replicas, 1.0))
    sample, _ = load_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    rows = sample.requests
    per = memory.estimate_bytes(1, sum(r.prompt_len for r in rows) / len(rows),
                                sum(r.output_len for r in rows) / len(rows), False)
    return BASE_BYTES + requests * per + replicas * BYTES_PER_REPLICA


def overrides(requests: int, replicas: int, rate: float, cells: int = 1, cells_on: str = "local") -> list[str]:
    """replicas: the whole fleet's; with cells > 1 each cell gets replicas / cells of them."""
    split = [f"cluster.cells={cells}", f"cluster.cells_on={cells_on}"] if cells > 1 else []
    return ["workload=synthetic", f"workload.limit={requests}", f"workload.rate={rate}",
            f"cluster.replicas={replicas // cells}", "cluster.router=least_outstanding", "output.requests=false", *split]


def child(args: argparse.Namespace) -> None:
    """One point in this process; prints its figures as JSON (exit 2 with one line if refused)."""
    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config
    from varlen.cli import SettingError
    from varlen.compiled import status

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides(args.requests, args.replicas, args.rate, args.cells, args.cells_on))
    try:
        _, row = simulate_config(cfg)
    except SettingError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"loop_s": row["sim_wall_s"], "finished": row["finished"], "requests": row["requests"],
                      "slo_attainment": row.get("slo_attainment"), "cpu_s": ru.ru_utime + ru.ru_stime,
                      "peak_mb": ru.ru_maxrss / 1024, "core": status()}), flush=True)
    os._exit(0)  # as sim.run leaves: freeing a fleet's engines one by one is no part of the point's time


def one_replica_capacity() -> float:
    """Requests/s one replica sustains at the default SLOs (sim.capacity's bisection, 2,000 requests)."""
    from hydra import compose, initialize_config_dir

    from sim.capacity import capacity_search
    from sim.run import CONF

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=[*overrides(2000, 1, 1.0), "capacity.rel_tol=0.02"])
    best, _ = capacity_search(cfg)
    if best is None:
        raise SystemExit("one replica meets the SLOs at no rate of the search range")
    return best


def run_point(requests: int, replicas: int, rate: float, limit_s: float, cells: int = 1,
              cells_on: str = "local") -> dict:
    from sim.memory import available_bytes

    need, have = estimate_bytes(requests, replicas), available_bytes()
    if have is not None and need > have:
        return {"status": f"skipped: needs an estimated {need / 1e9:.1f} GB, {have / 1e9:.1f} GB available"}
    cmd = [sys.executable, __file__, "--child", "--requests", str(requests), "--replicas", str(replicas),
           "--rate", repr(rate), "--cells", str(cells), "--cells-on", cells_on]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=os.environ)
    except subprocess.TimeoutExpired:
        return {"status": f"stopped after {limit_s:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode == 2:
        return {"status": "refused: " + proc.stderr.strip().splitlines()[-1]}
    if proc.returncode != 0:
        raise SystemExit(f"point {requests} x {replicas} failed:\n{proc.stderr[-3000:]}")
    return {"status": "ok", "wall_s": wall, **json.loads(proc.stdout.splitlines()[-1])}


def parse_point(text: str) -> tuple[int, int, int]:
    """'REQUESTSxREPLICAS[xCELLS]' -> (requests, replicas, cells); one line naming the fix if malformed."""
    parts = text.strip().split("x")
    try:
        n, r, c = (*(int(x) for x in parts), 1)[:3] if len(parts) in (2, 3) else (0, 0, 0)
    except ValueError:
        n = r = c = 0
    if min(n, r, c) < 1 or r % c:
        raise SystemExit(f"--points: {text!r} is not REQUESTSxREPLICAS[xCELLS] with positive integers and replicas a "
                         f"multiple of cells (e.g. 1000000x100x4)")
    return n, r, c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10k requests on 1, 10 and 100 replicas only")
    p.add_argument("--points", help="requests x replicas [x cells], comma-separated (e.g. 10000x1,1000000x100x4); "
                   "replicas count the whole fleet, split evenly over the cells")
    p.add_argument("--cells-on", choices=("local", "ray"), default="local",
                   help="where a point with cells simulates them (cluster.cells_on; default local: one after another)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per point before it is stopped")
    p.add_argument("--capacity", type=float, help="one replica's capacity in req/s (default: found by bisection, "
                   "~7 s); a given one is not checked")
    p.add_argument("--azure", action="store_true", help="also the whole Azure conversation trace, python -m sim.run "
                   "start to exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--cells", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    points = [parse_point(s) for s in args.points.split(",")] if args.points else QUICK if args.quick else GRID
    if args.azure:  # first: its child's peak is then the only one getrusage(RUSAGE_CHILDREN) has seen
        azure_row()
    cap = args.capacity if args.capacity else one_replica_capacity()
    src = "given with --capacity, not checked: a stale figure puts every point at another load" if args.capacity \
        else "sim.capacity's bisection on 2,000 requests"
    print(f"one replica of Llama-3-8B on H100 (chunked, default SLOs): {cap:.3g} req/s ({src}); "
          f"each point at {LOAD:.0%} of replicas x that")
    print(f"{'requests':>9} {'replicas':>8} {'cells':>5} {'rate':>8} {'wall s':>8} {'loop s':>8} {'CPU s':>7} "
          f"{'req/s':>8} {'loop req/s':>10} {'req/CPU s':>9} {'peak MB':>8} {'SLO att.':>8}  status", flush=True)
    cores: dict[str, int] = {}
    for requests, replicas, cells in points:
        rate = LOAD * replicas * cap
        r = run_point(requests, replicas, rate, args.time_limit, cells, args.cells_on)
        if "core" in r:
            cores[r["core"]] = cores.get(r["core"], 0) + 1
        if r["status"] != "ok":
            print(f"{requests:>9} {replicas:>8} {cells:>5} {rate:>8.4g}  {r['status']}", flush=True)
            continue
        att = r["slo_attainment"]
        print(f"{requests:>9} {replicas:>8} {cells:>5} {rate:>8.4g} {r['wall_s']:>8.2f} {r['loop_s']:>8.2f} {r['cpu_s']:>7.2f} "
              f"{requests / r['wall_s']:>8.0f} {requests / r['loop_s']:>10.0f} {requests / r['cpu_s']:>9.0f} "
              f"{r['peak_mb']:>8.0f} "
              f"{att if att is None else f'{att:.1%}':>8}  ok", flush=True)
    print(f"req/s: requests per second of the whole process's wall time (loop: of the event loop's; CPU s: the "
          f"process's user + system time, steadier on a shared machine); {VIDUR}")
    print(f"goal: 1,000,000 requests on 100 replicas in <= 60 s wall on one core, <= 2 GB peak; core: "
          f"{', '.join(cores) or 'none ran'}")
    if len(cores) > 1 or any(not c.startswith("compiled") for c in cores):
        # A build evicted from the cache mid-grid, or never built, times the pure-Python core (3-4x slower).
        print(f"WARNING: not every point ran the compiled core ({'; '.join(f'{c}: {n} points' for c, n in cores.items())}): "
              "run `python -m varlen.compile` and measure again", flush=True)


def azure_row() -> None:
    """`python -m sim.run` (the whole Azure conversation trace, Llama-3-8B on an H100) from start to exit."""
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="sim_scale_") as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "sim.run", f"hydra.run.dir={tmp}"],
                              cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"python -m sim.run failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
        n = json.loads((Path(tmp) / "summary.json").read_text())["requests"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"whole Azure conversation trace, python -m sim.run start to exit: {n:,} requests, {wall:.2f} s wall "
          f"({n / wall:,.0f} req/s), {cpu:.2f} s CPU ({n / cpu:,.0f} req/CPU s), peak {after.ru_maxrss / 1024:.0f} MB "
          f"; goal >= 10,000 req/s of wall time", flush=True)


if __name__ == "__main__":
    main()
