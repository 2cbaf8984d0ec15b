"""`python -m sim.run`: one simulation from a Hydra config (conf/sim/sim.yaml); `-m` for sweeps.

    python -m sim.run -m scheduler=static,continuous,chunked workload.rate=1,2,4,8
    python -m sim.report multirun/sim/<date>/<time>
"""

from __future__ import annotations

import gc
import sys

if __name__ == "__main__" and not {"-m", "--multirun"} & set(sys.argv[1:]):
    # One run: its imports and Hydra's composition make many objects and almost no cyclic garbage,
    # and each collector pass over them costs start-up time; main() turns it back on.
    gc.disable()

import atexit  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Mapping  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from sim.headline import (LOSSY_KEYS, headline, lossy_line, over_length_warning, prefix_hit_rate,  # noqa: E402
                          unmeasured_notes)
from varlen.cli import SettingError, check_missing, check_slo, existing_file, number  # noqa: E402
from varlen.registry import conf_dir  # noqa: E402

CONF = str(conf_dir("sim"))


def load_requests(workload: Mapping[str, Any], vocab_size: int, memory_limit_gb: float | None = None,
                  check_memory: bool = False, token_times: bool = False):
    """(trace, requests) from the workload config (varlen/workload.py); check_memory: refuse a
    workload estimated to need more than memory_limit_gb (null: the memory available) first
    (token_times: with token-level output)."""
    from sim.memory import check_synthetic, check_trace
    from varlen.sampling_params import SamplingParams
    from varlen.workload import load_workload, trace_requests

    if check_memory:
        check_synthetic(workload, memory_limit_gb, token_times)
    trace, opts = load_workload(workload)
    if trace is None:
        raise SettingError(NO_PROMPT_FILES)
    if check_memory:
        check_trace(trace, bool(opts.get("token_ids")), memory_limit_gb, token_times=token_times)
    # ignore_eos: the trace's output length is the request's length, as in the real engine's replay.
    # lazy: each request built as it arrives (a TraceRequests), released by the simulation as it ends.
    def build(t: Any) -> Any:
        return trace_requests(t, vocab_size, SamplingParams(ignore_eos=True), token_ids=bool(opts.get("token_ids")),
                              lazy=True)

    # All of the trace, or the share of the cell being simulated (only sim.cells, once imported, sets one).
    cells = sys.modules.get("sim.cells")
    reqs = build(trace) if cells is None else cells.cell_requests(trace, build)
    return trace, reqs


NO_PROMPT_FILES = ("workload=prompts is a prompt file, which only varlen.run serves; sim.run needs a trace: "
                   "workload=azure_conv, azure_code, mooncake_conv or synthetic")


def build_cost_model(cost: Mapping[str, Any], model_config: Any, hardware: Any,
                     parallel: Mapping[str, Any] | None = None):
    """The `cost` section's model (sim/cost/registry.py), or a one-line SettingError."""
    return cost_model_factory(cost, model_config, hardware, parallel)()


def cost_model_factory(cost: Mapping[str, Any], model_config: Any, hardware: Any,
                       parallel: Mapping[str, Any] | None = None):
    """Each replica's cost model (sim/cost/registry.py cost_model_factory: one object where it holds
    no state), settings checked now; a bad one is a one-line SettingError."""
    from sim.cost.registry import cost_model_factory as factory

    make = _setting_error(factory, cost, model_config, hardware, parallel)
    return lambda: _setting_error(make)


def _setting_error(fn, *args):
    """fn(*args), a ValueError it raises as a one-line SettingError."""
    try:
        return fn(*args)
    except SettingError:
        raise
    except ValueError as e:
        raise SettingError(str(e)) from None


