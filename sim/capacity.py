"""`python -m sim.capacity`: the highest arrival rate that still meets the SLOs, by bisection.

Same config as sim.run (conf/sim.yaml). A rate meets the SLOs when at least
`capacity.attainment` of the requests have TTFT <= slo.ttft_s and TPOT <= slo.tpot_s.

    python -m sim.capacity scheduler=chunked workload.limit=2000 slo.ttft_s=1 slo.tpot_s=0.05
    python -m sim.capacity -m scheduler=static,continuous,chunked workload.limit=2000   # one search per policy

Attainment falls as the rate rises (more queueing), so bisection applies; the search halves
the interval in log space (rates span orders of magnitude) until high / low - 1 < rel_tol.
Writes capacity.json and capacity_probes.csv to the run's directory.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, open_dict

from sim.run import CONF


def bisect_rate(meets: Callable[[float], tuple[bool, dict[str, Any]]], low: float, high: float,
                rel_tol: float = 0.05) -> tuple[float | None, list[dict[str, Any]]]:
    """(highest rate found to meet the SLOs, probes). None when even `low` fails; `high` when
    `high` itself meets them (the search range was too narrow)."""
    probes = []

    def probe(rate: float) -> bool:
        ok, row = meets(rate)
        probes.append({"rate": rate, "meets": ok, **row})
        return ok

    if not probe(low):
        return None, probes
    if probe(high):
        return high, probes
    while high / low - 1 > rel_tol:
        mid = math.sqrt(low * high)
        if probe(mid):
            low = mid
        else:
            high = mid
    return low, probes


def capacity_search(cfg: DictConfig, labels: dict[str, Any] | None = None) -> tuple[float | None, list[dict]]:
    from sim.run import simulate_config

    c = cfg.capacity
    if cfg.slo.ttft_s is None and cfg.slo.tpot_s is None:
        raise ValueError("a capacity search needs an SLO: set slo.ttft_s and/or slo.tpot_s")

    def meets(rate: float) -> tuple[bool, dict[str, Any]]:
        with open_dict(cfg):
            cfg.workload.rate = rate
        _, row = simulate_config(cfg, labels)
        keep = ("slo_attainment", "requests_per_s", "ttft_p90", "tpot_p90", "sim_wall_s")
        print(f"  rate {rate:8.3f} req/s: SLO attainment {row['slo_attainment']:.1%}", flush=True)
        return row["slo_attainment"] >= c.attainment, {k: row[k] for k in keep}

    return bisect_rate(meets, c.low, c.high, c.rel_tol)


@hydra.main(config_path=CONF, config_name="sim", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from sim.run import hydra_labels

    labels = hydra_labels()
    print(f"capacity search: {labels['scheduler']}/{labels['allocator']}, SLO TTFT <= {cfg.slo.ttft_s} s, "
          f"TPOT <= {cfg.slo.tpot_s} s for {cfg.capacity.attainment:.0%} of requests")
    try:
        best, probes = capacity_search(cfg, labels)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(probes).to_csv(out / "capacity_probes.csv", index=False)
    result = {**labels, "capacity_requests_per_s": best, "slo_ttft_s": cfg.slo.ttft_s,
              "slo_tpot_s": cfg.slo.tpot_s, "attainment": cfg.capacity.attainment,
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
    main()
