"""`python -m varlen.compare DIR... [--baseline LABEL] [--metrics a,b] [--plot out.png]`: runs side by side.

Reads varlen.run, sim.run and sim.capacity run directories (capacity.mode=slo_scale's too) and
sweeps (a folder whose subfolders hold runs) and prints one table: a row per run, labelled by the overrides that differ between the
runs, the key metrics, and each metric's ratio to the baseline run (default: the first). Reads
files only: summary.json / capacity.json / slo_scale.json and .hydra/overrides.yaml of each run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import yaml

#: The metrics shown by default, by summary key; varlen.run has no SLO figures, a capacity run only
#: its capacity and bound_by, an SLO scale run its scale and bound_by (NaN elsewhere; the table says which).
METRICS = ["requests_per_s", "output_tokens_per_s", "goodput_requests_per_s", "slo_attainment",
           "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "capacity_requests_per_s", "slo_scale", "bound_by"]
RUN_FILES = ("summary.json", "capacity.json", "slo_scale.json")
#: A run's kind by the file it wrote (summary.json: by its content).
FILE_KINDS = {"capacity.json": "sim.capacity", "slo_scale.json": "sim.capacity/slo_scale"}
DIRS_HINT = "give varlen.run, sim.run or sim.capacity run or sweep directories"


class NotARun(ValueError):
    """A directory given holds no run; the message names it and what was expected."""


def kind_of(summary: dict[str, Any], file: str) -> str:
    if file in FILE_KINDS:
        return FILE_KINDS[file]
    return "sim.run" if "cost_model" in summary else "varlen.run"


def overrides_of(run_dir: Path) -> dict[str, str]:
    """The command line's overrides (key -> value) that made this run; {} when Hydra kept none."""
    f = run_dir / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(f.read_text()) if f.is_file() else None
    out = {}
    for o in items or []:
        key, _, value = str(o).partition("=")
        if not key.lstrip("+~").startswith("hydra."):
            out[key.lstrip("+~")] = value
    return out


def find_runs(d: str | Path) -> list[Path]:
    """The run directories in `d`: `d` itself, or its subfolders (a sweep), in name order."""
    d = Path(d)
    if not d.is_dir():
        raise NotARun(f"{d}: no such directory; {DIRS_HINT}")
    if any((d / f).is_file() for f in RUN_FILES):
        return [d]
    def order(p: Path) -> tuple[float, str]:  # a sweep's job folders are numbered: 0_..., 1_..., 10_...
        first = p.relative_to(d).parts[0].split("_", 1)[0]
        return (int(first) if first.isdigit() else math.inf, str(p))

    runs = sorted({f.parent for name in RUN_FILES for f in d.rglob(name)}, key=order)
    if not runs:
        raise NotARun(f"{d}: not a run (no summary.json, capacity.json or slo_scale.json in it or its "
                      f"subfolders); {DIRS_HINT}")
    return runs