def load_sim_model(spec: Any) -> dict[str, Any]:
    """sim_model.config as an HF config dict, or a SettingError naming the file and the fix."""
    from sim.cost.hardware import load_model_config

    if isinstance(spec, Mapping) or str(spec) == "tiny" or str(spec).startswith("tiny-"):
        try:
            return load_model_config(spec)
        except KeyError as e:
            raise SettingError(f"sim_model.config={spec!r}: unknown tiny architecture {e}") from None
    p = Path(str(spec))
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise SettingError(f"sim_model.config={str(spec)!r}: no such file; give a Hugging Face config.json "
                           "or the folder holding it")
    try:
        config = load_model_config(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise SettingError(f"sim_model.config={str(spec)!r}: {f} is not a JSON config "
                           f"({' '.join(str(e).split())[:120]}); give a Hugging Face config.json") from None
    if not isinstance(config, dict) or "vocab_size" not in config:
        raise SettingError(f"sim_model.config={str(spec)!r}: {f} is not a Hugging Face model config "
                           "(no vocab_size); give a model's config.json")
    return config


def check_settings(cfg: DictConfig) -> None:
    """Every setting the simulation reads, checked before any work starts (one-line errors)."""
    from varlen import registry

    if "path" in cfg.workload.keys():  # `in cfg.workload` is False while path is ???
        raise SettingError(NO_PROMPT_FILES)
    check_missing(cfg)
    number(cfg, "engine.block_size", low=1, integer=True, hint=" (tokens per KV block, e.g. 16)")
    number(cfg, "engine.num_blocks", low=1, integer=True, optional=True)
    number(cfg, "engine.gpu_memory_utilization", low=0, low_open=True, high=1,
           hint=" (the fraction of device memory for weights and KV, e.g. 0.9)")
    number(cfg, "engine.max_model_len", low=2, integer=True)
    number(cfg, "engine.frontend_latency_s", low=0, optional=True,
           hint=" (seconds per request outside the engine's steps: API server, tokenizer, RPC; 0 for none)")
    number(cfg, "cluster.replicas", low=1, integer=True)
    for key in ("parallel.tensor", "parallel.pipeline"):
        number(cfg, key, low=1, integer=True, optional=True, hint=" (GPUs per replica)" if key.endswith("tensor") else
               " (pipeline stages per replica)")
    check_router(cfg, registry)
    from sim.cluster import check_cluster

    check_cluster(cfg)
    if not _one_fleet(cfg):
        from sim.cells import check_cells

        check_cells(cfg)
    check_slo(cfg)
    check_window(cfg)
    number(cfg, "workload.rate", low=0, low_open=True, optional=True, hint=" (requests/s)")
    number(cfg, "workload.limit", low=0, integer=True, optional=True)
    src = OmegaConf.select(cfg, "workload.source")
    if src is not None and str(src) != "synthetic":
        from varlen.traces import NAMED_TRACES

        if str(src) not in NAMED_TRACES:
            existing_file(cfg, "workload.source", f"a trace file or one of {', '.join(NAMED_TRACES)}")


def check_window(cfg: DictConfig) -> None:
    """An allocator freeing K/V behind a sliding window only where every layer of sim_model slides
    at most that far, as the real engine refuses (varlen/model_runner.py check_kv_allocator)."""
    if "sliding_window" not in cfg.allocator:
        return
    window = number(cfg, "allocator.sliding_window", low=1, integer=True,
                    hint=" (positions: the model's widest window, e.g. 4096 for Mistral-7B-v0.1)")
    need = config_kv_window(load_sim_model(cfg.sim_model.config))
    if need is None or (window or 0) < need:  # window: an int (not optional)
        why = ("some layers attend to the whole context, so nothing may be freed early" if need is None
               else f"its widest window is {need}")
        fix = "use allocator=paged" if need is None else f"set allocator.sliding_window={need}"
        model = OmegaConf.select(cfg, "sim_model.name") or OmegaConf.select(cfg, "sim_model.config")
        raise SettingError(f"allocator.sliding_window={window} frees K/V that sim_model {model} still "
                           f"reads ({why}); {fix}")


def config_kv_window(config: Mapping[str, Any]) -> int | None:
    """Trailing positions every layer of an HF config may still read (None: the whole context)."""
    c = dict(config.get("text_config", config))
    window = c.get("sliding_window")
    if not window or c.get("use_sliding_window") is False:
        return None
    types = c.get("layer_types")
    if types and any(t != "sliding_attention" for t in types):
        return None
    if not types and c.get("model_type") in ("gemma2", "gemma3", "gemma3_text", "cohere2"):
        return None  # interleaved full-attention layers, from before configs listed layer_types
    return int(window)


def check_router(cfg: DictConfig, registry: Any) -> None:
    """cluster.router names a router that builds with cluster.router_options."""
    name = cfg.cluster.router
    names = registry.names("router")
    if not isinstance(name, str) or (name not in names and "." not in name):
        raise SettingError(f"cluster.router={name!r} is unknown; choose one of {', '.join(names)} (conf/router/*.yaml)")
    opts = cfg.cluster.get("router_options")
    options = OmegaConf.to_container(opts, resolve=True) if opts is not None else {}
    if not isinstance(options, dict):
        raise SettingError(f"cluster.router_options={options!r}: give a mapping of the router's settings")
    try:
        registry.build("router", name, **options)
    except ValueError as e:
        raise SettingError(f"cluster.router={name!r} with cluster.router_options={options}: {e}") from None


def simulate_config(cfg: DictConfig, labels: Mapping[str, Any] | None = None,
                    announce: bool = False) -> tuple[Any, dict[str, Any]]:
    """(SimResult, summary row with labels) of the run `cfg` describes; announce: say its size first."""
    res, row, _ = _simulate_paused(cfg, labels, announce)
    return res, row


def _simulate_paused(cfg: DictConfig, labels: Mapping[str, Any] | None,
                     announce: bool, steps_to: Path | None = None) -> tuple[Any, dict[str, Any], Any]:
    """(SimResult, summary row, the requests' RequestResults); steps_to: stream steps.csv's rows to
    part files there as the run goes (write_outputs joins them)."""
    from sim.simulator import gc_paused

    with gc_paused():
        return _simulate_config(cfg, labels, announce, steps_to)


def frontend_delay(requests: Any, frontend_latency_s: float) -> None:
    """Move every request's arrival by `frontend_latency_s` (Requests or their RequestResults), for a serving
    front end (API server, tokenizer, RPC) with a fixed latency outside the engine's steps
    (`engine.frontend_latency_s`): requests reach the engine that much after the trace's arrivals (+) and,
    after the run, their arrivals are the trace's again (-), so TTFT, e2e and scheduling delay grow by it and
    TPOT and gaps do not. A constant shift of every arrival leaves the engine's run the same, time-shifted."""
    if not frontend_latency_s:
        return
    from varlen.metrics import RequestResults

    if isinstance(requests, RequestResults):
        requests.arrival += frontend_latency_s
    else:
        for req in requests:
            req.arrival += frontend_latency_s


def token_level(cfg: DictConfig) -> bool:
    """Whether a run keeps every Request with its token times (output.token_times, or a timeline)."""
    o = cfg.output
    for key in ("token_times", "timeline"):
        v = o.get(key, False)
        if not isinstance(v, bool):
            raise SettingError(f"output.{key}={v!r}: give true or false")
    return bool(o.get("token_times", False) or o.get("timeline", False))


def _one_fleet(cfg: DictConfig) -> bool:
    """cluster.cells, cells_on and cell_key_blocks as shipped (one fleet in this process): valid, and
    nothing of sim.cells needed, so a plain run does not import it."""
    def at(key: str, default: Any) -> Any:
        return OmegaConf.select(cfg, f"cluster.{key}", default=default)

    cells, blocks = at("cells", 1), at("cell_key_blocks", 2)
    return type(cells) is int and cells == 1 and type(blocks) is int and blocks == 2 and at("cells_on", "local") == "local"


def _simulate_config(cfg: DictConfig, labels: Mapping[str, Any] | None,
                     announce: bool, steps_to: Path | None = None) -> tuple[Any, dict[str, Any], Any]:
    from sim.cost.hardware import HardwareSpec
    from sim.executor import CostModelExecutor
    from sim.fast_forward import FastForwardEngine
    from sim.simulator import simulate
    from varlen.assembly import allocator_factory, build_engine
    from varlen.metrics import results_of, summarize
    from varlen.settings import EngineSizes
    from varlen.steplog import StepLog

    check_settings(cfg)
    c = OmegaConf.to_container(cfg, resolve=True)
    model_config = load_sim_model(c["sim_model"]["config"])
    hardware = HardwareSpec.from_dict(c["hardware"])
    cost_model = build_cost_model(c["cost"], model_config, hardware)  # a bad cost.path fails now, not per replica
    cost_notes = unmeasured_notes(cost_model)
    if not _one_fleet(cfg):
        from sim.cells import cells_of, simulate_cells

        if cells_of(cfg) > 1:  # independent cells behind a front door, merged into one fleet's result
            return simulate_cells(cfg, labels, announce, _simulate_paused, cost_notes)
    keep = token_level(cfg)
    e = c["engine"]
    num_blocks = e.get("num_blocks")
    from sim.parallel import Parallelism, capacity

    par = Parallelism.of(c.get("parallel"))
    alloc_kw = {}
    if not c["workload"].get("token_ids", False) and "enable_prefix_caching" in c["allocator"]:
        # Content-free prompts (Azure) are all zeros: every prompt would "hit" every other's blocks.
        alloc_kw["enable_prefix_caching"] = False
    disaggregated = c["cluster"].get("mode", "colocated") == "disaggregated"
    if disaggregated:
        from sim.cluster import Pools

        pools = Pools(cfg, c, model_config, hardware, alloc_kw)  # a bad pool setting fails before any work
        num_blocks = 0
    elif num_blocks is None:
        tokens = capacity(model_config, hardware, par, e["gpu_memory_utilization"],
                          name=c["sim_model"]["name"]).kv_tokens
        num_blocks = tokens // e["block_size"] // par.pipeline
        if num_blocks < 1:
            raise ValueError(f"{c['sim_model']['name']} does not fit on {hardware.name}: no room for KV blocks")
    elif par.pipeline > 1:  # engine.num_blocks is the replica's pool, shared by its in-flight batches
        num_blocks //= par.pipeline
        if num_blocks < 1:
            raise ValueError(f"engine.num_blocks={e['num_blocks']} is less than one block for each of the "
                             f"parallel.pipeline={par.pipeline} in-flight batches")
    make_kv = allocator_factory(OmegaConf.to_container(cfg.allocator, resolve=False), {"engine": e}, **alloc_kw)
    wl = c["workload"]
    if wl.get("max_model_len") and wl.get("over_length", "clip") == "clip":
        # over_length=clip keeps what an engine accepts: max_model_len within what its pool holds.
        holds = pools.max_model_len if disaggregated else \
            make_kv(num_blocks=num_blocks, block_size=e["block_size"], max_model_len=e["max_model_len"]).max_request_tokens()
        wl = {**wl, "max_model_len": min(wl["max_model_len"], holds)}
    trace, reqs = load_requests(wl, int(model_config["vocab_size"]), c.get("memory_limit_gb"), True,
                                keep or disaggregated)
    if not reqs:
        raise SettingError(f"no requests: the workload {c['workload'].get('source')!r} gave none "
                           f"(limit={c['workload'].get('limit')}, {trace.stats.num_read} read); nothing to simulate")
    trace = dataclasses.replace(trace, requests=[])  # its rows are the requests now: only the stats are read
    lossy = lossy_line(trace.stats)
    caching = bool(c["allocator"].get("enable_prefix_caching")) and alloc_kw.get("enable_prefix_caching", True)
    if announce:
        if lossy:
            print(lossy, flush=True)
        print(headline(c, labels, len(reqs), caching, cost_model), flush=True)
        warning = over_length_warning(trace.stats, c, wl.get("max_model_len"))
        if warning:
            print(warning, flush=True)

    frontend_s = float(e.get("frontend_latency_s") or 0.0)
    frontend_delay(reqs, frontend_s)  # they reach the engine that much later
    policy = OmegaConf.to_container(cfg.scheduler, resolve=False)
    sizes = EngineSizes(num_blocks, e["block_size"], e["max_model_len"])

    steps_kept = keep or (c["output"].get("steps") and steps_to is None)
    made: list[int] = []

    # Every replica alike: the policy's config resolved once, one cost model object where it holds no state.
    replica_cost = None if disaggregated else cost_model_factory(c["cost"], model_config, hardware, c.get("parallel"))
    policies: dict[int, Any] = {}

    def make_engine(clock):
        engine = build_engine(sizes, policy, make_kv, lambda _policy, _longest: CostModelExecutor(replica_cost(), clock),
                              engine_class=FastForwardEngine, context=c, policies=policies, clock=clock)
        if not steps_kept:  # the per-step columns only; steps.csv's rows streamed to steps_to
            from sim import steps_csv

            engine.steps = StepLog(keep=False, sink=None if not c["output"].get("steps") else steps_csv.sink(
                steps_to, len(made), bool(c["output"].get("step_detail"))))
        made.append(1)
        return engine, engine.executor

    cluster_row: dict[str, Any] = {}
    if disaggregated:
        res, cluster_row = pools.simulate(reqs)
        steps, total_slots = StepLog.concat(r.engine.steps for r in res.decode), res.decode[0].engine.kv.capacity_tokens
        replicas = len(res.replicas)
    else:
        res = simulate(reqs, make_engine, c["cluster"]["replicas"] * par.pipeline, c["cluster"]["router"],
                       c.get("fast_forward", True), c["cluster"].get("router_options"), keep_requests=keep)
        del reqs  # keep_requests=False: released as they ended
        steps, total_slots, replicas = res.steps, res.total_slots, c["cluster"]["replicas"]
    frontend_delay(res.requests, -frontend_s)  # the client's arrivals, before any table is made of them
    results = results_of(res.requests)
    if not disaggregated:
        cluster_row = dict(mode="colocated", gpus=replicas * par.gpus, prefix_hit_rate=prefix_hit_rate(results))
    row = dict(labels or {})
    row.update(model=c["sim_model"]["name"], hardware=hardware.name, cost_model=c["cost"]["model"],
               replicas=replicas, router=c["cluster"]["router"],
               tensor=par.tensor, pipeline=par.pipeline, frontend_latency_s=frontend_s,
               num_blocks=num_blocks, block_size=e["block_size"], max_model_len=res.replicas[0].engine.max_model_len,
               max_num_seqs=c["scheduler"].get("max_num_seqs"),
               max_num_batched_tokens=c["scheduler"].get("max_num_batched_tokens"),
               rate=trace.stats.mean_rate, trace=c["workload"].get("source"), cost_notes=cost_notes)
    row.update({f"trace_{k}": getattr(trace.stats, k) for k in LOSSY_KEYS})
    row["trace_max_model_len"] = wl.get("max_model_len")
    row.update(summarize(results, steps, total_slots, c["slo"]["ttft_s"], c["slo"]["tpot_s"], c["slo"].get("tbt_s")))
    row.update(cluster_row)
    row["prefix_caching"] = caching
    row.update(steps=res.num_steps, sim_wall_s=res.wall_s,
               sim_requests_per_wall_s=len(results) / max(res.wall_s, 1e-9),
               sim_time_s=max(r.clock.now() for r in res.replicas))
    return res, row, results


def hydra_labels() -> dict[str, Any]:
    """The chosen config options, which name a run in a sweep."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    ch = hc.runtime.choices

    def name(group: str) -> Any:
        # A class given on the command line (scheduler._target_=mypkg.Mine) is what ran, not the group's choice.
        given = [o.split("=", 1)[1] for o in hc.overrides.task if o.lstrip("+~").startswith(f"{group}._target_=")]
        return given[-1] if given else ch.get(group)

    return {"scheduler": name("scheduler"), "allocator": name("allocator"), "overrides": ",".join(hc.overrides.task)}


def write_csv(table: Any, path: Path) -> None:
    """What pd.DataFrame(table).to_csv(path, index=False) writes, byte for byte, for a DataFrame or a
    mapping of column name to column, faster (numbers as float_texts and int_texts write them); other
    column types are left to pandas."""
    import csv

    import numpy as np

    if isinstance(table, Mapping) and len(table) == 1:
        import pandas as pd

        table = pd.DataFrame(table)
    if isinstance(table, Mapping):
        names, fields = [str(c) for c in table], []
        for col in table.values():
            # Typed as pandas would type it: numbers (and bools) as an array, text as it is.
            if not isinstance(col, np.ndarray) and len(col) and set(map(type, col)) == {str}:
                text = list(col)  # text: no array of it needed
                if _CSV_SPECIAL.search("".join(text)):
                    text = ['"' + v.replace('"', '""') + '"' if _CSV_SPECIAL.search(v) else v for v in text]
                fields.append(text)
                continue
            arr = np.asarray(col) if not isinstance(col, np.ndarray) else col
            if arr.dtype.kind == "f" and arr.dtype != np.float64:  # float32, float16: pandas writes their own repr
                import pandas as pd

                return write_csv(pd.DataFrame(table), path)
            if arr.dtype.kind in "fiu":
                fields.append(arr)  # numbers: written below, neighbouring columns of a kind at once
                continue
            if arr.dtype.kind == "b":
                text = list(map(str, arr.tolist()))
            elif arr.dtype.kind in "OU" and not isinstance(col, np.ndarray) and all(
                    type(v) is str or v is None or (type(v) is float and v != v) for v in col):
                text = [v if type(v) is str else "" for v in col]
                if _CSV_SPECIAL.search("".join(text)):
                    text = ['"' + v.replace('"', '""') + '"' if _CSV_SPECIAL.search(v) else v for v in text]
            else:
                import pandas as pd

                return write_csv(pd.DataFrame(table), path)
            fields.append(text)
        if len({len(c) for c in fields}) > 1:  # zip would cut the table short without a word
            raise ValueError(f"{path}: columns of different lengths "
                             f"({', '.join(f'{n}: {len(c)}' for n, c in zip(names, fields))})")
        texts = _field_texts(fields)
        # Each field quoted as the csv module would (QUOTE_MINIMAL), joined here: faster than writerows.
        with open(path, "w", newline="") as f:
            csv.writer(f, lineterminator=os.linesep).writerow(names)
            if texts[0]:
                f.write(os.linesep.join(map(",".join, zip(*texts))) + os.linesep)
        return
    else:
        names, cols = [str(c) for c in table.columns], []
        for name in table.columns:
            col = table[name]
            if (col.dtype.kind not in "fiuOT" and str(col.dtype) not in ("str", "string")
                    or col.dtype.kind == "f" and col.dtype != np.float64):
                table.to_csv(path, index=False)
                return
            values = col.to_numpy().tolist() if col.dtype.kind in "fiu" else col.astype(object).tolist()
            if col.dtype.kind not in "iu":
                for i in col.isna().to_numpy().nonzero()[0].tolist():
                    values[i] = None
            cols.append(values)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator=os.linesep)
        w.writerow(names)
        w.writerows(zip(*cols))


def _field_texts(fields: list) -> list[list[str]]:
    """Each field's texts (number arrays written as float_texts and int_texts write them, NaN as an
    empty field); a run of neighbouring number columns of one kind becomes one list of their rows'
    joined texts, written at once by orjson where it is installed."""
    out: list[list[str]] = []
    k = 0
    while k < len(fields):
        j = k + 1
        kind = _block_kind(fields[k])
        while kind is not None and j < len(fields) and _block_kind(fields[j]) == kind:
            j += 1
        if j - k > 1 and len(fields[k]) and _orjson() is not None:
            out.append(_row_texts(fields[k:j]))
        else:
            out.extend(_column_texts(f) for f in fields[k:j])
        k = j
    return out


def _block_kind(field: Any) -> str | None:
    """The dtype kind by which neighbouring number columns are written together (None: on its own)."""
    if isinstance(field, list) or field.ndim != 1 or field.dtype.itemsize > 8:
        return None
    return field.dtype.kind


def _column_texts(field: Any) -> list[str]:
    if isinstance(field, list):
        return field
    if field.dtype.kind != "f":
        return int_texts(field)
    import numpy as np

    text = float_texts(field)
    for i in np.isnan(field).nonzero()[0].tolist():
        text[i] = ""
    return text


def _row_texts(arrays: list) -> list[str]:
    """The rows of number columns of one kind, each row's fields joined by commas (as _column_texts
    would write each): one orjson call for the block; a row holding a number orjson writes in
    another notation (see float_texts) is written by repr."""
    import numpy as np

    kind = arrays[0].dtype.kind
    m = np.column_stack([np.asarray(a, np.float64 if kind == "f" else np.uint64 if kind == "u" else np.int64)
                         for a in arrays])
    rows = _orjson().dumps(m, option=_orjson().OPT_SERIALIZE_NUMPY)[2:-2].decode().split("],[")
    if kind == "f":
        a = np.abs(m)
        for r in np.flatnonzero((~((a >= 1e-4) & (a < 1e16)) & (m != 0)).any(axis=1)).tolist():
            rows[r] = ",".join("" if x != x else repr(x) for x in m[r].tolist())
    return rows


def float_texts(arr: Any) -> list[str]:
    """repr of each number of a float array (as Python floats), written by orjson where it is installed:
    its shortest round-trip digits are repr's, ~10x faster; its notation differs only below 1e-4 and
    from 1e16 up (and for NaN and infinities), which are left to repr."""
    import numpy as np

    if _orjson() is None or arr.dtype.itemsize > 8 or arr.ndim != 1 or not len(arr):
        return list(map(repr, arr.tolist()))
    x = np.ascontiguousarray(arr, dtype=np.float64)
    text = _orjson().dumps(x, option=_orjson().OPT_SERIALIZE_NUMPY)[1:-1].decode().split(",")
    a = np.abs(x)
    for i in np.flatnonzero(~((a >= 1e-4) & (a < 1e16)) & (x != 0)).tolist():  # NaN too: its comparisons are False
        text[i] = repr(float(x[i]))
    return text


def int_texts(arr: Any) -> list[str]:
    """str of each number of an integer array (orjson where it is installed: the same digits)."""
    import numpy as np

    if _orjson() is None or arr.dtype.itemsize > 8 or arr.ndim != 1 or not len(arr):
        return list(map(str, arr.tolist()))
    x = np.ascontiguousarray(arr, dtype=np.uint64 if arr.dtype.kind == "u" else np.int64)
    return _orjson().dumps(x, option=_orjson().OPT_SERIALIZE_NUMPY)[1:-1].decode().split(",")


def _orjson() -> Any:
    """orjson, or None where it is not installed or writes these probes otherwise than repr and str
    (a version with another notation): then repr and str write the same text."""
    global _ORJSON
    if _ORJSON is False:
        try:
            import numpy as np
            import orjson

            probes = np.array(_PROBES)
            if orjson.dumps(probes, option=orjson.OPT_SERIALIZE_NUMPY) != repr(_PROBES).replace(" ", "").encode() or \
                    orjson.dumps(probes.astype(np.int64), option=orjson.OPT_SERIALIZE_NUMPY) != \
                    str([int(x) for x in _PROBES]).replace(" ", "").encode():
                orjson = None
        except ImportError:
            orjson = None
        _ORJSON = orjson
    return _ORJSON


_ORJSON: Any = False  # not looked for yet
#: Numbers in float_texts' range for orjson whose notation shows a difference from repr.
_PROBES = [0.0, -0.0, 1e-4, 0.00012345678901234567, 0.5, 1.0, -2.0, 100.0, 1 / 3, 2 / 3 * 1e5, 123456789.123,
           2.0 ** 53, 1e15, 123456789012345.6, 9999999999999998.0, -12345.678]


# What makes the csv module quote a field: the delimiter, the quote, a character of os.linesep.
_CSV_SPECIAL = re.compile("[" + re.escape(',"' + os.linesep) + "]")


def write_outputs(res: Any, row: Mapping[str, Any], out: Path, cfg: DictConfig,
                  latencies: Mapping[str, Any] | None = None) -> None:
    """The run's tables and summary.json; `latencies`: the requests' RequestResults, when the caller has them."""
    import numpy as np

    from varlen.metrics import kv_usage_columns, request_columns

    out.mkdir(parents=True, exist_ok=True)
    o = cfg.output
    if o.requests:
        cols = request_columns(res.requests, latencies)
        cols["replica"] = np.array([res.routed.get(r, np.nan) for r in cols["req_id"]])
        if hasattr(res, "decode_routed"):
            cols["decode_replica"] = np.array([res.decode_routed.get(r, np.nan) for r in cols["req_id"]])
        write_csv(cols, out / "requests.csv")
    kv: dict[str, list] = {}
    for rep in res.replicas:
        t = kv_usage_columns(rep.engine.steps, rep.engine.kv.capacity_tokens, o.kv_points)
        kv.setdefault("replica", []).append(np.full(len(t["time"]), rep.index, np.int64))
        for k, v in t.items():
            kv.setdefault(k, []).append(v)
    write_csv({k: np.concatenate(v) for k, v in kv.items()}, out / "kv_usage.csv")
    if o.steps:
        from sim import steps_csv

        for k, rep in enumerate(res.replicas):
            log = rep.engine.steps
            if log.keep:  # kept whole (token-level output): its rows now
                steps_csv.sink(out, k, bool(o.step_detail), rep.index)(log.entries)
            else:  # streamed as the run went: the rest
                log.flush()
        steps_csv.join(out, len(res.replicas), bool(o.step_detail), out / "steps.csv")
    if o.get("timeline"):
        from varlen.timeline import write_timeline

        P = getattr(res, "num_prefill", None)  # disaggregated: the prefill instances, then the decode ones
        names = [f"replica {r.index}" if P is None else f"prefill {i}" if i < P else f"decode {i - P}"
                 for i, r in enumerate(res.replicas)]
        write_timeline(out / "timeline.json", [(n, r.engine.steps, r.engine.kv.capacity_tokens)
                                               for n, r in zip(names, res.replicas)],
                       res.requests, res.routed, o.timeline_max_events, getattr(res, "transfers", ()))
    (out / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (out / "summary.json").write_text(json.dumps(dict(row), indent=2, default=str))  # last: marks a complete run


def _drop_step_parts(out: Path) -> None:
    """A run that stopped leaves no half-streamed steps.csv parts."""
    for part in out.glob(".steps-*.csv.part"):
        part.unlink(missing_ok=True)


def progress_settings(cfg: DictConfig) -> dict[str, Any]:
    """sim.progress.showing's arguments from the `progress` settings."""
    enabled = OmegaConf.select(cfg, "progress.enabled", default=True)
    if not isinstance(enabled, bool):
        raise SettingError(f"progress.enabled={enabled!r}: give true or false")
    interval = number(cfg, "progress.interval_s", low=0, optional=True,
                      hint=" (seconds between progress lines when not on a terminal, e.g. 5)")
    return dict(enabled=enabled, interval_s=5.0 if interval is None else interval)


