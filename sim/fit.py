"""`python -m sim.fit RUN_DIR [-o fit.json]`: fit the `profiled` cost model to a real run's step log
(the `steps.csv` a `varlen.run` directory holds) and write the JSON `cost.model=profiled` reads.

    python -m varlen.run hydra.run.dir=runs/real
    python -m sim.fit runs/real -o fit.json
    python -m sim.run cost.model=profiled cost.path=fit.json sim_model=tiny hardware=cpu_2core

The fit (sim/cost/fitted.py: ProfiledCostModel.fit over profile_rows) charges each step the gap to
the next one unless the engine went idle, as a simulated step is charged; it prints R², the mean
and worst step error and the coefficients.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

# The columns a fit reads: per-request new and cached tokens (step_detail) and each step's timing.
NEEDED = ("start", "duration", "num_waiting", "new_tokens", "cached_tokens")


class FitInputError(ValueError):
    """Bad input, said in one line with the fix."""


def _ints(cell: Any) -> list[int]:
    return [int(x) for x in str(cell).split()] if cell == cell else []  # NaN (empty step) -> []


def read_steps(run_dir: Path) -> list[list[SimpleNamespace]]:
    """The step records of steps.csv, one list per replica (a sim.run directory may hold several)."""
    import pandas as pd

    path = run_dir / "steps.csv"
    if not run_dir.is_dir():
        raise FitInputError(f"{run_dir}: no such directory (give a varlen.run output directory)")
    if not path.is_file():
        raise FitInputError(f"{path}: not found (a varlen.run directory holds steps.csv; sim.run writes it "
                            "with output.steps=true)")
    table = pd.read_csv(path, dtype={"new_tokens": str, "cached_tokens": str, "req_ids": str})
    missing = [c for c in NEEDED if c not in table.columns]
    if missing:
        raise FitInputError(f"{path}: no column {', '.join(missing)} (the per-request columns: rerun with "
                            "output.step_detail=true)")
    groups = table.groupby("replica", sort=True) if "replica" in table.columns else [(0, table)]
    sampled = "num_sampled" in table.columns  # the LM head's rows, where the log has them
    out = []
    for _, t in groups:
        out.append([SimpleNamespace(start=float(r.start), duration=float(r.duration), num_waiting=int(r.num_waiting),
                                    new_tokens=_ints(r.new_tokens), cached_tokens=_ints(r.cached_tokens),
                                    num_sampled=int(r.num_sampled) if sampled and r.num_sampled == r.num_sampled else -1)
                    for r in t.sort_values("start").itertuples()])
    return out


def fit_run(run_dir: Path, features: Sequence[str] | None = None, weighting: str = "absolute") -> Any:
    """The ProfiledCostModel fitted to run_dir/steps.csv, its source named in `meta`."""
    from sim.cost.fitted import DEFAULT_FEATURES, ProfiledCostModel, check_features, profile_rows, size_feature

    features = list(features or DEFAULT_FEATURES)
    try:
        check_features(features)
    except ValueError as e:
        raise FitInputError(f"--features: {e}") from None
    rows = [row for steps in read_steps(run_dir) for row in profile_rows(steps)]
    by_rows = [f for f in features if f.startswith("chunk_sampled_")]
    if by_rows and any(row[3] is None for row in rows):
        raise FitInputError(f"--features {by_rows[0]}: {run_dir / 'steps.csv'} has no num_sampled column (the LM "
                            "head's rows per step); leave the chunk_sampled_K features out")
    n_linear = sum(1 for f in features if size_feature(f) is None)  # an offset needs its own min_size_steps
    if len(rows) <= n_linear:
        raise FitInputError(f"{run_dir / 'steps.csv'}: {len(rows)} steps, too few to fit {n_linear} "
                            f"coefficients (serve more or longer requests: more than {n_linear} steps)")
    model = ProfiledCostModel.fit(rows, features=features, weighting=weighting,
                                  long_query_min=long_query_min_of(run_dir))
    model.meta["fitted_on"] = str(run_dir.resolve() / "steps.csv")
    return model


def long_query_min_of(run_dir: Path) -> int:
    """The run's backend's long-prompt threshold (varlen.run's summary.json records it); 0, one path for
    every prompt chunk, for a run that did not record it."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text()).get("backend_long_query_min", 0))
    except (OSError, ValueError):
        return 0


def expand_features(spec: str) -> list[str]:
    """Comma-separated names; NAME_A..B stands for NAME_A, ..., NAME_B (decode_batch_1..8)."""
    out: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        head, dots, tail = item.partition("..")
        stem, _, lo = head.rpartition("_")
        if dots and stem and lo.isdigit() and tail.isdigit() and int(lo) <= int(tail):
            out += [f"{stem}_{k}" for k in range(int(lo), int(tail) + 1)]
        else:
            out.append(item)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from sim.cost.fitted import FEATURES, SIZE_FAMILIES

    ap = argparse.ArgumentParser(prog="python -m sim.fit",
                                 description="sim.fit: fit the profiled cost model to a varlen.run directory's "
                                             "steps.csv and write its JSON (cost.model=profiled cost.path=FILE).")
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a varlen.run output directory (holds steps.csv)")
    ap.add_argument("-o", "--out", type=Path, default=Path("fit.json"), help="the JSON written (default: fit.json)")
    ap.add_argument("--features", default=None,
                    help=f"comma-separated features (default: the model's default; known: {', '.join(FEATURES)}, "
                         f"{', '.join(p + 'K' for p in SIZE_FAMILIES)}; NAME_1..8 for sizes 1 to 8)")
    ap.add_argument("--weighting", choices=("absolute", "relative"), default="absolute",
                    help="absolute: plain least squares; relative: every step counts the same in percent")
    args = ap.parse_args(argv)
    try:
        model = fit_run(args.run_dir, expand_features(args.features) if args.features else None, args.weighting)
    except FitInputError as e:
        print(f"sim.fit: {e}", file=sys.stderr)
        return 2
    model.save(args.out)
    rep = model.report
    print(f"fitted on {rep.n_steps} steps of {args.run_dir / 'steps.csv'}: R2 {rep.r2:.3f}, "
          f"mean error {rep.mape:.1f}%, worst step {rep.max_ape:.1f}%")
    print(f"  prompt chunks of >= {model.long_query_min} new tokens priced as the backend's long path"
          if model.long_query_min else "  every prompt chunk priced on one path (the run recorded no long-prompt path)")
    for name, c in model.coefficients().items():
        print(f"  {name:<14} {c:.4g} s")
    print(f"wrote {args.out}: python -m sim.run cost.model=profiled cost.path={args.out} "
          "(set sim_model and hardware to the run's model and machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
