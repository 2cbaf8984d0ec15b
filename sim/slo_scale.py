"""`python -m sim.capacity capacity.mode=slo_scale workload.rate=R`: DistServe's "SLO scale", the
tightest s at which the capacity criterion still passes at rate R with every SLO set (slo.ttft_s,
slo.tpot_s, slo.tbt_s) multiplied by s.

Each probe is sim.capacity's own (sim.capacity.probe_rate): the run must be steady and the criterion
must pass. The schedule does not read the SLOs, so the steady-state verdict is the same at every
scale: a rate that is not sustained fails at every scale, and the search says so after one probe.
Passing is monotone in s for an attainment criterion (a looser SLO meets at least the same
requests), so s is bisected in log space between capacity.slo_scale.low and .high.

    python -m sim.capacity capacity.mode=slo_scale capacity.criterion=distserve workload.limit=2000 workload.rate=4 \
        slo.ttft_s=0.4 slo.tpot_s=0.1
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, open_dict

from varlen.cli import SettingError, number

MODES = ("rate", "slo_scale")
SLO_KEYS = ("ttft_s", "tpot_s", "tbt_s")
#: Verdicts that depend on the rate alone: no SLO scale can pass them.
STEADY_BOUNDS = ("throughput", "queue_growth")
MAX_PROBES = 30


def mode(cfg: DictConfig) -> str:
    """capacity.mode, checked: rate (the default: bisect the rate) or slo_scale."""
    m = str(cfg.capacity.get("mode", "rate"))
    if m not in MODES:
        raise SettingError(f"capacity.mode={m}: give one of {', '.join(MODES)} (rate: the highest rate meeting "
                           f"the criterion; slo_scale: the tightest SLO scale meeting it at workload.rate)")
    return m


def check_slo_scale_settings(cfg: DictConfig) -> None:
    """The slo_scale search's own settings (sim.capacity checks the rest)."""
    if mode(cfg) != "slo_scale":
        return
    number(cfg, "workload.rate", low=0, low_open=True,
           hint=" (req/s: capacity.mode=slo_scale searches the SLO scale at this one rate)")
    low = number(cfg, "capacity.slo_scale.low", low=0, low_open=True, hint=" (the tightest scale tried, e.g. 0.1)")
    number(cfg, "capacity.slo_scale.high", low=low, low_open=True,
           hint=" (the loosest scale tried, above capacity.slo_scale.low, e.g. 10)")
    number(cfg, "capacity.slo_scale.rel_tol", low=0, low_open=True, hint=" (stop when high / low - 1 < rel_tol)")
    if all(cfg.slo.get(k) is None for k in SLO_KEYS):
        raise SettingError("capacity.mode=slo_scale scales the SLOs: set slo.ttft_s and/or slo.tpot_s (seconds)")


@dataclass
class ScaleResult:
    scale: float | None  # the tightest passing scale found; None: none in [low, high] passes
    bound_by: str  # what fails just below it (the criterion's name), or why none passes
    probes: list[dict[str, Any]]
    sustained: bool  # the rate is in a steady state (it is at every scale or at none)


def search_scale(meets_at: Callable[[float], tuple[bool, dict[str, Any]]], low: float, high: float,
                 rel_tol: float = 0.05, max_probes: int = MAX_PROBES) -> ScaleResult:
    """The smallest scale in [low, high] at which `meets_at` passes, to rel_tol, by bisection in log space."""
    if not 0 < low < high or not math.isfinite(high):
        raise ValueError(f"an SLO scale search needs 0 < low < high, got low={low}, high={high}")
    probes: list[dict[str, Any]] = []

    def probe(s: float) -> tuple[bool, str | None]:
        ok, row = meets_at(s)
        probes.append({"slo_scale": s, "meets": ok, **row})
        return ok, row.get("bound_by")

    ok, why = probe(high)
    if not ok:
        steady = why not in STEADY_BOUNDS
        return ScaleResult(None, str(why or "unknown"), probes, steady)
    ok, why = probe(low)
    if ok:
        return ScaleResult(low, "search_low", probes, True)
    lo, hi, bound = low, high, str(why or "unknown")  # lo fails, hi passes
    while hi / lo - 1 > rel_tol and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:
            break
        ok, why = probe(mid)
        if ok:
            hi = mid
        else:
            lo, bound = mid, str(why or "unknown")
    return ScaleResult(hi, bound, probes, True)