def format_row(row: Mapping[str, Any]) -> str:
    ms = lambda k: f"{row[k] * 1e3:.0f}" if row.get(k) == row.get(k) else "nan"  # noqa: E731
    s = (f"{row.get('scheduler')}/{row.get('allocator')} @ {row['rate']:.3g} req/s: "
         f"{row['finished']}/{row['requests']} finished, {row['requests_per_s']:.3g} req/s, "
         f"{row['output_tokens_per_s']:.4g} tok/s, TTFT p50/p90 {ms('ttft_p50')}/{ms('ttft_p90')} ms, "
         f"TPOT p50/p90 {ms('tpot_p50')}/{ms('tpot_p90')} ms, mean batch {row['mean_batch_size']:.1f}, "
         f"peak KV {row['peak_kv_usage']:.0%}, preemptions {row['preemptions']}")
    if "slo_attainment" in row:
        s += f", SLO attainment {row['slo_attainment']:.1%}"
    if row.get("prefix_caching"):
        s += f", prefix hit rate {row['prefix_hit_rate']:.1%}"
    return s + (f"\n  simulated {row['requests']} requests, {row['steps']} steps in {row['sim_wall_s']:.2f} s "
                f"({row['sim_requests_per_wall_s']:.0f} requests/s of wall time)")


