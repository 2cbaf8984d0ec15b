"""`python -m sim.search`: the cheapest deployment that meets the SLOs at a target rate.

    python -m sim.search search.target_rate=20 slo.ttft_s=1 slo.tpot_s=0.05 workload.limit=2000
    python -m sim.search search.hardware=[h100_sxm] search.tensor=[1,2,4] search.pipeline=[1,2]

Config: conf/sim/search.yaml. A grid of hardware x TP x PP x policy x token budget (`search.*`),
each point one replica (or, with search.cluster_mode=[...,disaggregated], one unit of P prefill
and D decode instances, `search.pd_splits`; no PP there). The search prunes points that do not fit
or have no price (`cost_per_gpu_hour`), bisects one replica's SLO capacity (sim.capacity), sizes
replicas = ceil(target / capacity) and their cost, then simulates the cheapest whole deployment at
the target; one that misses gets a replica more and goes back in line (up to search.max_verify).
Writes search.csv, search.json, pareto.png and the checked run (verified/) to the run directory.
"""

from __future__ import annotations

import collections
import heapq
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from sim.run import CONF
from varlen.cli import SettingError, number

# What a grid point sets; set on the command line, it would be silently replaced by the grid.
SWEPT = {"hardware": "search.hardware", "parallel.tensor": "search.tensor", "parallel.pipeline": "search.pipeline",
         "scheduler": "search.scheduler", "scheduler.max_num_batched_tokens": "search.max_num_batched_tokens",
         "cluster.replicas": "(derived from the target rate)", "workload.rate": "search.target_rate",
         "cluster.mode": "search.cluster_mode", "cluster.prefill_replicas": "search.pd_splits (scaled to the target)",
         "cluster.decode_replicas": "search.pd_splits (scaled to the target)"}
# Per-pool settings a P/D point sets itself; one given per pool would make its label and price wrong.
for _pool in ("prefill", "decode"):
    SWEPT.update({f"cluster.{_pool}.hardware": "search.hardware", f"cluster.{_pool}.tensor": "search.tensor",
                  f"cluster.{_pool}.scheduler": "search.scheduler",
                  f"cluster.{_pool}.max_num_batched_tokens": "search.max_num_batched_tokens"})
MODES = ("colocated", "disaggregated")


