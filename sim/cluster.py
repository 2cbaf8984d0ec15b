"""`cluster.mode=disaggregated` from a sim config: the prefill and decode pools
(`cluster.prefill.*` / `cluster.decode.*` over the run's settings), the link, the run and its
summary figures. The simulation itself is sim/disagg.py."""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import numpy as np
from omegaconf import DictConfig, OmegaConf

from varlen.cli import SettingError, number

MODES = ("colocated", "disaggregated")
POOLS = ("prefill", "decode")
POOL_KEYS = ("hardware", "tensor", "pipeline", "scheduler", "max_num_batched_tokens", "max_num_seqs", "num_blocks")


def check_cluster(cfg: DictConfig) -> None:
    """cluster.mode and, when disaggregated, its pools and link (one-line errors)."""
    mode = OmegaConf.select(cfg, "cluster.mode", default="colocated")
    if mode not in MODES:
        raise SettingError(f"cluster.mode={mode!r} is unknown; choose colocated or disaggregated")
    if mode == "colocated":
        return
    replicas = OmegaConf.select(cfg, "cluster.replicas")
    if replicas != 1:
        raise SettingError(f"cluster.replicas={replicas!r} sizes a colocated cluster; with cluster.mode=disaggregated "
                           f"use cluster.prefill_replicas and cluster.decode_replicas (and cluster.prefill.* / "
                           f"cluster.decode.* for each pool's settings)")
    number(cfg, "cluster.prefill_replicas", low=1, integer=True, hint=" (prefill instances)")
    number(cfg, "cluster.decode_replicas", low=1, integer=True, hint=" (decode instances)")
    if (OmegaConf.select(cfg, "parallel.pipeline") or 1) != 1:
        raise SettingError(f"cluster.mode=disaggregated with parallel.pipeline={cfg.parallel.pipeline}: each pool "
                           "has its own; use parallel.pipeline=1 and cluster.prefill.pipeline / cluster.decode.pipeline "
                           "(and cluster.prefill.tensor / cluster.decode.tensor)")
    links = OmegaConf.select(cfg, "cluster.links") or {}
    link = OmegaConf.select(cfg, "cluster.link")
    if link not in links:
        raise SettingError(f"cluster.link={link!r} is unknown; choose one of {', '.join(links)} (cluster.links)")
    number(cfg, f"cluster.links.{link}.bandwidth_gbs", low=0, low_open=True, hint=" (GB/s per GPU, one direction)")
    number(cfg, f"cluster.links.{link}.latency_s", low=0, hint=" (seconds per transfer)")
    for pool in POOLS:
        over = OmegaConf.select(cfg, f"cluster.{pool}")
        unknown = sorted(set(over or {}) - set(POOL_KEYS))
        if unknown:
            raise SettingError(f"cluster.{pool}.{unknown[0]} is not a per-pool setting; use one of "
                               f"{', '.join(POOL_KEYS)}")
        for key in ("tensor", "pipeline", "max_num_batched_tokens", "max_num_seqs", "num_blocks"):
            number(cfg, f"cluster.{pool}.{key}", low=1, integer=True, optional=True)
        hw = OmegaConf.select(cfg, f"cluster.{pool}.hardware")
        if hw is not None:
            from varlen.registry import conf_dir

            names = sorted(p.stem for p in conf_dir("hardware").glob("*.yaml"))
            if str(hw) not in names:
                raise SettingError(f"cluster.{pool}.hardware={hw!r} is unknown; choose one of {', '.join(names)}")
        sched = OmegaConf.select(cfg, f"cluster.{pool}.scheduler")
        if sched is not None:
            from varlen import registry

            if str(sched) not in registry.names("scheduler"):
                raise SettingError(f"cluster.{pool}.scheduler={sched!r} is unknown; choose one of "
                                   f"{', '.join(registry.names('scheduler'))}")