@hydra.main(config_path=CONF, config_name="run", version_base="1.3")
def main(cfg: DictConfig) -> float:
    import time

    if not gc.isenabled():  # off while a single run started (the top of this module): the start-up's
        gc.freeze()  # objects live to the end, so no collector pass need walk them (as sim.simulator.gc_paused)
        atexit.register(gc.unfreeze)
        gc.enable()

    from hydra.core.hydra_config import HydraConfig

    from sim.progress import showing
    from varlen.cli import errors_to_exit, fail, interrupted

    out = Path(HydraConfig.get().runtime.output_dir)
    t0 = time.perf_counter()
    try:
        with showing(**progress_settings(cfg)):
            res, row, latencies = _simulate_paused(cfg, hydra_labels(), announce=True,
                                                   steps_to=out if cfg.output.steps else None)
    except errors_to_exit() as err:
        _drop_step_parts(out)
        fail(str(err))
    except KeyboardInterrupt:
        _drop_step_parts(out)
        interrupted(f"simulation stopped after {time.perf_counter() - t0:.1f} s; no results written to {out}")
    try:
        write_outputs(res, row, out, cfg, latencies)
    except KeyboardInterrupt:
        interrupted(f"while writing {out}: its tables may be incomplete (summary.json is written last)")
    print(format_row(row))
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.RUN:
        _KEEP_UNTIL_EXIT.append((res, latencies))
    from varlen.compiled import status

    print(f"scheduling core: {status()}")
    print(f"written to {out}")
    return float(row.get("goodput_requests_per_s", row["requests_per_s"]))


