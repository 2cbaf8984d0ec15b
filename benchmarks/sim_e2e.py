"""Simulator end to end: `python -m sim.run` on the whole Azure conversation trace (19,366
requests, the command's defaults) timed as a process from start to exit, next to the event
loop's own figure (summary.json's sim_wall_s) and the floor any command pays (an interpreter
that imports nothing, and one that imports sim.run), all measured in the same run.

    python benchmarks/sim_e2e.py [--repeats 5] [--compare DIR] [-- OVERRIDE ...]
    taskset -c 1 python benchmarks/sim_e2e.py        # one core: less noise from other work

--compare DIR runs the same command in another checkout (e.g. `git archive <rev> | tar -x -C
DIR`), interleaved repeat by repeat with this one (this VM's speed drifts), and prints the
ratio of the best times. Every run's summary must equal the first's (wall-time fields aside).
CPU s is the child's user + system time: on a loaded machine it moves far less than wall time.
Build the compiled core first (`python -m varlen.compile`); the table says which core ran.

A trace file's first load parses it and keeps it decoded in a cache (varlen/traces/cache.py,
VARLEN_TRACE_CACHE); later runs read that. The row "first run (trace not cached)" is this
checkout's run with an empty trace cache each time: what a run costs the first time it meets a
trace (the pandas import and parse, ~0.2 s), once per trace file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 10_000  # requests per second of wall time, process start to exit
WALL_KEYS = ("sim_wall_s", "sim_requests_per_wall_s", "overrides")


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, child CPU s, stdout) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(cwd)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {cwd}) failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each command (best and median shown)")
    p.add_argument("--compare", type=Path, default=None, help="another checkout to run the same command in")
    p.add_argument("overrides", nargs="*", help="sim.run overrides (after --)")
    args = p.parse_args()

    from varlen.traces import default_traces_dir

    py = sys.executable
    env = {**os.environ, "VARLEN_TRACES_DIR": str(default_traces_dir())}  # the same trace for every checkout
    checkouts = {"this": ROOT} | ({"compare": args.compare.resolve()} if args.compare else {})
    rows: dict[str, dict[str, list]] = {}
    ref: dict | None = None
    with tempfile.TemporaryDirectory(prefix="sim_e2e_") as tmp:
        # Every checkout's bytecode cached alike (PYTHONDONTWRITEBYTECODE would leave one compiling its
        # sources on every run), written by one short warm-up run each before any is timed.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tmp) / "pycache"))
        for name, cwd in checkouts.items():
            timed([py, "-m", "sim.run", f"hydra.run.dir={Path(tmp) / ('warm-' + name)}", "workload.limit=20",
                   *args.overrides], cwd, env)
        for rep in range(args.repeats):
            for name, cwd in checkouts.items():
                for what, cmd in (("python -c pass", [py, "-c", "pass"]),
                                  ("import sim.run", [py, "-c", "import sim.run"])):
                    wall, cpu, _ = timed(cmd, cwd, env)
                    r = rows.setdefault(f"{name}: {what}", {"wall": [], "cpu": [], "loop": [], "n": []})
                    r["wall"].append(wall)
                    r["cpu"].append(cpu)
                out = Path(tmp) / f"{name}-{rep}"
                wall, cpu, stdout = timed([py, "-m", "sim.run", f"hydra.run.dir={out}", *args.overrides], cwd, env)
                summary = json.loads((out / "summary.json").read_text())
                r = rows.setdefault(f"{name}: python -m sim.run", {"wall": [], "cpu": [], "loop": [], "n": [], "core": ""})
                r["wall"].append(wall)
                r["cpu"].append(cpu)
                r["loop"].append(summary["sim_wall_s"])
                r["n"].append(summary["requests"])
                r["core"] = next((ln.split(":", 1)[1].split("(")[0].strip() for ln in stdout.splitlines()
                                  if ln.startswith("scheduling core:")), "?")
                body = {k: v for k, v in summary.items() if k not in WALL_KEYS}
                if ref is None:
                    ref = body
                elif body != ref:
                    differ = sorted(k for k in set(ref) | set(body) if ref.get(k) != body.get(k))
                    raise SystemExit(f"{name} run {rep}: summary differs from the first run's in {differ}")
                if name == "this":  # the same run, its trace not in the cache yet
                    cold_env = {**env, "VARLEN_TRACE_CACHE": str(Path(tmp) / f"trace-cache-{rep}")}
                    out = Path(tmp) / f"{name}-cold-{rep}"
                    wall, cpu, _ = timed([py, "-m", "sim.run", f"hydra.run.dir={out}", *args.overrides], cwd, cold_env)
                    r = rows.setdefault(f"{name}: first run (trace not cached)", {"wall": [], "cpu": [], "loop": [], "n": []})
                    r["wall"].append(wall)
                    r["cpu"].append(cpu)
                    body = {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k not in WALL_KEYS}
                    if body != ref:
                        raise SystemExit(f"run {rep} with the trace not cached: summary differs from the first run's")

    print(f"{'command':<42} {'core':>8} {'wall s min':>10} {'median':>7} {'CPU s min':>9} {'median':>7} "
          f"{'req/s (wall)':>12} {'loop s min':>10} {'loop req/s':>10}")
    for label, r in rows.items():
        wall, cpu = sorted(r["wall"]), sorted(r["cpu"])
        line = (f"{label:<42} {r.get('core', '-'):>8} {wall[0]:>10.2f} {statistics.median(wall):>7.2f} {cpu[0]:>9.2f}"
                f" {statistics.median(cpu):>7.2f}")
        if r["n"]:
            n, loop = r["n"][0], min(r["loop"])
            line += f" {n / wall[0]:>12,.0f} {loop:>10.2f} {n / loop:>10,.0f}"
        print(line)
    if args.compare:
        cores = {rows[f"{k}: python -m sim.run"]["core"] for k in ("compare", "this")}
        if len(cores) > 1:
            print(f"the two checkouts ran different cores ({', '.join(sorted(cores))}): build both with "
                  "`python -m varlen.compile` in each for a fair ratio")
        a, b = (min(rows[f"{k}: python -m sim.run"]["wall"]) for k in ("compare", "this"))
        ca, cb = (min(rows[f"{k}: python -m sim.run"]["cpu"]) for k in ("compare", "this"))
        print(f"this checkout vs {args.compare}: {a / b:.2f}x faster end to end (best wall), {ca / cb:.2f}x (best CPU)")
    n = next(r["n"][0] for r in rows.values() if r["n"])
    print(f"{n} requests; goal >= {GOAL:,} requests/s of wall time from start to exit (<= {n / GOAL:.2f} s); "
          f"all {sum(len(r['n']) + ('not cached' in k) * len(r['wall']) for k, r in rows.items())} summaries identical; affinity: CPUs {sorted(os.sched_getaffinity(0))}")


if __name__ == "__main__":
    main()
