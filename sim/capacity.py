"""`python -m sim.capacity`: the highest arrival rate that still meets the SLOs, by bisection.

Same config as sim.run; a rate passes when `capacity.attainment` of the requests meet every SLO
set. Writes capacity.json and capacity_probes.csv to the run's directory.

    python -m sim.capacity scheduler=chunked workload.limit=2000 slo.ttft_s=1 slo.tpot_s=0.05
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, open_dict

from sim.run import CONF
from varlen.cli import SettingError, number


MAX_PROBES = 40  # 40 halvings in log space narrow any sane range far below rel_tol


def bisect_rate(meets: Callable[[float], tuple[bool, dict[str, Any]]], low: float, high: float,
                rel_tol: float = 0.05, max_probes: int = MAX_PROBES) -> tuple[float | None, list[dict[str, Any]]]:
    """(highest rate found to meet the SLOs, or None when even `low` fails, probes). Ends after
    `max_probes`, or when floats leave no midpoint strictly between the bounds."""
    if not 0 < low < high or not math.isfinite(high):
        raise ValueError(f"a rate search needs 0 < low < high, got low={low}, high={high}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    probes = []

    def probe(rate: float) -> bool:
        ok, row = meets(rate)
        probes.append({"rate": rate, "meets": ok, **row})
        return ok

    if not probe(low):
        return None, probes
    if probe(high):
        return high, probes
    while high / low - 1 > rel_tol and len(probes) < max_probes:
        mid = math.sqrt(low * high)
        if not low < mid < high:
            break
        if probe(mid):
            low = mid
        else:
            high = mid
    return low, probes


def check_capacity_settings(cfg: DictConfig) -> None:
    """The search's settings, checked before the first simulation."""
    from sim.run import check_settings

    check_settings(cfg)
    low = number(cfg, "capacity.low", low=0, low_open=True, hint=" (requests/s)")
    number(cfg, "capacity.high", low=low, low_open=True, hint=" (requests/s, above capacity.low)")
    number(cfg, "capacity.attainment", low=0, low_open=True, high=1,
           hint=" (the fraction of requests that must meet the SLOs, e.g. 0.9)")
    number(cfg, "capacity.rel_tol", low=0, low_open=True, hint=" (stop when high / low - 1 < rel_tol, e.g. 0.05)")
    if cfg.slo.ttft_s is None and cfg.slo.tpot_s is None and cfg.slo.get("tbt_s") is None:
        raise SettingError("a capacity search needs an SLO: set slo.ttft_s, slo.tpot_s and/or slo.tbt_s (seconds)")


def slo_text(cfg: DictConfig) -> str:
    """The SLOs set, e.g. 'TTFT <= 2 s, TBT <= 0.2 s'."""
    names = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("TBT", "tbt_s"))
    return ", ".join(f"{n} <= {cfg.slo.get(k)} s" for n, k in names if cfg.slo.get(k) is not None)


def capacity_search(cfg: DictConfig, labels: dict[str, Any] | None = None,
                    probes_out: list[dict[str, Any]] | None = None) -> tuple[float | None, list[dict]]:
    from sim.run import simulate_config

    check_capacity_settings(cfg)
    c = cfg.capacity

    def meets(rate: float) -> tuple[bool, dict[str, Any]]:
        with open_dict(cfg):
            cfg.workload.rate = rate
        _, row = simulate_config(cfg, labels)
        keep = ("slo_attainment", "requests_per_s", "ttft_p90", "tpot_p90", "tbt_p99", "sim_wall_s")
        print(f"  rate {rate:8.3f} req/s: SLO attainment {row['slo_attainment']:.1%}", flush=True)
        ok, kept = row["slo_attainment"] >= c.attainment, {k: row[k] for k in keep}
        if probes_out is not None:
            probes_out.append({"rate": rate, "meets": ok, **kept})
        return ok, kept

    return bisect_rate(meets, c.low, c.high, c.rel_tol)


@hydra.main(config_path=CONF, config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from sim.progress import showing
    from sim.run import hydra_labels, progress_settings
    from varlen.cli import errors_to_exit, fail, interrupted

    labels = hydra_labels()
    out = Path(HydraConfig.get().runtime.output_dir)
    done: list[dict[str, Any]] = []
    try:
        check_capacity_settings(cfg)
        print(f"capacity search: {labels['scheduler']}/{labels['allocator']}, SLO {slo_text(cfg)} "
              f"for {cfg.capacity.attainment:.0%} of requests")
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
    result = {**labels, "capacity_requests_per_s": best, "slo_ttft_s": cfg.slo.ttft_s,
              "slo_tpot_s": cfg.slo.tpot_s, "slo_tbt_s": cfg.slo.get("tbt_s"), "attainment": cfg.capacity.attainment,
              "search_high": cfg.capacity.high, "probes": len(probes)}
    (out / "capacity.json").write_text(json.dumps(result, indent=2))
    if best is None:
        print(f"even {cfg.capacity.low} req/s misses the SLOs")
    elif best == cfg.capacity.high:
        print(f"capacity >= {best:.3g} req/s (the top of the search range; raise capacity.high)")
    else:
        print(f"capacity: {best:.3g} req/s")
    print(f"written to {out}")


if __name__ == "__main__":
    from varlen.cli import run_cli

    run_cli(main)