def _skip_mode_probe(argv: list[str]) -> None:
    """Answer Hydra's first composition (only to read `hydra.mode`, which no config of this command
    sets) without composing, unless the command line could set it."""
    from hydra._internal.hydra import Hydra

    for a in argv[1:]:
        key = a.split("=", 1)[0].lstrip("+~")
        if (a.startswith(("--config", "-c")) or "hydra.mode" in a or key.startswith("hydra")
                and not key.startswith(("hydra.run.", "hydra.sweep.", "hydra.job.", "hydra.launcher."))):
            return
    if callable(getattr(Hydra, "get_mode", None)):
        Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]


def _libyaml_loader() -> None:
    """OmegaConf (so Hydra's composition and every OmegaConf.load) parses yaml with libyaml's C
    parser where PyYAML has it: OmegaConf's own loader class (its float resolver, no timestamps,
    duplicate keys refused) over the C parser, built once; the same values, parsed ~10x faster."""
    import yaml
    from omegaconf import _utils

    if not getattr(yaml, "__with_libyaml__", False) or getattr(_utils.get_yaml_loader, "libyaml", False):
        return
    import yaml.cyaml

    omegaconf_loader = _utils.get_yaml_loader()

    class Loader(yaml.cyaml.CParser, omegaconf_loader):  # type: ignore[misc, valid-type]
        def __init__(self, stream: Any) -> None:  # as yaml.CSafeLoader: the C parser, then the Python constructor
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    def get_yaml_loader() -> Any:
        return Loader

    get_yaml_loader.libyaml = True  # type: ignore[attr-defined]
    _utils.get_yaml_loader = get_yaml_loader
    _libyaml_dumper()