@dataclass
class Point:
    """One grid point (one replica's design) and what the search found for it."""

    hardware: str
    tensor: int
    pipeline: int
    scheduler: str
    budget: int | None  # scheduler.max_num_batched_tokens; None: the policy's default
    mode: str = "colocated"
    cost_per_gpu_hour: float = math.nan
    split: tuple[int, int] | None = None  # disaggregated: (P, D) instances of one unit
    status: str = "pending"  # ok | does not fit | misses SLOs | over max_gpus | skipped | error
    reason: str = ""
    replica_capacity: float | None = None  # req/s one replica sustains within the SLOs
    low_attainment: float | None = None  # misses SLOs: the SLO attainment at capacity.low
    capacity_at_top: bool = False  # the bisection's top (capacity.high) met the SLOs: a lower bound
    probes: int = 0
    bound_by: str | None = None  # the condition that bound replica_capacity (sim.capacity.bound_by)
    cost_notes: list[str] = field(default_factory=list)  # the cost model's parts not from measurements
    replicas: int | None = None  # colocated: replicas; disaggregated: units of the P:D split
    verified: bool | None = None  # None: not checked
    verified_attainment: float | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one replica, or of one P:D unit (P + D instances of TP GPUs each)."""
        return self.tensor * self.pipeline * (1 if self.split is None else sum(self.split))

    @property
    def gpus(self) -> int:
        return (self.replicas or 0) * self.gpus_per_replica

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.cost_per_gpu_hour

    @property
    def capacity(self) -> float:
        return (self.replicas or 0) * (self.replica_capacity or 0.0)

    def overrides(self) -> list[str]:
        o = [f"hardware={self.hardware}", f"parallel.tensor={self.tensor}", f"parallel.pipeline={self.pipeline}",
             f"scheduler={self.scheduler}"]
        if self.budget is not None:
            o.append(f"scheduler.max_num_batched_tokens={self.budget}")
        return o + _mode_overrides(self.mode)

    def size_overrides(self, units: int) -> list[str]:
        """The sim.run settings of `units` replicas, or of `units` P:D units."""
        if self.split is None:
            return [f"cluster.replicas={units}"]
        return [f"cluster.prefill_replicas={units * self.split[0]}", f"cluster.decode_replicas={units * self.split[1]}"]

    @property
    def split_text(self) -> str:
        return "" if self.split is None else f"{self.split[0]}:{self.split[1]}"

    def label(self) -> str:
        b = "default" if self.budget is None else self.budget
        pd_ = "" if self.split is None else f" P:D {self.split_text}"
        return f"{self.hardware} TP{self.tensor} PP{self.pipeline} {self.scheduler}/{b}{pd_}"

    def size_text(self, units: int | None = None) -> str:
        n = self.replicas if units is None else units
        if self.split is None:
            return f"x{n} replicas"
        return f"x{n} units ({n * self.split[0]} prefill + {n * self.split[1]} decode)"

    def row(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "checks"}
        n = self.replicas
        d.update(split=self.split_text,
                 prefill_replicas=n * self.split[0] if n and self.split else None,
                 decode_replicas=n * self.split[1] if n and self.split else None)
        d.update(gpus_per_replica=self.gpus_per_replica, gpus=self.gpus if self.replicas else None,
                 cost_per_hour=self.cost_per_hour if self.replicas else None,
                 capacity=self.capacity if self.replicas else None)
        return d


def _mode_overrides(mode: str) -> list[str]:
    """The sim.run settings of a cluster mode (a P/D point's pool sizes: Point.size_overrides)."""
    if mode in MODES:
        return [f"cluster.mode={mode}"]
    raise SettingError(f"search.cluster_mode holds {mode!r}: choose from {', '.join(MODES)}")


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other dominates (as cheap with as much capacity, better in one), cheapest first."""
    def dominates(a: Point, b: Point) -> bool:
        return (a.cost_per_hour <= b.cost_per_hour and a.capacity >= b.capacity
                and (a.cost_per_hour < b.cost_per_hour or a.capacity > b.capacity))

    front = [p for p in points if not any(dominates(q, p) for q in points if q is not p)]
    return sorted(front, key=lambda p: (p.cost_per_hour, -p.capacity))


def pd_splits(cfg: DictConfig) -> list[tuple[int, int]]:
    """search.pd_splits as (P, D) pairs (one-line errors)."""
    out: list[tuple[int, int]] = []
    for x in _names(cfg, "search.pd_splits"):
        ok = (isinstance(x, list) and len(x) == 2
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in x))
        if not ok:
            raise SettingError(f"search.pd_splits holds {x!r}: give [P, D] pairs of whole numbers >= 1 (prefill and "
                               f"decode instances of one unit), e.g. search.pd_splits=[[1,1],[2,1]]")
        if tuple(x) in out:
            raise SettingError(f"search.pd_splits holds {x!r} twice: give each split once")
        out.append((x[0], x[1]))
    return out


def replicas_for(target: float, replica_capacity: float) -> int:
    """Whole replicas whose summed capacity reaches the target (a hair of float slack)."""
    return max(1, math.ceil(target / replica_capacity * (1 - 1e-9)))


def _names(cfg: DictConfig, key: str) -> list[Any]:
    v = OmegaConf.select(cfg, key)
    if OmegaConf.is_list(v):
        v = list(OmegaConf.to_container(v))
    elif v is not None and not OmegaConf.is_config(v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise SettingError(f"{key}={v!r}: give a non-empty list, e.g. {key}=[a,b]")
    return v


def _ints(cfg: DictConfig, key: str, none_ok: bool = False) -> list[int | None]:
    out = []
    for x in _names(cfg, key):
        if x is None and none_ok:
            out.append(None)
        elif isinstance(x, int) and not isinstance(x, bool) and x >= 1:
            out.append(x)
        else:
            raise SettingError(f"{key} holds {x!r}: give whole numbers >= 1" + (" or null" if none_ok else ""))
    return out


def hardware_prices(cfg: DictConfig) -> tuple[dict[str, float], list[str]]:
    """({name: USD per GPU-hour} of the hardware searched, lines saying what was left out)."""
    from varlen.registry import conf_dir

    own = OmegaConf.to_container(cfg.search.get("cost_per_gpu_hour") or OmegaConf.create({}))
    if not isinstance(own, dict):
        raise SettingError(f"search.cost_per_gpu_hour={own!r}: give a mapping {{hardware name: USD per GPU-hour}}")
    names = [str(n) for n in _names(cfg, "search.hardware")]
    known = sorted(p.stem for p in conf_dir("hardware").glob("*.yaml"))
    for n in [*names, *own]:
        if n not in known:
            raise SettingError(f"search.hardware: unknown hardware {n!r}; choose from {', '.join(known)}")
    prices, left_out = {}, []
    for n in names:
        price = own.get(n, OmegaConf.load(conf_dir("hardware", f"{n}.yaml")).get("cost_per_gpu_hour"))
        if price is None:
            left_out.append(f"{n}: no cost_per_gpu_hour (conf/hardware/{n}.yaml), left out of the search; "
                            f"give one with search.cost_per_gpu_hour={{{n}: USD}}")
        elif isinstance(price, bool) or not isinstance(price, (int, float)) or not price > 0:
            raise SettingError(f"cost_per_gpu_hour of {n} is {price!r}: give a price > 0 (USD per GPU-hour)")
        else:
            prices[n] = float(price)
    if not prices:
        raise SettingError("no hardware to search: none of search.hardware has a cost_per_gpu_hour; "
                           "give prices with search.cost_per_gpu_hour={name: USD}")
    return prices, left_out


def check_sweep_job(cfg: DictConfig) -> None:
    """A sweep's search job, checked before any job starts (varlen.cli.CheckSweep)."""
    from hydra.core.hydra_config import HydraConfig

    check_search_settings(cfg, list(HydraConfig.get().overrides.task))


def check_search_settings(cfg: DictConfig, task_overrides: Iterable[str] = ()) -> None:
    from sim.capacity import check_capacity_settings

    if cfg.capacity.get("mode", "rate") != "rate":
        raise SettingError(f"capacity.mode={cfg.capacity.mode}: sim.search bisects each design's rate (capacity.mode=rate); "
                           f"the SLO scale search is python -m sim.capacity capacity.mode=slo_scale")
    check_capacity_settings(cfg)
    number(cfg, "search.target_rate", low=0, low_open=True, hint=" (requests/s the deployment must sustain)")
    number(cfg, "search.max_gpus", low=1, integer=True)
    number(cfg, "search.max_verify", low=1, integer=True, hint=" (simulations at the target rate)")
    for o in task_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in SWEPT:
            raise SettingError(f"{o}: the search sets {key} itself; give its options with {SWEPT[key]}")
    modes = [str(m) for m in _names(cfg, "search.cluster_mode")]
    for m in modes:
        _mode_overrides(m)
    if len(set(modes)) < len(modes):
        raise SettingError(f"search.cluster_mode={modes}: give each mode once")
    pd_splits(cfg)
    if "disaggregated" not in modes and any(o.split("=", 1)[0].lstrip("+~") == "search.pd_splits"
                                            for o in task_overrides):
        raise SettingError(f"search.pd_splits is given but search.cluster_mode={modes} searches no P/D split; "
                           "add disaggregated: search.cluster_mode=[colocated,disaggregated]")
    from varlen import registry

    for s in _names(cfg, "search.scheduler"):
        try:
            registry.spec("scheduler", str(s))  # an unknown policy fails now, with the known ones
        except ValueError as e:
            raise SettingError(f"search.scheduler: {e}") from None
    _ints(cfg, "search.tensor")
    _ints(cfg, "search.pipeline")
    _ints(cfg, "search.max_num_batched_tokens", none_ok=True)


def grid(cfg: DictConfig, prices: Mapping[str, float]) -> list[Point]:
    modes = [str(m) for m in _names(cfg, "search.cluster_mode")]
    shapes: list[tuple[str, tuple[int, int] | None]] = [(m, None) for m in modes if m == "colocated"]
    if "disaggregated" in modes:
        shapes += [("disaggregated", s) for s in pd_splits(cfg)]
    return [Point(hw, tp, pp, str(s), b, m, prices[hw], split)
            for hw in prices for tp in _ints(cfg, "search.tensor") for pp in _ints(cfg, "search.pipeline")
            for s in _names(cfg, "search.scheduler") for b in _ints(cfg, "search.max_num_batched_tokens", True)
            for m, split in shapes]


class Search:
    """Runs the grid; `compose(overrides)` gives a point's full config."""

    def __init__(self, cfg: DictConfig, compose: Any, labels: Mapping[str, Any], log: Any = print) -> None:
        self.cfg, self.compose, self.labels, self.log = cfg, compose, dict(labels), log
        self.target = float(cfg.search.target_rate)
        self.attainment = float(cfg.capacity.attainment)

    def config(self, p: Point, replicas: int = 1, rate: float | None = None) -> DictConfig:
        c = self.compose([*p.overrides(), *p.size_overrides(replicas)])
        if rate is not None:
            with open_dict(c):
                c.workload.rate = rate
        return c

    def _labels(self, p: Point) -> dict[str, Any]:
        return {**self.labels, "scheduler": p.scheduler, "overrides": " ".join(p.overrides())}

    def fits(self, p: Point, c: DictConfig) -> str | None:
        """Why one replica of `p` cannot hold the model and a KV block, or None when it can."""
        from sim.cost.hardware import HardwareSpec
        from sim.parallel import Parallelism, capacity
        from sim.run import load_sim_model

        if c.engine.num_blocks is not None:
            return None  # a pool size given: the simulation's own checks decide
        par = Parallelism(p.tensor, p.pipeline)
        try:
            hw = HardwareSpec.from_dict(OmegaConf.to_container(c.hardware, resolve=True))
            cap = capacity(load_sim_model(c.sim_model.config), hw, par, c.engine.gpu_memory_utilization,
                           name=c.sim_model.name)
        except ValueError as e:
            return " ".join(str(e).split())
        if cap.kv_tokens // c.engine.block_size // par.pipeline < 1:
            return f"no room for a KV block next to the weights on {hw.name} (TP{p.tensor} PP{p.pipeline})"
        return None

    def replica_capacity(self, p: Point) -> None:
        from sim.capacity import bisect_rate, bound_by, cost_model_of, probe_rate
        from sim.headline import unmeasured_notes

        if p.split is not None and p.pipeline != 1:
            p.status, p.reason = "skipped", (f"P/D splits are searched without pipeline parallelism (PP1, not "
                                             f"PP{p.pipeline}); a pool's own stages: sim.run with "
                                             f"cluster.prefill.pipeline / cluster.decode.pipeline")
            return
        unit = "one replica" if p.split is None else f"one P:D {p.split_text} unit"
        if p.gpus_per_replica > int(self.cfg.search.max_gpus):
            p.status, p.reason = "over max_gpus", f"{unit} needs {p.gpus_per_replica} GPUs > search.max_gpus"
            return
        c = self.config(p)
        why = self.fits(p, c)
        if why:
            p.status, p.reason = "does not fit", why
            return

        try:
            p.cost_notes = unmeasured_notes(cost_model_of(OmegaConf.to_container(c, resolve=True)))
            best, probes = bisect_rate(probe_rate(c, self._labels(p)), float(c.capacity.low), float(c.capacity.high),
                                       float(c.capacity.rel_tol), verify_below=list(c.capacity.get("verify_below", [])))
        except (ValueError, KeyError) as e:  # a setting of this point the simulation refuses (SettingError too)
            p.status, p.reason = "error", " ".join(str(e).split())[:300]
            return
        p.probes, p.bound_by = len(probes), bound_by(best, probes, float(c.capacity.high))
        if best is None:
            p.low_attainment = probes[0].get("slo_attainment") if probes else None
            # bound_by says whether the criterion or the steady state failed: not always an SLO.
            p.status, p.reason = "misses SLOs", (f"fails even at capacity.low={c.capacity.low} req/s (bound_by "
                                                 f"{p.bound_by}): {probes[0].get('reason', '') if probes else ''}")
            return
        p.replica_capacity, p.capacity_at_top = best, best >= float(c.capacity.high)
        p.replicas = replicas_for(self.target, best)
        if p.gpus > int(self.cfg.search.max_gpus):
            p.status, p.reason = "over max_gpus", f"needs {p.gpus} GPUs > search.max_gpus={self.cfg.search.max_gpus}"
            return
        p.status = "ok"

    def verify(self, p: Point) -> tuple[bool, Any, dict[str, Any], DictConfig]:
        """Simulate the deployment (p.replicas replicas or P:D units) at the target rate; it passes when
        the capacity criterion does (the one its replicas were sized by, not always the SLOs). The
        steady state is the sizing's: each replica takes no more than the rate it sustained, and the
        target's shorter arrival window on the same trace could not show it."""
        from sim.capacity import criterion
        from sim.criteria import checked
        from sim.run import _simulate_paused
        from varlen.metrics import request_table

        assert p.replicas is not None
        c = self.config(p, p.replicas, self.target)
        res, row, latencies = _simulate_paused(c, self._labels(p), False)
        v = checked(criterion(c), request_table(res.requests, latencies), row)
        ok = v.ok
        p.checks.append({"replicas": p.replicas, "slo_attainment": row["slo_attainment"], "meets": ok,
                         "bound_by": v.bound_by, "reason": v.reason})
        p.verified, p.verified_attainment = ok, row["slo_attainment"]
        return ok, res, row, c

    def cheapest_verified(self, points: Sequence[Point]) -> tuple[Point | None, Any, dict[str, Any] | None, Any]:
        """The cheapest deployment whose simulation at the target rate meets the SLOs."""
        max_gpus, budget = int(self.cfg.search.max_gpus), int(self.cfg.search.max_verify)
        line = [(p.cost_per_hour, -p.capacity, i) for i, p in enumerate(points) if p.status == "ok"]
        heapq.heapify(line)
        while line and budget > 0:
            _, _, i = heapq.heappop(line)
            p = points[i]
            budget -= 1
            ok, res, row, c = self.verify(p)
            last = p.checks[-1] if p.checks else {}
            self.log(f"check {p.label()} {p.size_text()} at {self.target:g} req/s: "
                     f"{last.get('reason') or 'SLO attainment ' + format(row['slo_attainment'], '.1%')} -> "
                     + ("meets" if ok else f"fails (bound_by {last.get('bound_by')})"))
            if ok:
                return p, res, row, c
            if (p.replicas + 1) * p.gpus_per_replica > max_gpus:
                p.status, p.reason = "over max_gpus", (f"missed the SLOs at the target {p.size_text()}; "
                                                       f"one more exceeds search.max_gpus={max_gpus}")
                continue
            p.replicas += 1
            p.verified = None
            heapq.heappush(line, (p.cost_per_hour, -p.capacity, i))
        return None, None, None, None

    def run(self, points: Sequence[Point]) -> tuple[Point | None, Any, dict[str, Any] | None, Any]:
        from sim.headline import not_measured_line

        said: set[tuple[str, ...]] = set()
        for k, p in enumerate(points, 1):
            self.replica_capacity(p)
            if p.status == "ok":
                bound = ">=" if p.capacity_at_top else ""
                unit = "one replica" if p.split is None else "one unit"
                self.log(f"[{k}/{len(points)}] {p.label()}: {unit} {bound}{p.replica_capacity:.3g} req/s "
                         f"(bound_by {p.bound_by}) -> {p.size_text()}, {p.gpus} GPUs, ${p.cost_per_hour:.2f}/h")
            else:
                self.log(f"[{k}/{len(points)}] {p.label()}: {p.status}: {p.reason}")
            if p.cost_notes and (p.hardware, *p.cost_notes) not in said:  # once per hardware, not per point
                said.add((p.hardware, *p.cost_notes))
                self.log(f"{not_measured_line(self.cfg, p.cost_notes)} ({p.hardware})")
        return self.cheapest_verified(points)


def nothing_met(points: Sequence[Point], target: float, attainment: float, max_gpus: int, max_verify: int,
                criterion: str | None = None) -> str:
    """The one line of a search that found no deployment: what bound its closest candidate.
    criterion: the pass test in words (sim.capacity.criterion_text); None: the SLOs for `attainment`."""
    head = (f"no deployment met the SLOs ({attainment:.0%} of requests) at {target:g} req/s" if criterion is None
            else f"no deployment passed at {target:g} req/s ({criterion})")
    checked = [p for p in points if p.checks]
    if checked:
        p = max(checked, key=lambda q: q.checks[-1].get("slo_attainment", 0.0))
        last = p.checks[-1]
        why = (f"one replica more exceeds search.max_gpus={max_gpus}" if p.status == "over max_gpus"
               else f"search.max_verify={max_verify} checks used up")
        failed = f" SLO attainment, bound_by {last['bound_by']}" if last.get("bound_by") else ""
        return (f"{head}; closest: {p.label()} {p.size_text(last['replicas'])} reached "
                f"{last.get('slo_attainment', math.nan):.1%}{failed} ({why})")
    big = [p for p in points if p.status == "over max_gpus"]
    if big:
        p = min(big, key=lambda q: (q.gpus or q.gpus_per_replica, q.cost_per_gpu_hour))
        return f"{head}; closest: {p.label()}: {p.reason} (raise search.max_gpus)"
    slow = [p for p in points if p.status == "misses SLOs"]
    if slow:
        p = max(slow, key=lambda q: -1.0 if q.low_attainment is None else q.low_attainment)
        reached = "" if p.low_attainment is None else f", reaching {p.low_attainment:.1%}"
        return f"{head}; closest: {p.label()} {p.reason}{reached} (loosen the SLOs or lower capacity.low)"
    unchecked = [p for p in points if p.status == "ok"]
    if unchecked:
        p = min(unchecked, key=lambda q: q.cost_per_hour)
        return (f"{head}: {len(unchecked)} estimated to meet them were not checked (search.max_verify={max_verify}); "
                f"cheapest: {p.label()} {p.size_text()}")
    counts = ", ".join(f"{n} {st}" for st, n in sorted(collections.Counter(p.status for p in points).items()))
    first = next((p for p in points), None)
    return f"{head}; every design was left out ({counts})" + (f", e.g. {first.label()}: {first.reason}" if first else "")


def sim_run_args(task: Sequence[str], cfg: DictConfig, p: Point) -> list[str]:
    """The `python -m sim.run` arguments that simulate deployment `p` as the search checked it."""
    args = [o for o in task if not o.split("=", 1)[0].lstrip("+~").startswith("search.")]
    if not any(o.split("=", 1)[0] == "workload.limit" for o in args):
        args.append(f"workload.limit={cfg.workload.limit}")
    return [*args, *p.overrides(), *p.size_overrides(p.replicas), f"workload.rate={cfg.search.target_rate}"]


@hydra.main(config_path=CONF, config_name="search", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import pandas as pd
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from sim.capacity import criterion, criterion_text
    from sim.headline import assumed, assumptions, slo_text, trace_text
    from sim.report import pareto_table, plot_pareto
    from sim.progress import showing
    from sim.run import hydra_labels, progress_settings, write_outputs
    from varlen.cli import errors_to_exit, fail, interrupted

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    task = list(hc.overrides.task)
    points: list[Point] = []

    def write_table() -> None:
        if points:
            rows = [{**p.row(), "cost_notes": "; ".join(p.cost_notes)} for p in points]  # one cell, not a list's repr
            pd.DataFrame(rows).to_csv(out / "search.csv", index=False)

    try:
        check_search_settings(cfg, task)
        prices, left_out = hardware_prices(cfg)
        for line in left_out:
            print(f"note: {line}")
        points = grid(cfg, prices)
        c = OmegaConf.to_container(cfg, resolve=True)
        labels = hydra_labels()
        print(f"deployment search: {len(points)} designs for {cfg.search.target_rate:g} req/s, "
              f"{criterion_text(cfg, criterion(cfg))}\n  trace {trace_text(c)}, {cfg.sim_model.name}, allocator "
              f"{labels['allocator']}, cost {cfg.cost.model}; {slo_text(c)}", flush=True)
        search = Search(cfg, lambda o: compose(config_name="search", overrides=[*task, *o]), labels,
                        log=lambda s: print(s, flush=True))
        with showing(**progress_settings(cfg), label="search simulation"):
            chosen, res, row, ccfg = search.run(points)
    except errors_to_exit() as err:
        fail(str(err))
    except KeyboardInterrupt:
        write_table()
        interrupted(f"search stopped; the points done so far are in {out / 'search.csv'}" if points
                    else f"nothing written to {out}")
    write_table()
    front = pareto_front([p for p in points if p.status == "ok"])
    chosen_c: dict[str, Any] = {}
    if chosen is not None:
        write_outputs(res, row, out / "verified", ccfg)
        chosen_c = OmegaConf.to_container(ccfg, resolve=True)  # type: ignore[assignment]
    plot_pareto(points, front, chosen, search.target, out / "pareto.png")
    result = {"target_rate": search.target, "slo_ttft_s": cfg.slo.ttft_s, "slo_tpot_s": cfg.slo.tpot_s,
              "slo_tbt_s": cfg.slo.get("tbt_s"), "attainment": search.attainment, "model": cfg.sim_model.name,
              "trace": cfg.workload.source, "limit": cfg.workload.limit, "left_out": left_out,
              "criterion": str(cfg.capacity.get("criterion", "slo_attainment")),
              "criterion_text": criterion_text(cfg, criterion(cfg), spelled=True), "cost_model": cfg.cost.model,
              # the cost model's parts not from measurements, by hardware (each point's are in search.csv)
              "cost_notes": {p.hardware: p.cost_notes for p in points if p.cost_notes},
              "cluster_modes_searched": list(_names(cfg, "search.cluster_mode")),
              "pd_splits": [list(s) for s in pd_splits(cfg)] if "disaggregated" in _names(cfg, "search.cluster_mode")
              else None,
              "chosen": None if chosen is None else {**chosen.row(), "checks": chosen.checks,
                                                     "assumptions": assumptions(chosen_c, search._labels(chosen)),
                                                     "sim_run": " ".join(sim_run_args(task, cfg, chosen))},
              "pareto": [p.row() for p in front]}
    (out / "search.json").write_text(json.dumps(result, indent=2, default=str))
    if front:
        print(f"\nPareto set (cost vs capacity; capacity = replicas x one replica's (P:D: units x one unit's), "
              f"estimated; {len(front)} of {sum(p.status == 'ok' for p in points)} deployments):")
        print(pareto_table(front, chosen))
    if chosen is None:
        # Nothing to deploy: exit 1 (the settings were valid); a sweep's job only says so.
        from hydra.types import RunMode

        print(f"written to {out} (search.csv says why each design was left out)")
        other = None if cfg.capacity.get("criterion", "slo_attainment") == "slo_attainment" else \
            criterion_text(cfg, criterion(cfg), spelled=True)
        print(nothing_met(points, search.target, search.attainment, int(cfg.search.max_gpus),
                          int(cfg.search.max_verify), other), file=sys.stderr)
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(1)
        return
    else:
        print(f"\ncheapest: {chosen.label()} {chosen.size_text()} = {chosen.gpus} GPUs, "
              f"${chosen.cost_per_hour:.2f}/h; at {search.target:g} req/s (simulated): {chosen.checks[-1]['reason']}\n"
              f"  {assumed(chosen_c, search._labels(chosen), chosen.cost_notes)}")
        print(f"  python -m sim.run {result['chosen']['sim_run']}")
    print(f"written to {out}")


if __name__ == "__main__":
    from varlen.cli import run_cli

    # By importable name so a launcher pickles it by reference (cloudpickle < 3 drops dataclass fields).
    from sim.search import main as entry

    run_cli(entry)