def read_run(run_dir: Path) -> dict[str, Any]:
    file = next(f for f in RUN_FILES if (run_dir / f).is_file())
    try:
        row = json.loads((run_dir / file).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise NotARun(f"{run_dir / file}: not readable JSON ({' '.join(str(e).split())}); rerun that run "
                      "or leave its directory out") from None
    if not isinstance(row, dict):
        raise NotARun(f"{run_dir / file}: not a run's summary (a JSON object expected)")
    return {**row, "kind": kind_of(row, file), "run_dir": str(run_dir), "_overrides": overrides_of(run_dir)}


def labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Each run named by the overrides whose values differ between the runs (and its command when
    the kinds differ); runs the overrides do not tell apart also get their folder's name."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r["_overrides"] if k not in keys]
    differ = [k for k in keys if len({r["_overrides"].get(k) for r in runs}) > 1]
    kinds = len({r["kind"] for r in runs}) > 1
    out = []
    for r in runs:
        # A key this run left alone is its default: not shown, the others' labels tell them apart.
        parts = [f"{k}={r['_overrides'][k]}" for k in differ if k in r["_overrides"]]
        out.append(" ".join(([r["kind"]] if kinds else []) + (parts or (["(defaults)"] if differ else []))))
    if len(runs) == 1 and not out[0]:
        out[0] = Path(runs[0]["run_dir"]).name
    counts = pd.Series(out).value_counts()
    return [f"{lab} [{Path(r['run_dir']).name}]".strip() if counts[lab] > 1 else lab for lab, r in zip(out, runs)]


def gather(dirs: Sequence[str | Path]) -> pd.DataFrame:
    """One row per run: label, kind, every summary field, run_dir."""
    runs = [read_run(p) for d in dirs for p in find_runs(d)]
    names = labels(runs)
    rows = [{"label": n, **{k: v for k, v in r.items() if k != "_overrides"}} for n, r in zip(names, runs)]
    return pd.DataFrame(rows)


def table(df: pd.DataFrame, metrics: Sequence[str] = METRICS, baseline: str | None = None) -> pd.DataFrame:
    """label, kind, the metrics, and `METRIC/base` for each numeric one: the run's value over the
    baseline's (NaN where either is missing or the baseline's is 0)."""
    unknown = [m for m in metrics if m not in METRICS and m not in df.columns]
    if unknown:
        raise ValueError(f"--metrics {','.join(unknown)}: no run has it; choose from {','.join(METRICS)} "
                         "or any key of the runs' summary.json")
    if baseline is not None and baseline not in set(df["label"]):
        raise ValueError(f"--baseline {baseline!r} names no run; the labels are: " + "; ".join(df["label"]))
    base = df[df["label"] == baseline].iloc[0] if baseline is not None else df.iloc[0]
    out = df[["label", "kind"]].copy()
    for m in metrics:
        out[m] = df[m] if m in df.columns else math.nan
    for m in metrics:
        col = pd.to_numeric(out[m], errors="coerce")
        if m == "bound_by" or col.isna().all() and out[m].notna().any():
            continue  # text: no ratio
        out[m] = col  # a run's null (no SLO scale passes) is NaN, like a metric it lacks
        b = pd.to_numeric(pd.Series([base.get(m)]), errors="coerce").iloc[0]
        out[f"{m}/base"] = col / b if b and not math.isnan(b) else math.nan
    return out


def not_applicable(t: pd.DataFrame, metrics: Sequence[str]) -> list[str]:
    """One line per kind of run naming the metrics it does not have (NaN in the table)."""
    lines = []
    for kind, g in t.groupby("kind", sort=False):
        missing = [m for m in metrics if g[m].isna().all()]
        if missing:
            lines.append(f"{kind} runs: n/a (NaN) for {', '.join(missing)}")
    return lines


def not_measured(df: pd.DataFrame) -> list[str]:
    """One line per run whose figures rest partly on a cost model's predictions or estimates (the
    `cost_notes` sim.capacity records), so that a table does not pass them for measured."""
    if "cost_notes" not in df.columns:
        return []
    lines = []
    for _, r in df.iterrows():
        notes = r["cost_notes"]
        if isinstance(notes, list) and notes:
            lines.append(f"{r['label']}: cost {r.get('cost_model')}, not from measurements: {'; '.join(notes)}")
    return lines


def plot(t: pd.DataFrame, metrics: Sequence[str], path: str | Path) -> None:
    """One bar chart per numeric metric, four to a row; one colour per run, named in the legend
    (labels can be long: under the bars they would overlap)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    numeric = [m for m in metrics if pd.to_numeric(t[m], errors="coerce").notna().any()] or ["(no numeric metric)"]
    cols = min(len(numeric), 4)
    rows = -(-len(numeric) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows + 0.3 * len(t)), squeeze=False)
    colours = [f"C{i % 10}" for i in range(len(t))]
    for ax, m in zip(axes.flat, numeric):
        values = pd.to_numeric(t[m], errors="coerce") if m in t.columns else pd.Series([math.nan] * len(t))
        bars = ax.bar(range(len(t)), values.fillna(0), color=colours)
        ax.set_title(m, fontsize=9)
        ax.set_xticks(range(len(t)), [str(i) if not math.isnan(v) else f"{i}\nn/a" for i, v in enumerate(values)],
                      fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(numeric):]:
        ax.axis("off")
    fig.legend(bars, [textwrap.shorten(f"{i}: {lab}", 120) for i, lab in enumerate(t["label"])], loc="lower center",
               fontsize=7, ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0.3 * len(t) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(prog="python -m varlen.compare", description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", help="run or sweep directories of varlen.run, sim.run or sim.capacity "
                                           "(capacity.mode=slo_scale too)")
    p.add_argument("--baseline", help="the label of the run the ratios are against (default: the first run)")
    p.add_argument("--metrics", help=f"comma-separated summary keys (default: {','.join(METRICS)})")
    p.add_argument("--plot", help="write a bar chart of the metrics to this file (e.g. compare.png)")
    a = p.parse_args(argv)
    metrics = [m for m in (a.metrics or "").split(",") if m] or METRICS
    try:
        gathered = gather(a.dirs)
        t = table(gathered, metrics, a.baseline)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    with pd.option_context("display.width", 250, "display.max_columns", 60, "display.max_colwidth", 60,
                           "display.float_format", "{:.4g}".format):
        print(t.to_string(index=False))
    for line in not_applicable(t, metrics) + not_measured(gathered):
        print(line)
    print(f"ratios (METRIC/base) against: {a.baseline or t['label'].iloc[0]}")
    if a.plot:
        plot(t, metrics, a.plot)
        print(f"plot written to {a.plot}")
    return t


if __name__ == "__main__":
    main()