def _libyaml_dumper() -> None:
    """OmegaConf.to_yaml (Hydra's .hydra/*.yaml, config_resolved.yaml) writes through libyaml's C
    emitter with OmegaConf's own representers: the same text, faster. Not where a string holds a
    character beyond the Basic Multilingual Plane, which libyaml escapes and PyYAML writes as it is."""
    import json

    import yaml
    import yaml.cyaml
    from omegaconf import _utils

    if not getattr(yaml, "__with_libyaml__", False) or getattr(OmegaConf.to_yaml, "libyaml", False):
        return
    to_yaml = OmegaConf.to_yaml

    class Dumper(yaml.cyaml.CEmitter, _utils.get_omega_conf_dumper()):  # type: ignore[misc]
        def __init__(self, stream: Any, default_style: Any = None, default_flow_style: Any = False,
                     canonical: Any = None, indent: Any = None, width: Any = None, allow_unicode: Any = None,
                     line_break: Any = None, encoding: Any = None, explicit_start: Any = None,
                     explicit_end: Any = None, version: Any = None, tags: Any = None, sort_keys: bool = True) -> None:
            # As yaml.CDumper: the C emitter, then the Python representer (OmegaConf's) and resolver.
            yaml.cyaml.CEmitter.__init__(self, stream, canonical=canonical, indent=indent, width=width,
                                         encoding=encoding, allow_unicode=allow_unicode, line_break=line_break,
                                         explicit_start=explicit_start, explicit_end=explicit_end, version=version,
                                         tags=tags)
            yaml.representer.Representer.__init__(self, default_style=default_style,
                                                  default_flow_style=default_flow_style, sort_keys=sort_keys)
            yaml.resolver.Resolver.__init__(self)

    beyond_bmp = re.compile("[\U00010000-\U0010ffff]")

    def libyaml_to_yaml(cfg: Any, *, resolve: bool = False, sort_keys: bool = False) -> str:
        # OmegaConf.to_yaml's own steps, with the C emitter where it writes the same text.
        container = OmegaConf.to_container(_utils._ensure_container(cfg), resolve=resolve, enum_to_str=True)
        try:
            plain = not beyond_bmp.search(json.dumps(container, ensure_ascii=False))
        except (TypeError, ValueError):  # bytes, paths: not JSON; left to OmegaConf
            plain = False
        if not plain:
            return to_yaml(cfg, resolve=resolve, sort_keys=sort_keys)
        return yaml.dump(container, default_flow_style=False, allow_unicode=True, sort_keys=sort_keys, Dumper=Dumper)

    libyaml_to_yaml.libyaml = True  # type: ignore[attr-defined]
    libyaml_to_yaml.pyyaml = to_yaml  # type: ignore[attr-defined]  # OmegaConf's own
    OmegaConf.to_yaml = staticmethod(libyaml_to_yaml)  # type: ignore[method-assign, assignment]


