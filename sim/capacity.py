"""`python -m sim.capacity`: the highest arrival rate the system sustains while meeting a capacity
criterion, by bisection.

Same config as sim.run. A rate passes when the run is steady (sim/criteria.py) and
`capacity.criterion` passes; the answer is verified below (capacity.verify_below).

    python -m sim.capacity scheduler=chunked workload.limit=2000 slo.ttft_s=1 slo.tpot_s=0.05

capacity.mode=slo_scale searches the tightest SLO scale at workload.rate instead (sim/slo_scale.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from sim.run import CONF
from varlen.cli import SettingError, number

if TYPE_CHECKING:
    from sim.criteria import Criterion, SteadyState


MAX_PROBES = 40  # 40 halvings in log space narrow any sane range far below rel_tol
VERIFY_BELOW = (0.8, 0.5)


def bisect_rate(meets: Callable[[float], tuple[bool, dict[str, Any]]], low: float, high: float,
                rel_tol: float = 0.05, max_probes: int = MAX_PROBES,
                verify_below: Sequence[float] = VERIFY_BELOW) -> tuple[float | None, list[dict[str, Any]]]:
    """(highest rate meeting the criterion, or None when even `low` fails, probes). Passing is not
    monotone in the rate on a finite trace, so the answer is verified at `verify_below` fractions of it
    and a failure below withdraws it."""
    if not 0 < low < high or not math.isfinite(high):
        raise ValueError(f"a rate search needs 0 < low < high, got low={low}, high={high}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    fractions = sorted((float(f) for f in verify_below), reverse=True)
    if any(not 0 < f < 1 for f in fractions):
        raise ValueError(f"verify_below holds fractions of the answer in (0, 1), got {list(verify_below)}")
    probes: list[dict[str, Any]] = []
    seen: dict[float, bool] = {}

    def probe(rate: float) -> bool:
        if rate not in seen:
            ok, row = meets(rate)
            probes.append({"rate": rate, "meets": ok, **row})
            seen[rate] = ok
        return seen[rate]

    if not probe(low):
        return None, probes
    lo, hi = (high, None) if probe(high) else (low, high)
    while True:
        while hi is not None and hi / lo - 1 > rel_tol and len(probes) < max_probes - len(fractions):
            mid = math.sqrt(lo * hi)
            if not lo < mid < hi:
                break
            if probe(mid):
                lo = mid
            else:
                hi = mid
        failed = next((lo * f for f in fractions if low < lo * f and not probe(lo * f)), None)
        if failed is None or len(probes) >= max_probes:
            # Out of probes with a failure below: the highest rate that passed below every failure.
            return (lo if failed is None else max(r for r, ok in seen.items() if ok and r < failed)), probes
        hi = failed
        lo = max(r for r, ok in seen.items() if ok and r < failed)


def bound_by(best: float | None, probes: Sequence[dict[str, Any]], high: float) -> str:
    """Which condition bound the answer: the lowest failing probe above it's (`search_high` if high passed)."""
    if best is not None and best >= high:
        return "search_high"
    above = [p for p in probes if not p["meets"] and (best is None or p["rate"] > best)]
    if not above:
        return "search_high"
    return str(min(above, key=lambda p: p["rate"]).get("bound_by") or "unknown")


def check_capacity_settings(cfg: DictConfig) -> None:
    """The search's settings, checked before the first simulation."""
    from sim.run import check_settings

    check_settings(cfg)
    low = number(cfg, "capacity.low", low=0, low_open=True, hint=" (requests/s)")
    number(cfg, "capacity.high", low=low, low_open=True, hint=" (requests/s, above capacity.low)")
    number(cfg, "capacity.attainment", low=0, low_open=True, high=1,
           hint=" (the fraction of requests that must meet the SLOs, e.g. 0.9)")
    number(cfg, "capacity.rel_tol", low=0, low_open=True, hint=" (stop when high / low - 1 < rel_tol, e.g. 0.05)")
    verify = cfg.capacity.get("verify_below", list(VERIFY_BELOW))
    if not OmegaConf.is_list(verify) and not isinstance(verify, (list, tuple)) or any(
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1 for f in verify):
        raise SettingError(f"capacity.verify_below={verify}: give fractions of the answer in (0, 1) to probe "
                           f"below it, e.g. [0.8,0.5] ([] for none)")
    try:
        steady_settings(cfg)
        criterion(cfg)
    except ValueError as e:
        raise SettingError(str(e)) from None
    from sim.slo_scale import check_slo_scale_settings

    check_slo_scale_settings(cfg)  # capacity.mode=slo_scale's own settings


