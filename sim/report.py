"""`python -m sim.report <multirun dir> [...]`: gather a sweep into one table and draw it.

Reads each run's summary.json, requests.csv and kv_usage.csv; writes summary.csv and the plots
next to them (or to --out). Also sim.search's Pareto table and plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.ticker  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

COLUMNS = ["scheduler", "allocator", "rate", "requests", "finished", "requests_per_s", "output_tokens_per_s",
           "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "tbt_p99", "e2e_p50", "mean_batch_size", "peak_kv_usage",
           "mean_kv_usage", "preemptions", "goodput_requests_per_s", "slo_attainment", "tbt_attainment", "steps", "sim_wall_s"]

LABELS = {"max_tbt": "longest gap between tokens (s)"}  # CDF x axes; default "NAME (s)"


def gather(dirs: Sequence[str | Path]) -> pd.DataFrame:
    """One row per run (a folder holding summary.json), with the run's folder."""
    rows = []
    for d in dirs:
        if not Path(d).is_dir():
            raise ValueError(f"{d}: no such directory; give sim.run run or sweep directories")
        for f in sorted(Path(d).rglob("summary.json")):
            try:
                row = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{f}: not a readable summary ({' '.join(str(e).split())}); "
                                 "rerun that run or leave its directory out") from None
            missing = [k for k in ("scheduler", "allocator", "rate", "requests_per_s") if k not in row] \
                if isinstance(row, dict) else ["a JSON object"]
            if missing:
                raise ValueError(f"{f}: not a sim.run summary (no {', '.join(missing)}; a varlen.run directory?); "
                                 "sim.report reads sim.run runs and sweeps: compare any runs with python -m varlen.compare DIR...")
            row["run_dir"] = str(f.parent)
            rows.append(row)
    if not rows:
        capacity = any(f for d in dirs for f in Path(d).rglob("capacity.json"))
        raise ValueError(f"no summary.json under {', '.join(map(str, dirs))}; " +
                         ("a sim.capacity run or sweep: use python -m varlen.compare DIR..." if capacity
                          else "give sim.run run or sweep directories"))
    df = pd.DataFrame(rows)
    df["policy"] = df["scheduler"].astype(str) + "/" + df["allocator"].astype(str)
    # A sweep over cluster designs: each its own line (else the plots would join them into one).
    for col, label in (("mode", lambda r: "P/D" if r["mode"] == "disaggregated" else "colocated"),
                       ("router", lambda r: str(r["router"]))):
        if col in df.columns and df[col].nunique(dropna=False) > 1:
            df["policy"] = df["policy"] + " " + df.apply(label, axis=1)
    return df.sort_values(["policy", "rate"]).reset_index(drop=True)