#: Launcher plug-ins a single run never starts, whose import Hydra's plug-in scan would pay for.
_UNUSED_LAUNCHERS = ("hydra_plugins.hydra_ray_launcher.",)


def _skip_unused_launchers(argv: list[str]) -> None:
    """A single run starts no launcher: Hydra's plug-in scan leaves out the Ray launcher's modules
    (their import registers large structured configs) unless the command line names a launcher,
    asks Hydra for information (--info) or is a sweep."""
    import pkgutil

    from hydra.core.plugins import Plugins

    if any(a in ("-m", "--multirun") or a.startswith("--info") or "launcher" in a for a in argv[1:]):
        return
    scan = Plugins._scan_all_plugins
    walk = pkgutil.walk_packages

    def walk_used(*args: Any, **kwargs: Any) -> Any:
        return (m for m in walk(*args, **kwargs) if not m.name.startswith(_UNUSED_LAUNCHERS))

    def scan_used(modules: list[Any]) -> Any:
        pkgutil.walk_packages = walk_used  # type: ignore[assignment]
        try:
            return scan(modules)
        finally:
            pkgutil.walk_packages = walk

    Plugins._scan_all_plugins = staticmethod(scan_used)  # type: ignore[method-assign]


#: A single run's results, kept alive when main returns: _exit_now leaves without freeing them.
_KEEP_UNTIL_EXIT: list[Any] = []


def _exit_now() -> None:
    """After a single run, leave without the interpreter's teardown; a sweep leaves normally."""
    import logging
    import os
    import sys

    if "-m" in sys.argv[1:] or "--multirun" in sys.argv[1:]:
        return
    cells = sys.modules.get("sim.cells")  # only it starts a Ray instance
    if cells is not None:
        cells.stop_ray()  # os._exit skips the atexit hook that would stop a Ray instance cells started
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    import sys

    from varlen.cli import run_cli

    _skip_mode_probe(sys.argv)
    _skip_unused_launchers(sys.argv)
    _libyaml_loader()
    run_cli(main)
    _exit_now()
