"""`python -m varlen.check KIND=NAME [KIND.key=value ...] [--examples N]`: run every correctness
property of a plug-in's kind on that plug-in alone, found by name in its group (conf/<kind>/ and the
folders of VARLEN_CONFIG_PATH) or given as a dotted class path.

    python -m varlen.check scheduler=mine              # a policy
    python -m varlen.check allocator=mine              # a KV allocator
    python -m varlen.check backend=fancy               # an attention backend (CPU, float32)
    python -m varlen.check cost=profiled cost.path=fit.json
    python -m varlen.check router=mine

Each property is a hypothesis test (varlen/testing/); a failure prints hypothesis' smallest
counterexample. Exit 0 when all pass, 1 on any failure, 2 on bad input. Performance figures
(fast-forward coverage, step overhead) are printed as information, never failures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

from varlen import check_properties as cp
from varlen.check_properties import NotApplicable, Property, Subject, hypothesis_settings

KINDS = ("scheduler", "allocator", "backend", "cost", "router")


class CheckInputError(ValueError):
    """Bad input, said in one line with the fix."""


@dataclass
class Outcome:
    prop: str
    ok: bool
    seconds: float
    error: str = ""
    counterexample: list[str] = field(default_factory=list)
    applies: bool = True


def run_property(subject: Subject, prop: Property) -> Outcome:
    """Run one property; on failure keep the exception's line and hypothesis' falsifying example."""
    from hypothesis.reporting import with_reporter

    lines: list[str] = []
    t = time.perf_counter()
    try:
        with with_reporter(lambda s: lines.append(str(s))), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prop.run(subject, hypothesis_settings(subject.n(prop.examples)))
    except NotApplicable as e:
        return Outcome(prop.name, True, time.perf_counter() - t, str(e), applies=False)
    except Exception as caught:  # noqa: BLE001 (a property's failure, whatever its kind, is its result)
        err: BaseException = caught
        if isinstance(err, BaseExceptionGroup) and err.exceptions:  # several distinct failures: the first
            err = err.exceptions[0]
        notes = [ln for n in getattr(err, "__notes__", []) for ln in str(n).splitlines()]
        example = [ln for ln in (*lines, *notes) if ln.strip() and "Trying example" not in ln]
        msg = " ".join(str(err).split())
        frame = traceback.extract_tb(err.__traceback__)[-1]
        if not isinstance(err, AssertionError):
            msg = f"{type(err).__name__}: {msg} (at {frame.filename}:{frame.lineno})"
        elif not msg:  # a bare assert: its line says what broke
            msg = f"{frame.line} (at {frame.filename}:{frame.lineno})"
        return Outcome(prop.name, False, time.perf_counter() - t, msg, list(dict.fromkeys(example)))
    return Outcome(prop.name, True, time.perf_counter() - t)


def parse(argv: Sequence[str] | None) -> tuple[Subject, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        prog="python -m varlen.check",
        description="varlen.check: run every correctness property of a plug-in's kind on it (exit 1 if one fails).")
    ap.add_argument("plugin", metavar="KIND=NAME", help=f"the plug-in: {', '.join(k + '=NAME' for k in KINDS)} "
                                                        "(a name of its conf group, or a class's dotted path)")
    ap.add_argument("overrides", nargs="*", metavar="KIND.key=value", help="settings over the plug-in's yaml, "
                                                                           "e.g. scheduler.max_chunk=4, cost.path=fit.json")
    ap.add_argument("--examples", type=int, default=None, metavar="N",
                    help="hypothesis examples per property (default: each property's own, ~3 min in all)")
    ap.add_argument("--no-shrink", action="store_true",
                    help="report a failure's first example as found, not shrunk to the smallest (faster)")
    ap.add_argument("--derandomize", action="store_true",
                    help="draw the same examples on every run (default: new ones each run, finding more over time)")
    ap.add_argument("--sim-model", default="tiny", help="cost=: the model shape timed (conf/sim_model/, default tiny)")
    ap.add_argument("--hardware", default="cpu_2core", help="cost=: the hardware timed (conf/hardware/, default cpu_2core)")
    args = ap.parse_args(argv)
    kind, eq, name = args.plugin.partition("=")
    if not eq or kind not in KINDS or not name:
        raise CheckInputError(f"{args.plugin!r}: give KIND=NAME with KIND one of {', '.join(KINDS)} "
                              "(e.g. scheduler=chunked)")
    options: dict[str, Any] = {}
    for o in args.overrides:
        key, eq, value = o.partition("=")
        prefix, dot, setting = key.partition(".")
        if not eq or prefix != kind or not dot or not setting:
            raise CheckInputError(f"{o!r}: give settings of the plug-in as {kind}.key=value")
        options[setting] = yaml.safe_load(value)
    if args.examples is not None and args.examples < 1:
        raise CheckInputError(f"--examples {args.examples}: give at least 1")
    cp.SHRINK, cp.DERANDOMIZE = not args.no_shrink, args.derandomize
    return Subject(kind, name, options, args.examples, args.sim_model, args.hardware), args


def resolve(subject: Subject) -> None:
    """Fail early, in one line, when the plug-in cannot be found or built."""
    from varlen import registry

    try:
        registry.target(subject.kind, subject.name)
    except ValueError as e:
        raise CheckInputError(" ".join(str(e).split())) from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        import hypothesis  # noqa: F401  (the `test` extra)
    except ImportError:
        print('varlen.check needs hypothesis: pip install "varlen[test]"', file=sys.stderr)
        return 2
    try:
        subject, _ = parse(argv)
        resolve(subject)
        props = cp.PROPERTIES[subject.kind]
        cp.prepare(subject)
    except (CheckInputError, ValueError) as e:
        print(f"varlen.check: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"varlen.check {subject.kind}={subject.name}: {len(props)} properties"
          + (f", {subject.examples} examples each" if subject.examples else ""), flush=True)
    outcomes = []
    for prop in props:
        out = run_property(subject, prop)
        outcomes.append(out)
        verdict = "n/a " if not out.applies else "PASS" if out.ok else "FAIL"
        print(f"  {verdict}  {out.prop:<62} {out.seconds:6.1f} s", flush=True)
        if not out.applies:
            print(f"        {out.error}")
        if not out.ok:
            print(f"        {out.error[:600]}")
            for line in out.counterexample[:40]:
                print(f"        | {line}")
    failed = [o for o in outcomes if not o.ok]
    skipped = sum(not o.applies for o in outcomes)
    for line in cp.information(subject):
        print(f"  info  {line}")
    print(f"{len(outcomes) - len(failed) - skipped} passed, " + (f"{skipped} n/a, " if skipped else "")
          + f"{len(failed)} failed"
          + (f": {', '.join(o.prop for o in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Triton's bindings (imported by torch's native ops during the
    # properties) print hundreds of "nanobind: leaked ..." lines when torn down, after the verdict.
    os._exit(code)