class Pools:
    """Both pools of a disaggregated run (a bad setting is a SettingError here, before any work)."""

    def __init__(self, cfg: DictConfig, c: Mapping[str, Any], model_config: Mapping[str, Any], hardware: Any,
                 alloc_kw: Mapping[str, Any]):
        from sim.cost.hardware import HardwareSpec, ModelShape, load_model_config
        from sim.disagg import Link
        from sim.parallel import Parallelism, capacity
        from varlen import registry
        from varlen.assembly import allocator_factory
        from varlen.clock import SimClock

        self.c, self.model_config = c, model_config
        cl, e = c["cluster"], c["engine"]
        self.block_size = bs = e["block_size"]
        self.pools: dict[str, dict[str, Any]] = {}
        for pool in POOLS:
            over = {k: v for k, v in (cl.get(pool) or {}).items() if v is not None}
            hw = HardwareSpec.load(over["hardware"]) if "hardware" in over else hardware
            tp = int(over.get("tensor", (c.get("parallel") or {}).get("tensor") or 1))
            # Pipeline stages as colocated replicas have them (sim/parallel.py): `pp` instances of one pipeline's
            # latency, each with 1/pp of the KV pool, so pp batches are in flight.
            pp = int(over.get("pipeline", 1))
            num_blocks = over.get("num_blocks", e.get("num_blocks"))
            if num_blocks is None:
                try:
                    tokens = capacity(model_config, hw, Parallelism(tp, pp), e["gpu_memory_utilization"],
                                      name=c["sim_model"]["name"]).kv_tokens
                except ValueError as err:
                    raise SettingError(f"cluster.{pool}: {err}") from None
                num_blocks = tokens // bs
            num_blocks = int(num_blocks) // pp
            if num_blocks < 1:
                raise SettingError(f"cluster.{pool}: {c['sim_model']['name']} leaves no KV block for each of the "
                                   f"{pp} in-flight batches on {hw.name} with tensor={tp} pipeline={pp}; raise "
                                   f"cluster.{pool}.tensor or cluster.{pool}.num_blocks")
            sched = registry.spec("scheduler", over["scheduler"]) if "scheduler" in over else \
                OmegaConf.to_container(cfg.scheduler, resolve=False)
            self.pools[pool] = dict(hardware=hw, tensor=tp, pipeline=pp, num_blocks=num_blocks, scheduler=sched,
                                    scheduler_over={k: over[k] for k in ("max_num_batched_tokens", "max_num_seqs")
                                                    if k in over},
                                    scheduler_name=over.get("scheduler"))
        self.max_model_len = min(e["max_model_len"], *(p["num_blocks"] * bs for p in self.pools.values()))
        self.alloc = allocator_factory(OmegaConf.to_container(cfg.allocator, resolve=False), {"engine": e}, **alloc_kw)
        if not isinstance(self.alloc, functools.partial):
            raise SettingError("allocator: a disaggregated cluster builds each pool's allocator itself; its yaml "
                               "must be a partial (_partial_: true), as conf/allocator/*.yaml are")
        for pool in POOLS:  # one instance of each, built and dropped: its settings are checked
            try:
                self.factory(pool)(SimClock())
            except ValueError as err:
                raise SettingError(f"cluster.{pool}: {' '.join(str(err).split())}") from None
        spec = cl["links"][cl["link"]]
        self.link = Link(cl["link"], float(spec["bandwidth_gbs"]), float(spec["latency_s"]))
        self.kv_bytes = ModelShape.from_config(load_model_config(model_config)).kv_bytes_per_token(hardware.dtype_bytes)

    def factory(self, pool: str) -> Any:
        from sim.cost.registry import cost_model_factory
        from sim.disagg import DisaggEngine, receiving
        from sim.executor import CostModelExecutor
        from varlen.assembly import build_engine
        from varlen.settings import EngineSizes

        p, c, alloc = self.pools[pool], self.c, self.alloc
        if pool == "decode":
            alloc = functools.partial(receiving(alloc.func), *alloc.args, **alloc.keywords)  # type: ignore[arg-type]
        # Both pools' max_model_len is the smaller pool's: a request runs on one of each.
        sizes = EngineSizes(p["num_blocks"], self.block_size, self.max_model_len, **p["scheduler_over"])

        # The pool's instances alike: the policy's config resolved once, one cost model where it holds no state.
        cost = cost_model_factory(c["cost"], self.model_config, p["hardware"],
                                  {"tensor": p["tensor"], "pipeline": p["pipeline"]})
        policies: dict[int, Any] = {}

        def make(clock):
            engine = build_engine(sizes, p["scheduler"], alloc, lambda _policy, _longest: CostModelExecutor(cost(), clock),
                                  engine_class=DisaggEngine, context=c, policies=policies, clock=clock,
                                  keep_finished_kv=pool == "prefill")
            return engine, engine.executor

        return make

    def simulate(self, reqs: list) -> tuple[Any, dict[str, Any]]:
        """(DisaggResult, the summary's cluster figures)."""
        from sim.disagg import simulate_disaggregated

        cl, pools = self.c["cluster"], self.pools
        streams = min(pools["prefill"]["tensor"], pools["decode"]["tensor"])
        P, D = int(cl["prefill_replicas"]), int(cl["decode_replicas"])
        pp, dp = pools["prefill"]["pipeline"], pools["decode"]["pipeline"]
        # Each pipeline's in-flight batches are instances of the simulation (each its own transfer port).
        res = simulate_disaggregated(reqs, self.factory("prefill"), self.factory("decode"), P * pp, D * dp, self.link,
                                     self.kv_bytes, streams, cl["router"], cl.get("router_options"),
                                     self.c.get("fast_forward", True))
        row = dict(mode="disaggregated", prefill_replicas=P, decode_replicas=D, link=self.link.name,
                   gpus=P * pools["prefill"]["tensor"] * pp + D * pools["decode"]["tensor"] * dp,
                   max_model_len=self.max_model_len, num_blocks=pools["decode"]["num_blocks"])
        for pool in POOLS:
            p = pools[pool]
            row.update({f"{pool}_hardware": p["hardware"].name, f"{pool}_tensor": p["tensor"],
                        f"{pool}_pipeline": p["pipeline"],
                        f"{pool}_num_blocks": p["num_blocks"], f"{pool}_scheduler": p["scheduler_name"] or "(run's)",
                        **{f"{pool}_{k}": v for k, v in p["scheduler_over"].items()}})
        row.update(cluster_figures(res))
        return res, row