def scaled_meets(cfg: DictConfig, labels: dict[str, Any] | None, log: Callable[[str], None] | None,
                 probe_rate: Callable[..., Any]) -> Callable[[float], tuple[bool, dict[str, Any]]]:
    """meets_at(scale): sim.capacity's probe at workload.rate with every SLO set multiplied by scale."""
    base = {k: cfg.slo.get(k) for k in SLO_KEYS}
    rate = float(cfg.workload.rate)

    said: set[str] = set()

    def once(line: str) -> None:
        # The trace is the same at every scale: what its options changed is said once, not per probe.
        if log is not None and not (line.startswith(("warning: ", "workload (")) and line in said):
            said.add(line)
            log(line)

    def meets_at(scale: float) -> tuple[bool, dict[str, Any]]:
        with open_dict(cfg):
            for k, v in base.items():
                cfg.slo[k] = None if v is None else float(v) * scale
        try:
            if log is not None:
                log(f"  SLO scale {scale:7.3f} ({slo_line(base, scale)}):")
            return probe_rate(cfg, labels, None if log is None else once)(rate)
        finally:
            with open_dict(cfg):
                for k, v in base.items():
                    cfg.slo[k] = v

    return meets_at


def slo_line(base: dict[str, Any], scale: float) -> str:
    names = {"ttft_s": "TTFT", "tpot_s": "TPOT", "tbt_s": "TBT"}
    return ", ".join(f"{names[k]} <= {v * scale:.4g} s" for k, v in base.items() if v is not None)


def run_slo_scale(cfg: DictConfig, labels: dict[str, Any], out: Path,
                  probes_out: list[dict[str, Any]] | None = None, *, probe: Callable[..., Any],
                  cost_notes: Sequence[str] = (), criterion_text: str = "") -> dict[str, Any]:
    """Search, print the answer line, write slo_scale.json and slo_scale_probes.csv; returns the JSON.
    probe: sim.capacity's probe_rate, cost_notes: the run's cost model's parts not from measurements,
    criterion_text: the pass test in words; all handed in by sim.capacity, which dispatches here."""
    import pandas as pd
    from omegaconf import OmegaConf

    from sim.headline import assumed, assumed_fields, trace_text
    from sim.progress import showing
    from sim.run import progress_settings

    c = cfg.capacity.slo_scale
    base = {k: cfg.slo.get(k) for k in SLO_KEYS}
    meets = scaled_meets(cfg, labels, lambda line: print(line, flush=True), probe)
    resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    print(f"SLO scale search at {float(cfg.workload.rate):g} req/s: {labels['scheduler']}/{labels['allocator']}, "
          f"criterion {cfg.capacity.get('criterion', 'slo_attainment')} with every SLO set x scale in "
          f"[{float(c.low):g}, {float(c.high):g}], steady state required\n"
          f"  trace {trace_text(resolved)} {assumed(resolved, labels, cost_notes)}", flush=True)

    def recorded(scale: float) -> tuple[bool, dict[str, Any]]:
        ok, row = meets(scale)
        if probes_out is not None:
            probes_out.append({"slo_scale": scale, "meets": ok, **row})
        return ok, row

    with showing(**progress_settings(cfg), label="SLO scale probe"):
        res = search_scale(recorded, float(c.low), float(c.high), float(c.rel_tol))
    pd.DataFrame(res.probes).to_csv(out / "slo_scale_probes.csv", index=False)
    rate = float(cfg.workload.rate)
    crit = str(cfg.capacity.get("criterion", "slo_attainment"))
    # The pass test at scale 1 (cfg holds the SLOs as given again), worded by sim.capacity as capacity.json's.
    text = f"{criterion_text}; every SLO x slo_scale"
    result = {**labels, "mode": "slo_scale", "rate_requests_per_s": rate, "slo_scale": res.scale,
              "bound_by": res.bound_by, "sustained": res.sustained, "criterion": crit, "criterion_text": text,
              **{f"slo_{k}": v for k, v in base.items()},
              **{f"scaled_{k}": (None if v is None or res.scale is None else v * res.scale) for k, v in base.items()},
              "search_low": float(c.low), "search_high": float(c.high), "probes": len(res.probes),
              **assumed_fields(resolved, labels, cost_notes)}
    (out / "slo_scale.json").write_text(json.dumps(result, indent=2))
    if res.scale is None and not res.sustained:
        print(f"{rate:g} req/s is not sustained (bound_by {res.bound_by}): it fails at every SLO scale")
    elif res.scale is None:
        print(f"even SLO scale {float(c.high):g} fails at {rate:g} req/s (bound_by {res.bound_by}; raise "
              f"capacity.slo_scale.high)")
    elif res.bound_by == "search_low":
        print(f"SLO scale <= {res.scale:.3g} at {rate:g} req/s ({slo_line(base, res.scale)}; the bottom of the "
              f"search range: lower capacity.slo_scale.low)")
    else:
        print(f"tightest SLO scale at {rate:g} req/s: {res.scale:.3g} ({slo_line(base, res.scale)}; "
              f"criterion {crit}, bound_by {res.bound_by} below it)")
    print(f"written to {out}")
    return result