def _mapping(cfg: DictConfig, key: str) -> dict[str, Any] | None:
    """The mapping at `key`, resolved (None when unset); a SettingError when it is not one."""
    node = OmegaConf.select(cfg, key)
    if node is None:
        return None
    if not OmegaConf.is_dict(node):
        raise SettingError(f"{key}={node}: give a mapping of settings, e.g. {key}={{}}")
    return {str(k): v for k, v in OmegaConf.to_container(node, resolve=True).items()}  # type: ignore[union-attr]


def steady_settings(cfg: DictConfig) -> "SteadyState":
    """The steady-state test's thresholds (capacity.steady_state over SteadyState's defaults)."""
    from sim.criteria import SteadyState

    return SteadyState.of(_mapping(cfg, "capacity.steady_state"))


def criterion(cfg: DictConfig) -> "Criterion":
    """The capacity criterion `capacity.criterion` names, built against this config."""
    from sim.criteria import build_criterion

    context = _mapping(cfg, "")
    assert context is not None
    return build_criterion(cfg.capacity.get("criterion", "slo_attainment"), _mapping(cfg, "capacity.criterion_options"),
                           context)


def criterion_text(cfg: DictConfig, crit: "Criterion", spelled: bool = False) -> str:
    """The pass test in words, e.g. 'criterion slo_attainment (the SLO below for 90% of requests),
    steady state required': what every capacity figure is relative to. spelled: the SLOs written out
    even when they are the run's (for a JSON field or a line with no headline below it)."""
    from sim.criteria import SloAttainment

    name = cfg.capacity.get("criterion", "slo_attainment")
    if isinstance(crit, SloAttainment):
        text = ("the SLO below" if not spelled and all(cfg.slo.get(k) == v for k, v in crit.slos.items()) else
                "SLO " + ", ".join(f"{k[:-2].upper()} <= {v:g} s" for k, v in crit.slos.items() if v is not None))
        detail = f" ({text} for {crit.attainment:.0%} of requests)"
    else:  # its thresholds, as the criterion holds them
        numbers = {k: v for k, v in vars(crit).items() if not k.startswith("_") and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        detail = f" ({', '.join(f'{k}={v:g}' for k, v in numbers.items())})" if numbers else ""
    return f"criterion {name}{detail}, steady state required"


def cost_model_of(c: dict[str, Any]) -> Any:
    """The cost model sim.run builds for the resolved config `c` (its notes say what is estimated)."""
    from sim.cost.hardware import HardwareSpec
    from sim.run import build_cost_model, load_sim_model

    return build_cost_model(c["cost"], load_sim_model(c["sim_model"]["config"]), HardwareSpec.from_dict(c["hardware"]))


KEEP = ("slo_attainment", "requests_per_s", "ttft_p90", "tpot_p90", "tbt_p99", "normalized_latency_mean",
        "scheduling_delay_p50", "sim_wall_s")


def probe_rate(cfg: DictConfig, labels: dict[str, Any] | None = None,
               log: Callable[[str], None] | None = None) -> Callable[[float], tuple[bool, dict[str, Any]]]:
    """meets(rate) for bisect_rate: simulate `cfg` at that rate; passes when the criterion does and the run is steady."""
    from sim.headline import LOSSY_KEYS, lossy_line, over_length_warning
    from sim.run import _simulate_paused

    warned: list[bool] = []

    crit, steady = criterion(cfg), steady_settings(cfg)

    def meets(rate: float) -> tuple[bool, dict[str, Any]]:
        with open_dict(cfg):
            cfg.workload.rate = rate
        res, row, latencies = _simulate_paused(cfg, labels, False)
        if log is not None and not warned:
            warned.append(True)  # the trace is the same at every rate: say what its options changed once
            stats = SimpleNamespace(**{k: row[f"trace_{k}"] for k in LOSSY_KEYS})
            for line in (lossy_line(stats), over_length_warning(stats, OmegaConf.to_container(cfg, resolve=True),
                                                                row["trace_max_model_len"])):
                if line:
                    log(line)
        ok, kept = judged(crit, steady, res, row, latencies)
        if log is not None:
            log(f"  rate {rate:8.3f} req/s: {'meets' if ok else 'fails (bound_by ' + str(kept['bound_by']) + ')'}"
                f": {kept['reason']}")
        return ok, kept

    return meets


def judged(crit: "Criterion", steady: "SteadyState", res: Any, row: dict[str, Any],
           latencies: Any) -> tuple[bool, dict[str, Any]]:
    """(passes, the figures kept with bound_by and reason) of one probe's simulation: the criterion
    and the steady state."""
    from sim.criteria import checked, steady_state
    from varlen.metrics import request_table

    table = request_table(res.requests, latencies)
    verdicts = [checked(crit, table, row), steady_state(table, steady)]
    failed = next((v for v in verdicts if not v.ok), None)
    kept = {k: row.get(k) for k in KEEP}
    kept.update(bound_by=failed.bound_by if failed else None, reason="; ".join(v.reason for v in verdicts))
    return failed is None, kept


def capacity_search(cfg: DictConfig, labels: dict[str, Any] | None = None,
                    probes_out: list[dict[str, Any]] | None = None) -> tuple[float | None, list[dict]]:
    """(capacity or None, probes); each probe row carries bound_by and reason (see bound_by())."""
    check_capacity_settings(cfg)
    if cfg.capacity.get("mode", "rate") != "rate":
        raise SettingError(f"capacity.mode={cfg.capacity.mode}: this is the rate search; the SLO scale search is "
                           f"sim.slo_scale.run_slo_scale (python -m sim.capacity capacity.mode=slo_scale)")
    c = cfg.capacity
    meets = probe_rate(cfg, labels, lambda line: print(line, flush=True))

    def recorded(rate: float) -> tuple[bool, dict[str, Any]]:
        ok, kept = meets(rate)
        if probes_out is not None:
            probes_out.append({"rate": rate, "meets": ok, **kept})
        return ok, kept

    return bisect_rate(recorded, c.low, c.high, c.rel_tol,
                       verify_below=list(c.get("verify_below", VERIFY_BELOW)))


@hydra.main(config_path=CONF, config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from sim.progress import showing
    from sim.headline import assumed, assumed_fields, trace_text, unmeasured_notes
    from sim.run import hydra_labels, progress_settings
    from varlen.cli import errors_to_exit, fail, interrupted

    labels = hydra_labels()
    out = Path(HydraConfig.get().runtime.output_dir)
    done: list[dict[str, Any]] = []
    try:
        check_capacity_settings(cfg)
        c = OmegaConf.to_container(cfg, resolve=True)
        notes = unmeasured_notes(cost_model_of(c))  # type: ignore[arg-type]
        if cfg.capacity.get("mode", "rate") == "slo_scale":  # the tightest SLO scale at workload.rate
            from sim.slo_scale import run_slo_scale

            run_slo_scale(cfg, labels, out, done, probe=probe_rate, cost_notes=notes,
                          criterion_text=criterion_text(cfg, criterion(cfg), spelled=True))
            return
        print(f"capacity search: {labels['scheduler']}/{labels['allocator']}, {criterion_text(cfg, criterion(cfg))}\n"
              f"  trace {trace_text(c)} {assumed(c, labels, notes)}", flush=True)
        with showing(**progress_settings(cfg), label="capacity probe"):
            best, probes = capacity_search(cfg, labels, done)
    except errors_to_exit() as err:
        fail(str(err))
    except KeyboardInterrupt:
        if done:
            pd.DataFrame(done).to_csv(out / "capacity_probes.csv", index=False)
        interrupted(f"search stopped after {len(done)} probes; " +
                    (f"those probes written to {out / 'capacity_probes.csv'}, no capacity.json" if done
                     else f"nothing written to {out}"))
    pd.DataFrame(probes).to_csv(out / "capacity_probes.csv", index=False)
    bound = bound_by(best, probes, cfg.capacity.high)
    result = {**labels, "capacity_requests_per_s": best, "bound_by": bound,
              "criterion": str(cfg.capacity.get("criterion", "slo_attainment")), "slo_ttft_s": cfg.slo.ttft_s,
              "slo_tpot_s": cfg.slo.tpot_s, "slo_tbt_s": cfg.slo.get("tbt_s"), "attainment": cfg.capacity.attainment,
              "criterion_text": criterion_text(cfg, criterion(cfg), spelled=True), "steady_state": vars(steady_settings(cfg)),
              "search_high": cfg.capacity.high, "probes": len(probes),
              **assumed_fields(c, labels, notes)}  # type: ignore[arg-type]
    (out / "capacity.json").write_text(json.dumps(result, indent=2))
    if best is None:
        print(f"even {cfg.capacity.low} req/s fails (bound_by {bound})")
    elif best == cfg.capacity.high:
        print(f"capacity >= {best:.3g} req/s (the top of the search range, bound_by {bound}; raise capacity.high)")
    else:
        print(f"capacity: {best:.3g} req/s (bound_by {bound})")
    print(f"written to {out}")


if __name__ == "__main__":
    from varlen.cli import run_cli

    run_cli(main)