def plot_latency_throughput(df: pd.DataFrame, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, g in df.groupby("policy"):
        for ax, (col, label) in zip(axes, [("ttft_p90", "p90 TTFT (s)"), ("e2e_p50", "p50 end-to-end latency (s)")]):
            ax.plot(g["requests_per_s"], g[col], "o-", label=policy)
            ax.set_xlabel("achieved throughput (requests/s)")
            ax.set_ylabel(label)
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("Latency vs throughput (one point per offered rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(df: pd.DataFrame, metric: str, path: Path) -> int:
    """One panel per offered rate, one line per policy; returns the runs drawn (those with a
    per-request table). With none, no file is written and a line says why."""
    runs = [Path(d) / "requests.csv" for d in df["run_dir"]]
    if not any(f.is_file() for f in runs):
        print(f"{path.name} not drawn: no run wrote its per-request table (requests.csv); "
              "run with output.requests=true", file=sys.stderr)
        return 0
    drawn = 0
    rates = sorted(df["rate"].unique())
    fig, axes = plt.subplots(1, len(rates), figsize=(3.6 * len(rates), 3.4), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates):
        for _, run in df[df["rate"] == rate].iterrows():
            f = Path(run["run_dir"]) / "requests.csv"
            if not f.is_file():
                continue
            cols = pd.read_csv(f, nrows=0).columns
            if metric not in cols:  # a run written before the column existed
                continue
            x = np.sort(pd.read_csv(f, usecols=[metric])[metric].dropna().to_numpy())
            if len(x):
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=run["policy"])
                drawn += 1
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap
        ax.set_title(f"{rate:.3g} req/s")
        ax.set_xlabel(LABELS.get(metric, f"{metric.upper()} (s)"))
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_kv(df: pd.DataFrame, path: Path) -> None:
    """KV usage over time at the highest offered rate, one line per policy (replica 0)."""
    top = df[df["rate"] == df["rate"].max()]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for _, run in top.iterrows():
        f = Path(run["run_dir"]) / "kv_usage.csv"
        if f.is_file():
            kv = pd.read_csv(f)
            kv = kv[kv["replica"] == 0]
            ax.plot(kv["time"], kv["kv_usage"], label=run["policy"], lw=0.8)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV slots reserved (fraction of pool)")
    ax.set_title(f"KV usage over time at {top['rate'].max():.3g} req/s")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(dirs: Sequence[str | Path], out: str | Path | None = None) -> pd.DataFrame:
    df = gather(dirs)
    out = Path(out or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "summary.csv", index=False)
    plot_latency_throughput(df, out / "latency_throughput.png")
    plot_cdfs(df, "ttft", out / "ttft_cdf.png")
    plot_cdfs(df, "tpot", out / "tpot_cdf.png")
    plot_cdfs(df, "max_tbt", out / "tbt_cdf.png")
    plot_kv(df, out / "kv_usage.png")
    return df



PARETO_COLUMNS = [("hardware", "hardware"), ("tensor", "TP"), ("pipeline", "PP"), ("scheduler", "policy"),
                  ("budget", "budget"), ("split", "P:D"), ("replica_capacity", "replica req/s"),
                  ("replicas", "replicas"), ("gpus", "GPUs"), ("cost_per_hour", "$/h"),
                  ("capacity", "capacity req/s"), ("verified", "verified")]


def pareto_table(front: Sequence[Any], chosen: Any) -> str:
    rows = []
    for p in front:
        r = p.row()
        rows.append({head: r[k] for k, head in PARETO_COLUMNS})
        rows[-1]["budget"] = "default" if p.budget is None else p.budget
        rows[-1]["P:D"] = p.split_text or "-"
        bound = ">=" if p.capacity_at_top else ""
        rows[-1]["replica req/s"] = f"{bound}{p.replica_capacity:.3g}"
        rows[-1]["capacity req/s"] = f"{bound}{p.capacity:.3g}"
        rows[-1]["$/h"] = f"{p.cost_per_hour:.2f}"
        rows[-1]["verified"] = {None: "-", True: "yes", False: "no"}[p.verified]
        rows[-1][""] = "<- chosen" if p is chosen else ""
    df = pd.DataFrame(rows)
    return df.to_string(index=False)


def plot_pareto(points: Sequence[Any], front: Sequence[Any], chosen: Any, target: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    ok = [p for p in points if p.replicas and p.status == "ok"]
    ax.scatter([p.cost_per_hour for p in ok], [p.capacity for p in ok], s=14, c="0.6", label="deployments")
    ax.step([p.cost_per_hour for p in front], [p.capacity for p in front], "o-", where="post", c="C0",
            label="Pareto set")
    same: dict[tuple[float, float], list[str]] = {}
    for p in front:
        same.setdefault((p.cost_per_hour, p.capacity), []).append(
            f"{'>=' if p.capacity_at_top else ''}{p.label()} {p.size_text()}")
    for xy, labels in same.items():
        ax.annotate("\n".join(labels), xy, fontsize=7, xytext=(4, -4), textcoords="offset points", va="top")
    if chosen is not None:
        ax.scatter([chosen.cost_per_hour], [chosen.capacity], marker="*", s=220, c="C3", zorder=5,
                   label="cheapest, checked at the target")
    ax.axhline(target, ls="--", c="C2", lw=1, label=f"target {target:g} req/s")
    ax.set_xlabel("cost (USD per hour, estimated GPU prices)")
    ax.set_ylabel("capacity within the SLOs (requests/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sim.report", description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", help="multirun directories (or single runs)")
    p.add_argument("--out", help="where to write the table and plots (default: the first directory)")
    a = p.parse_args(argv)
    try:
        df = report(a.dirs, a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    cols = ["policy"] + [c for c in COLUMNS if c in df.columns and c not in ("scheduler", "allocator")]
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(df[cols].to_string(index=False))
    print(f"table and plots written to {Path(a.out or a.dirs[0])}")


if __name__ == "__main__":
    main()
