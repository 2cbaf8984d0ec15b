"""Which groups of the compiled core (varlen/compiled.py GROUPS) earn their place.

    python benchmarks/compiled_core.py [--repeats 2] [--workloads azure,synthetic] [--variants all,pure,-engine,...]

Each variant is built (`python -m varlen.compile` under VARLEN_CORE) and each workload runs as its
own `python -m sim.run` process under /usr/bin/time -v, repeat by repeat interleaved: `all`
compiles every group, `pure` none (VARLEN_PURE=1), `-G` every group but G (and those that NEED
it). The table shows the min over repeats of wall time, user+sys CPU time (the figure to judge
by on a shared machine), the event loop's own wall time and peak RSS, and the CPU time against
`all`. A group is kept when leaving it out costs >= 10% CPU on some workload. Every variant's
summary must match `all`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from varlen.compiled import GROUPS, NEEDS  # noqa: E402

WORKLOADS = {
    "azure": ["workload=azure_conv"],  # the whole Azure conversation trace, one replica
    "synthetic": ["workload=synthetic", "workload.limit=100000", "workload.rate=160",
                  "cluster.replicas=8", "cluster.router=least_outstanding"],
}
KEEP_AT = 0.10


def without(group: str) -> list[str]:
    """Every group but `group` and those needing it."""
    out = {group}
    while True:
        more = {g for g, needs in NEEDS.items() if out & set(needs)} - out
        if not more:
            return [g for g in GROUPS if g not in out]
        out |= more


def env_of(variant: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VARLEN_PURE": ""}
    if variant == "pure":
        env["VARLEN_PURE"] = "1"
    else:
        env["VARLEN_CORE"] = ",".join(GROUPS if variant == "all" else without(variant[1:]))
    return env


def timed(variant: str, workload: str, out: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "sim.run", *WORKLOADS[workload], "output.requests=false",
           f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, env=env_of(variant), capture_output=True, text=True, cwd=out.parent)
    if p.returncode != 0:
        raise SystemExit(f"{variant} {workload} failed:\n{p.stderr[-3000:]}")
    core = re.search(r"scheduling core: (.*)", p.stdout + p.stderr)
    if core is None or core.group(1).startswith("pure") != (variant == "pure"):
        raise SystemExit(f"{variant}: the run got core {core.group(1) if core else '?'}")

    def field(name: str) -> str:
        return re.search(rf"{re.escape(name)}: (.*)", p.stderr).group(1)  # type: ignore[union-attr]

    h, m, s = (["0"] + field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"))[-3:]
    summary = json.loads((out / "summary.json").read_text())
    return {"wall": int(h) * 3600 + int(m) * 60 + float(s),
            "cpu": float(field("User time (seconds)")) + float(field("System time (seconds)")),
            "rss_mb": int(field("Maximum resident set size (kbytes)")) / 1024,
            "loop": summary.get("sim_wall_s", float("nan")),
            "summary": {k: v for k, v in summary.items() if "wall" not in k and k != "overrides"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--variants", default=",".join(["all", "pure", *(f"-{g}" for g in GROUPS)]))
    args = p.parse_args()
    variants, workloads = args.variants.split(","), args.workloads.split(",")
    for v in variants:
        if v != "pure":
            print(f"building {v}: VARLEN_CORE={env_of(v)['VARLEN_CORE']}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "varlen.compile"], env=env_of(v), check=True,
                           stdout=subprocess.DEVNULL)
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="compiled-core-") as tmp:
        for r in range(args.repeats):
            for v in variants:
                for w in workloads:
                    row = timed(v, w, Path(tmp) / f"{v}-{w}-{r}")
                    print(f"  {v:>12} {w:>10} #{r}: wall {row['wall']:.2f} s, cpu {row['cpu']:.2f} s, "
                          f"loop {row['loop']:.2f} s, RSS {row['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
                    runs.setdefault((v, w), []).append(row)
    print(f"{'variant':>12} {'workload':>10} {'compiled groups':>40} {'wall s':>7} {'cpu s':>7} {'loop s':>7} "
          f"{'RSS MB':>7} {'cpu vs all':>10}")
    base = {w: min(r["cpu"] for r in runs[("all", w)]) for w in workloads if ("all", w) in runs}
    for (v, w), rows in runs.items():
        groups = "-" if v == "pure" else env_of(v)["VARLEN_CORE"]
        cpu = min(r["cpu"] for r in rows)
        ratio = f"{cpu / base[w]:.2f}x" if w in base else "-"
        print(f"{v:>12} {w:>10} {groups:>40} {min(r['wall'] for r in rows):>7.2f} {cpu:>7.2f} "
              f"{min(r['loop'] for r in rows):>7.2f} {max(r['rss_mb'] for r in rows):>7.0f} {ratio:>10}")
        if ("all", w) in runs and any(r["summary"] != runs[("all", w)][0]["summary"] for r in rows):
            print(f"{'':>12} summaries DIFFER from all's")
    for g in GROUPS:
        costs = [min(r["cpu"] for r in runs[(f"-{g}", w)]) / base[w] - 1 for w in workloads
                 if (f"-{g}", w) in runs and w in base]
        if costs:
            verdict = "keep" if max(costs) >= KEEP_AT else "leave interpreted"
            print(f"group {g}: leaving it out costs {', '.join(f'{c:+.0%}' for c in costs)} CPU -> {verdict}")


if __name__ == "__main__":
    main()