def pool_utilisation(reps: list, span: float) -> dict[str, float]:
    """busy: the pool's fraction of instance-time in steps; KV: time-weighted mean and peak usage."""
    busy: list[float] = []
    kv_mean: list[float] = []
    kv_peak = 0.0
    for rep in reps:
        col = rep.engine.steps.columns(tokens=False)
        cap = rep.engine.kv.capacity_tokens
        dur, kv = col["duration"], col["kv_reserved_slots"]
        busy.append(float(dur.sum()))
        kv_mean.append(float((dur * kv).sum()) / cap / max(span, 1e-12))
        kv_peak = max(kv_peak, float(kv.max(initial=0)) / cap)
    n = max(len(reps), 1)
    # Exactly rounded sums over the replicas: the same figures whatever order they come in (cells or one fleet).
    return dict(busy=math.fsum(busy) / n / max(span, 1e-12), mean_kv_usage=math.fsum(kv_mean) / n,
                peak_kv_usage=kv_peak)


def _span_and_prompt(requests: Any) -> tuple[float, float, int]:
    """(first arrival, last finish, prompt tokens) of the requests: Requests, or their RequestResults (the
    columns a cell sends: the same figures)."""
    from varlen.metrics import RequestResults

    if isinstance(requests, RequestResults):
        if not len(requests):
            return 0.0, 0.0, 0
        start = float(requests.arrival.min())
        fin = requests.finish[~np.isnan(requests.finish)]
        return start, float(fin.max()) if len(fin) else start, int(requests.prompt_tokens.sum())
    start = min((r.arrival for r in requests), default=0.0)
    end = max((r.finish_time for r in requests if r.finish_time is not None), default=start)
    return start, end, sum(r.num_prompt_tokens for r in requests)


def cluster_figures(res: Any) -> dict[str, float]:
    """Transfers (time, wait, bytes) and each pool's utilisation over the run's span."""
    tr = res.transfers
    t = np.array([x.end - x.start for x in tr]) if tr else np.array([np.nan])
    wait = np.array([x.start - x.ready for x in tr]) if tr else np.array([np.nan])
    start, end, prompt = _span_and_prompt(res.requests)
    span = end - start
    row: dict[str, float] = dict(transfers=len(tr), transfer_mean_s=float(np.mean(t)),
                                 transfer_p99_s=float(np.percentile(t, 99)),
                                 transfer_wait_mean_s=float(np.mean(wait)),
                                 transfer_bytes_total=float(sum(x.bytes for x in tr)))
    for name, reps in (("prefill", res.prefill), ("decode", res.decode)):
        for k, v in pool_utilisation(reps, span).items():
            row[f"{name}_{k}"] = v
    row["prefix_hit_rate"] = sum(res.prefill_hit_tokens.values()) / prompt if prompt else 0.0
    return row
