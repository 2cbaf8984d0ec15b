"""`cluster.cells=N`: a fleet of N independent cells behind a front door, simulated one after
another in this process (`cluster.cells_on=local`) or as Ray tasks (`cluster.cells_on=ray`), merged
into one result (docs/decisions/cells.md).

The front door is state-free: a request's cell is a function of the request and its position in
the trace alone (`front_door`), so every cell process loads the same trace description, keeps its
own share, and runs the ordinary single-fleet simulation (`sim.run`) on it: its own router and
`cluster.replicas` replicas (or its own prefill and decode pools). A cell sends back columns: its
requests' `RequestResults` (per request its times, counts and latencies; the inter-token gaps as
one exact value -> count table), disaggregated cells also each request's decode instance, the
transfers' times and bytes and the prefill prefix hits; or, with token-level output
(`output.token_times=true`), per request its times and counts and its token times as one flat
array; per replica the step columns. Each cell's output is merged into the fleet's columns as the
cell ends and dropped (`Merge`). The merged summary is `varlen.metrics.summarize` over the merged
requests and steps, the very function a single run's summary comes from; nothing is averaged per cell.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from varlen.cli import SettingError, number
from varlen.metrics import RequestResults
from varlen.steplog import StepLog

CELLS_ON = ("local", "ray")
#: sim.run's single-fleet simulation, (cfg, labels, announce) -> (result, summary row, latencies).
SimulateOne = Callable[[DictConfig, "Mapping[str, Any] | None", bool], Any]
RAY_HINT = "install the cluster extra (pip install -e '.[cluster]'; scripts/setup.sh does), or use cluster.cells_on=local"


def check_cells(cfg: DictConfig) -> None:
    """cluster.cells, cells_on, cell_key_blocks (one-line errors); cells > requests is found when
    the trace is loaded (cell_requests)."""
    cells = number(cfg, "cluster.cells", low=1, integer=True, hint=" (independent cells of cluster.replicas each; 1: one fleet)")
    on = OmegaConf.select(cfg, "cluster.cells_on", default="local")
    if on not in CELLS_ON:
        raise SettingError(f"cluster.cells_on={on!r} is unknown; choose local (one process) or ray (Ray tasks)")
    number(cfg, "cluster.cell_key_blocks", low=1, integer=True,
           hint=" (leading prefix hash ids that name a request's cell, e.g. 2)")
    if cells == 1:
        return
    if on == "ray" and importlib.util.find_spec("ray") is None:
        raise SettingError(f"cluster.cells_on=ray needs Ray, which is not installed: {RAY_HINT}")
    if OmegaConf.select(cfg, "output.timeline"):
        raise SettingError(f"output.timeline=true draws one fleet; with cluster.cells={cells} set output.timeline=false "
                           "(or simulate one cell: cluster.cells=1)")


def cells_of(cfg: DictConfig) -> int:
    """The number of cells `cfg` asks for (1 where a config has no cluster.cells)."""
    return int(OmegaConf.select(cfg, "cluster.cells", default=1) or 1)


# ---------------------------------------------------------------------------------------------
# The front door


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M64 = (1 << 64) - 1


def front_door(trace: Any, cells: int, key_blocks: int = 2) -> np.ndarray:
    """Each request's cell (int64 array): a hash of its first `key_blocks` prefix hash ids
    (Mooncake's hash_ids), so requests sharing that prefix share a cell and its prefix caches; a
    request with fewer ids (or a trace without them: Azure, synthetic) goes by its position in the
    trace, round-robin. Depends on nothing but the request and its position: state-free."""
    from varlen.traces.tokens import _mix  # the traces' 64-bit mixer: one home for it

    n = len(trace)
    cell = np.arange(n, dtype=np.int64) % cells
    keyed = [i for i, tr in enumerate(trace.requests) if tr.hash_ids is not None and len(tr.hash_ids) >= key_blocks]
    if keyed:
        ids = np.array([[h & _M64 for h in trace.requests[i].hash_ids[:key_blocks]] for i in keyed], np.uint64)
        h = np.zeros(len(keyed), np.uint64)
        for j in range(key_blocks):
            h = _mix(h * _GOLDEN + ids[:, j])
        cell[np.array(keyed, np.int64)] = (h % np.uint64(cells)).astype(np.int64)
    return cell


@dataclass
class _Share:
    cell: int
    cells: int
    key_blocks: int
    positions: np.ndarray | None = None  # set once the trace is loaded: the cell's requests in the trace
    total: int = 0  # the whole trace's requests


_sharing: list[_Share] = []  # set while this process simulates one cell


@contextmanager
def _one_cell(share: _Share) -> Iterator[_Share]:
    _sharing.append(share)
    try:
        yield share
    finally:
        _sharing.pop()


def cell_requests(trace: Any, build: Callable[[Any], list]) -> list:
    """build(trace): the requests of the whole trace, or, while a cell is simulated, of the cell's
    share only, named as the whole trace names them (ids by position where the trace has none)."""
    if not _sharing:
        return build(trace)
    s = _sharing[-1]
    if s.cells > len(trace):
        raise SettingError(f"cluster.cells={s.cells} is more than the workload's {len(trace)} requests: "
                           f"lower cluster.cells (each cell needs a request) or raise workload.limit")
    pos = np.flatnonzero(front_door(trace, s.cells, s.key_blocks) == s.cell)
    if not len(pos):
        raise SettingError(f"cluster.cells={s.cells}: the front door sends no request to cell {s.cell} (requests "
                           f"sharing their first {s.key_blocks} prefix hash ids share a cell); lower cluster.cells "
                           f"or raise cluster.cell_key_blocks")
    s.positions, s.total = pos, len(trace)
    reqs = build(dataclasses.replace(trace, requests=[trace.requests[i] for i in pos.tolist()]))
    for r, i in zip(reqs, pos.tolist()):
        if trace.requests[i].req_id is None:
            r.req_id = str(i)  # the id a whole-trace run gives it (its position)
    return reqs


# ---------------------------------------------------------------------------------------------
# What a cell sends back, and what the merge rebuilds from it


_STEP_COLUMNS = ("start", "duration", "num_seqs", "kv_reserved_slots", "kv_live_tokens", "num_waiting")


def _step_columns(log: StepLog) -> dict[str, np.ndarray]:
    """What the metrics read of a replica's steps (what crosses from a cell unless steps.csv is asked for)."""
    c = log.columns(tokens=False)
    return {k: c[k] for k in _STEP_COLUMNS}


def _portable_log(log: StepLog) -> list[tuple]:
    """A replica's steps as plain tuples, (is a DecodeRun, its fields...): compiled records do not
    pickle. Sent only when steps.csv is asked for."""
    from varlen.steplog import DecodeRun

    return [(isinstance(e, DecodeRun), *(getattr(e, f.name) for f in dataclasses.fields(type(e)))) for e in log.entries]


def _rebuilt_log(entries: Sequence[tuple]) -> StepLog:
    from varlen.steplog import DecodeRun, StepRecord

    return StepLog(DecodeRun(*e[1:]) if e[0] else StepRecord(*e[1:]) for e in entries)


def _column_log(c: Mapping[str, np.ndarray]) -> StepLog:
    """A StepLog(keep=False) whose columns(tokens=False) are `c` itself: what a replica's log keeps
    without records (no object per step: a fleet's merged steps cost their columns only)."""
    log = StepLog(keep=False)
    log._chunks = [{k: c[k] for k in _STEP_COLUMNS}]  # as StepLog.concat fills one: its folded columns
    log._len = len(c["start"])
    return log


@dataclass(slots=True, eq=False)
class RequestRecord:
    """A finished simulation's request as the metrics and tables read it (varlen.request.Request's
    fields of the same names)."""

    req_id: str
    arrival: float
    first_scheduled: float | None
    finish_time: float | None
    finish_reason: Any
    finish_message: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    priority: int
    token_times: list[float]


@dataclass(slots=True)
class _Kv:
    capacity_tokens: int


@dataclass(slots=True)
class _Engine:
    steps: StepLog
    kv: _Kv


@dataclass(slots=True)
class _Clock:
    t: float

    def now(self) -> float:
        return self.t


@dataclass(slots=True)
class ReplicaRecord:
    """A simulated replica as the output writers read it: its index in the fleet, steps, pool, clock."""

    index: int
    engine: _Engine
    clock: _Clock


@dataclass
class CellOutput:
    """One cell's result, in arrays (cheap to send between processes)."""

    cell: int
    positions: np.ndarray  # each request's index in the whole trace
    columns: dict[str, Any]  # per request (see _pack; only `replica` where `results` is set)
    token_times: np.ndarray  # every request's token times, end to end (empty where `results` is set)
    token_counts: np.ndarray
    replicas: list[tuple[int, Any, int, float]]  # (index in the cell, steps as tuples or columns, KV pool tokens, clock)
    row: dict[str, Any]
    num_steps: int
    wall_s: float
    num_prefill: int | None = None  # disaggregated: the first num_prefill replicas are prefill instances
    transfers: dict[str, np.ndarray] | None = None
    prefill_hit_tokens: np.ndarray | None = None
    results: RequestResults | None = None  # the requests' figures as columns, without token times
    total: int = 0  # the whole trace's requests (the merge's rows)


_REASONS = ("length", "stop", "aborted", "rejected")


def _pack(cell: int, positions: np.ndarray, res: Any, row: dict[str, Any], full_steps: bool,
          results: RequestResults | None = None) -> CellOutput:
    """Cell `cell`'s CellOutput. results: its requests' RequestResults, sent instead of every token time
    (a colocated run without token-level output keeps only those: res.requests)."""
    replicas = [(r.index, _portable_log(r.engine.steps) if full_steps else _step_columns(r.engine.steps),
                 r.engine.kv.capacity_tokens, r.clock.now()) for r in res.replicas]
    reqs = res.requests
    if isinstance(reqs, RequestResults):
        results = reqs
    if results is not None:  # no token-level output: the columns, as the run kept them
        results.itl.table()  # the buffered gaps folded: one table crosses
        routed = np.array([res.routed.get(r, -1) for r in results.req_id], np.int64)
        out = CellOutput(cell, positions, dict(replica=routed), np.empty(0, np.float64), np.empty(0, np.int64),
                         replicas, row, res.num_steps, res.wall_s, results=results)
        _pack_pools(out, res, results.req_id)
        return out
    nan = float("nan")
    code = {r: i for i, r in enumerate(_REASONS)}
    cols: dict[str, Any] = dict(
        req_id=[r.req_id for r in reqs],
        arrival=np.array([r.arrival for r in reqs], np.float64),
        first_scheduled=np.array([nan if r.first_scheduled is None else r.first_scheduled for r in reqs], np.float64),
        finish_time=np.array([nan if r.finish_time is None else r.finish_time for r in reqs], np.float64),
        finish_reason=np.array([-1 if r.finish_reason is None else code[r.finish_reason.value] for r in reqs], np.int8),
        finish_message=[r.finish_message for r in reqs],
        num_prompt_tokens=np.array([r.num_prompt_tokens for r in reqs], np.int64),
        num_output_tokens=np.array([r.num_output_tokens for r in reqs], np.int64),
        num_preemptions=np.array([r.num_preemptions for r in reqs], np.int64),
        num_prefix_hit_tokens=np.array([r.num_prefix_hit_tokens for r in reqs], np.int64),
        priority=np.array([r.priority for r in reqs], np.int64),
        replica=np.array([res.routed.get(r.req_id, -1) for r in reqs], np.int64))
    counts = np.fromiter((len(r.token_times) for r in reqs), np.int64, len(reqs))
    flat = np.fromiter((t for r in reqs for t in r.token_times), np.float64, int(counts.sum()))
    out = CellOutput(cell, positions, cols, flat, counts, replicas, row, res.num_steps, res.wall_s)
    _pack_pools(out, res, cols["req_id"])
    return out


def _pack_pools(out: CellOutput, res: Any, req_ids: Sequence[str]) -> None:
    """A disaggregated cell's own figures into `out`: each request's decode instance, the transfers, the
    prefill instances' prefix hits (nothing for a colocated cell)."""
    if not hasattr(res, "decode_routed"):
        return
    out.columns["decode_replica"] = np.array([res.decode_routed.get(r, -1) for r in req_ids], np.int64)
    out.num_prefill = res.num_prefill
    tr = res.transfers
    out.transfers = {k: np.array([getattr(x, k) for x in tr], np.float64) for k in ("ready", "start", "end", "bytes")}
    out.prefill_hit_tokens = np.array([res.prefill_hit_tokens.get(r, 0) for r in req_ids], np.int64)


def run_cell(config: dict[str, Any], cell: int, labels: Mapping[str, Any] | None, simulate_one: SimulateOne,
             board: Any = None, interval_s: float = 5.0) -> CellOutput | str:
    """Simulate cell `cell` of config's cluster.cells (a resolved config as a plain dict) with
    simulate_one (sim.run's single-fleet simulation): its CellOutput, or the one-line message of a
    bad setting or input. board: a Ray actor the cell reports its progress to every interval_s (_Board)."""
    from sim.progress import showing
    from varlen.cli import errors_to_exit

    cfg = OmegaConf.create(config)
    cells, key_blocks = cells_of(cfg), int(OmegaConf.select(cfg, "cluster.cell_key_blocks", default=2))
    cfg.cluster.cells = 1  # the cell itself is one fleet
    sink = None if board is None else (lambda t, done, total: board.report.remote(cell, t, done, total))
    try:
        with _one_cell(_Share(cell, cells, key_blocks)) as share, \
                showing(interval_s, enabled=sink is not None, sink=sink):
            res, row, results = simulate_one(cfg, labels, False)
    except errors_to_exit() as err:
        return str(err)
    assert share.positions is not None
    # A disaggregated run keeps its Requests whatever the output: without token-level output the cell sends
    # their RequestResults, as a colocated cell does (a timeline is refused with cells, so token_times decides).
    tokens = bool(OmegaConf.select(cfg, "output.token_times", default=False))
    out = _pack(cell, share.positions, res, row, bool(OmegaConf.select(cfg, "output.steps")),
                None if tokens else results)
    out.total = share.total
    return out


# ---------------------------------------------------------------------------------------------
# The merge


@dataclass
class CellsResult:
    """SimResult's interface over every cell's replicas (cell c's replica k is replica c·R + k,
    R replicas per cell, disaggregated: its P prefill then its decode instances), requests in trace order."""

    requests: list[RequestRecord] | RequestResults  # RequestResults: cells without token-level output
    replicas: list[ReplicaRecord]
    wall_s: float
    replica_of: np.ndarray  # each request's replica in the fleet, in trace order (-1: never routed)
    num_steps: int
    cells: int
    steps_of: list[ReplicaRecord]  # the replicas whose steps the summary reads (disaggregated: decode)
    total_slots: int
    decode_replica_of: np.ndarray | None = None  # disaggregated: each request's decode instance (-1: none)
    prefill: list[ReplicaRecord] = field(default_factory=list)
    decode: list[ReplicaRecord] = field(default_factory=list)
    transfers: list[Any] = field(default_factory=list)
    prefill_hits: np.ndarray | None = None  # disaggregated: each request's prefix hit tokens at prefill

    @property
    def steps(self) -> StepLog:
        return StepLog.concat(r.engine.steps for r in self.steps_of)

    @property
    def results(self) -> RequestResults:
        """Every request's figures as columns (the summary's and requests.csv's input)."""
        from varlen.metrics import results_of

        return results_of(self.requests)

    def _by_id(self, column: np.ndarray, every: bool = False) -> dict[str, int]:
        # Built when read (requests.csv), not held beside the columns: a dict a request is the bulk of a
        # large fleet's merged result.
        ids = self.requests.req_id if isinstance(self.requests, RequestResults) else [r.req_id for r in self.requests]
        return {rid: v for rid, v in zip(ids, column.tolist()) if every or v >= 0}

    @property
    def routed(self) -> dict[str, int]:
        """req_id -> replica in the fleet, as SimResult.routed (built on each read)."""
        return self._by_id(self.replica_of)

    @property
    def decode_routed(self) -> dict[str, int]:
        """Disaggregated: req_id -> decode instance (write_outputs asks hasattr: only such a fleet has one)."""
        if self.decode_replica_of is None:
            raise AttributeError("decode_routed")
        return self._by_id(self.decode_replica_of)

    @property
    def prefill_hit_tokens(self) -> dict[str, int]:
        """Disaggregated: req_id -> prefix hit tokens at its prefill instance (empty for a colocated fleet)."""
        return {} if self.prefill_hits is None else self._by_id(self.prefill_hits, every=True)


@dataclass(slots=True)
class _Transfer:
    ready: float
    start: float
    end: float
    bytes: float


class Merge:
    """The cells' results as one fleet's, built cell by cell: add() places a cell's requests into the
    fleet's columns (trace order) as the cell ends, in whatever order cells end, so that its CellOutput
    can be dropped at once: the fleet never holds more than one cell's output beside its own columns.
    Replicas are numbered cell by cell and listed in cell order, whatever order the cells came in."""

    def __init__(self) -> None:
        self.n: int | None = None
        self.columns: bool | None = None  # the cells sent RequestResults (not token times)
        self.disagg: bool | None = None
        self.requests: Any = None  # RequestResults, or a list of RequestRecords in trace order
        self.replica_of = self.decode_of = self.hits = self.covered = np.empty(0, np.int64)
        self.parts: dict[int, tuple[list[ReplicaRecord], int, list[_Transfer], dict[str, Any], int]] = {}

    def _start(self, o: CellOutput) -> None:
        n = o.total
        self.n, self.columns, self.disagg = n, o.results is not None, o.num_prefill is not None
        self.requests = RequestResults(n) if self.columns else [None] * n
        self.replica_of = np.full(n, -1, np.int64)
        if self.disagg:
            self.decode_of, self.hits = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        self.covered = np.zeros(n, bool)

    def add(self, o: CellOutput) -> None:
        """Cell o's result into the fleet's; nothing of `o` is kept but its replicas' step columns (or
        steps), its transfers and its summary row."""
        if self.n is None:
            self._start(o)
        pos = o.positions
        if (o.total != self.n or o.cell in self.parts or (len(pos) and (pos.min() < 0 or pos.max() >= o.total))
                or self.covered[pos].any() or len(np.unique(pos)) != len(pos)):
            raise RuntimeError("the cells' shares of the trace do not cover it exactly once (front door differs "
                               "between cells)")
        if (o.results is not None) != self.columns or (o.num_prefill is not None) != self.disagg:
            raise RuntimeError(f"cell {o.cell} sent another kind of result than the cells before it")
        self.covered[pos] = True
        c, R = o.columns, len(o.replicas)
        rep = c["replica"]
        self.replica_of[pos] = np.where(rep >= 0, o.cell * R + rep, -1)
        if o.results is not None:
            self.requests.place(o.results, pos)
        else:
            _records(o, self.requests)
        reps = [ReplicaRecord(o.cell * R + i, _Engine(_rebuilt_log(log) if isinstance(log, list) else _column_log(log),
                                                      _Kv(cap)), _Clock(now)) for i, log, cap, now in o.replicas]
        transfers: list[_Transfer] = []
        if self.disagg:
            d = c["decode_replica"]  # an instance's index in the cell, as routed's: prefill 0..P-1, decode P..R-1
            self.decode_of[pos] = np.where(d >= 0, o.cell * R + d, -1)
            assert o.transfers is not None and o.prefill_hit_tokens is not None
            self.hits[pos] = o.prefill_hit_tokens
            t = o.transfers
            transfers = [_Transfer(*x) for x in zip(t["ready"].tolist(), t["start"].tolist(), t["end"].tolist(),
                                                    t["bytes"].tolist())]
        self.parts[o.cell] = (reps, o.num_prefill or 0, transfers, o.row, o.num_steps)

    def rows(self) -> list[dict[str, Any]]:
        """The cells' summary rows, in cell order."""
        return [self.parts[k][3] for k in sorted(self.parts)]

    def result(self, wall_s: float) -> CellsResult:
        if self.n is None or not self.covered.all():
            raise RuntimeError("the cells' shares of the trace do not cover it exactly once (front door differs "
                               "between cells)")
        replicas: list[ReplicaRecord] = []
        prefill: list[ReplicaRecord] = []
        decode: list[ReplicaRecord] = []
        transfers: list[_Transfer] = []
        for k in sorted(self.parts):
            reps, P, tr, _, _ = self.parts[k]
            replicas += reps
            if self.disagg:
                prefill += reps[:P]
                decode += reps[P:]
                transfers += tr
        steps_of = decode if self.disagg else replicas
        total_slots = steps_of[0].engine.kv.capacity_tokens
        return CellsResult(self.requests, replicas, wall_s, self.replica_of, sum(p[4] for p in self.parts.values()),
                           len(self.parts), steps_of, total_slots, self.decode_of if self.disagg else None,
                           prefill, decode, transfers, self.hits if self.disagg else None)


def _records(o: CellOutput, records: list) -> None:
    """Cell o's requests rebuilt from their columns and token times, each into its trace position."""
    from varlen.request import FinishReason

    reasons = [FinishReason(r) for r in _REASONS]
    c = o.columns
    times = o.token_times.tolist()
    ends = np.cumsum(o.token_counts).tolist()
    lists = [c[k].tolist() if isinstance(c[k], np.ndarray) else c[k] for k in
             ("req_id", "arrival", "first_scheduled", "finish_time", "finish_reason", "finish_message",
              "num_prompt_tokens", "num_output_tokens", "num_preemptions", "num_prefix_hit_tokens", "priority")]
    start, where = 0, o.positions.tolist()
    for j, (rid, arr, fs, fin, why, msg, npr, nout, npre, nhit, prio) in enumerate(zip(*lists)):
        end = ends[j]
        records[where[j]] = RequestRecord(
            rid, arr, None if fs != fs else fs, None if fin != fin else fin, None if why < 0 else reasons[why],
            msg, npr, nout, npre, nhit, prio, times[start:end])
        start = end


def merged_row(res: CellsResult, rows: Sequence[Mapping[str, Any]],
               slo: Mapping[str, Any]) -> tuple[dict[str, Any], RequestResults]:
    """(summary row, the requests' RequestResults) of the merged fleet: its figures computed from the merged
    requests and steps exactly as a single run's; the run's settings and trace figures as any
    cell's (they describe the whole trace); counts of replicas, GPUs and steps summed."""
    from sim.headline import prefix_hit_rate
    from varlen.metrics import summarize

    row = dict(rows[0])  # a single run's keys, in its order
    per_cell = row["replicas"]
    results = res.results  # RequestRecords carry the fields of a Request the metrics read
    row.update(summarize(results, res.steps, res.total_slots, slo["ttft_s"], slo["tpot_s"], slo.get("tbt_s")))
    row.update(replicas=sum(r["replicas"] for r in rows), gpus=sum(r["gpus"] for r in rows))
    if row.get("mode") == "disaggregated":
        from sim.cluster import cluster_figures

        row.update(cluster_figures(res))
    else:
        row["prefix_hit_rate"] = prefix_hit_rate(results)
    n = len(results)
    row.update(steps=res.num_steps, sim_wall_s=res.wall_s, sim_requests_per_wall_s=n / max(res.wall_s, 1e-9),
               sim_time_s=max(r["sim_time_s"] for r in rows), cells=res.cells, replicas_per_cell=per_cell)
    return row, results


# ---------------------------------------------------------------------------------------------
# Running the cells


def simulate_cells(cfg: DictConfig, labels: Mapping[str, Any] | None, announce: bool,
                   simulate_one: SimulateOne, cost_notes: Sequence[str] = ()
                   ) -> tuple[CellsResult, dict[str, Any], dict[str, Any]]:
    """sim.run's (result, summary row, latencies) for a fleet of cluster.cells cells, each simulated
    by simulate_one (handed in by sim.run, which dispatches here: no import back); cost_notes: the
    cost model's parts not from measurements, named in the headline."""
    from types import SimpleNamespace

    from sim.headline import LOSSY_KEYS, assumptions, lossy_line, not_measured_line, over_length_warning, trace_text

    cells = cells_of(cfg)
    on = OmegaConf.select(cfg, "cluster.cells_on", default="local")
    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    if announce:
        # No request count yet: each cell loads the trace where it runs and keeps its share.
        caching = bool(config["allocator"].get("enable_prefix_caching")) and bool(config["workload"].get("token_ids"))
        print(f"simulating {trace_text(config)} in {cells} cells on {on} (Ctrl-C stops); front door: "
              f"{door_text(config)}\n  each cell: {assumptions(config, labels, caching)}", flush=True)
        line = not_measured_line(config, cost_notes)
        if line:
            print(line, flush=True)
    if on == "ray":
        _ray_init(config)  # before the clock starts: a capacity search starts Ray once for all its probes
    t0 = time.perf_counter()
    merged = Merge()  # each cell's output placed as it ends, then dropped
    bad = (_run_ray if on == "ray" else _run_local)(config, cells, labels, simulate_one, merged)
    wall = time.perf_counter() - t0
    if bad:
        raise SettingError(bad)
    res = merged.result(wall)
    row, latencies = merged_row(res, merged.rows(), config["slo"])
    if announce:
        stats = SimpleNamespace(**{k: row[f"trace_{k}"] for k in LOSSY_KEYS})
        for line in (lossy_line(stats), over_length_warning(stats, config, row["trace_max_model_len"])):
            if line:
                print(line, flush=True)
    return res, row, latencies


def door_text(c: Mapping[str, Any]) -> str:
    """The front door's rule in words."""
    k = c["cluster"].get("cell_key_blocks", 2)
    return f"a hash of a request's first {k} prefix hash ids where it has them, else round-robin"


def _run_local(config: dict[str, Any], cells: int, labels: Mapping[str, Any] | None,
               simulate_one: SimulateOne, merged: Merge) -> str | None:
    """The cells one after another, each merged as it ends; the first bad setting's line, if any."""
    from sim.progress import labelled

    for k in range(cells):
        with labelled(f"cell {k + 1}/{cells}"):
            out = run_cell(config, k, labels, simulate_one)
        if isinstance(out, str):
            return out  # a bad setting is the same in every cell
        merged.add(out)
        del out
        gc.collect()  # the cell's engines, before the next cell's (the collector is paused while simulating)
    return None


_ray_started: list[bool] = []


def _ray_init(config: Mapping[str, Any]) -> Any:
    """Ray, connected: to `cluster.ray_address` (local: a new instance for this process, started
    once, its workers importing the same sim and varlen as this process)."""
    import ray

    if ray.is_initialized():
        return ray
    address = config["cluster"].get("ray_address") or "local"
    roots = [str(Path(__file__).resolve().parents[1])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw: dict[str, Any] = dict(address=address, include_dashboard=False, log_to_driver=True,
                              runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(roots),
                                                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    if address == "local" and config["cluster"].get("ray_num_cpus"):
        kw["num_cpus"] = int(config["cluster"]["ray_num_cpus"])
    ray.init(**kw)
    _ray_started.append(True)
    return ray


def stop_ray() -> None:
    """Stop the Ray instance this process started for its cells, if any."""
    if _ray_started:
        import ray

        ray.shutdown()
        _ray_started.clear()


class _Board:
    """A Ray actor: each cell's latest (simulated time, requests done, requests in the cell)."""

    def __init__(self) -> None:
        self.cells: dict[int, tuple[float, int, int]] = {}

    def report(self, cell: int, sim_time: float, done: int, total: int) -> None:
        self.cells[cell] = (sim_time, done, total)

    def read(self) -> dict[int, tuple[float, int, int]]:
        return self.cells


def fleet_line(label: str, cells: int, figures: Mapping[int, tuple[float, int, int]], finished: int,
               elapsed: float) -> str:
    """One progress line for all cells: figures, each reporting cell's (simulated s, done, total)."""
    from sim.progress import _duration

    done = sum(d for _, d, _ in figures.values())
    line = f"{label}: {finished}/{cells} cells finished, {done:,}"
    if len(figures) == cells:
        total = sum(n for _, _, n in figures.values())
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = _duration((total - done) / rate) if rate > 0 else "?"
        line += f"/{total:,} requests done ({done / max(total, 1):.0%})"
    else:
        eta = "?"
        line += f" requests done ({cells - len(figures)} of the cells yet to report)"
    t = min((t for t, _, _ in figures.values()), default=0.0)
    return (line + f", every cell simulated past {t:,.1f} s, elapsed {_duration(elapsed)}, ETA {eta}")


def _run_ray(config: dict[str, Any], cells: int, labels: Mapping[str, Any] | None,
             simulate_one: SimulateOne, merged: Merge) -> str | None:
    """The cells as Ray tasks, each merged as it ends (in any order) and its object released; the first
    bad setting's line (by cell), if any."""
    from sim.progress import settings as progress_settings

    ray = _ray_init(config)
    shown = progress_settings()
    interval = None if shown is None else max(shown.interval_s, 1.0)
    board = None if shown is None else ray.remote(num_cpus=0)(_Board).remote()
    task = ray.remote(num_cpus=1, max_retries=0)(run_cell)
    cfg_ref = ray.put(config)
    refs = [task.remote(cfg_ref, k, dict(labels) if labels else None, simulate_one, board, interval or 5.0)
            for k in range(cells)]
    t0 = time.monotonic()
    ended: dict[int, tuple[float, int, int] | None] = {}  # a finished cell's figures (None: a bad setting)
    bad: dict[int, str] = {}
    index = {r: k for k, r in enumerate(refs)}
    pending = refs
    del refs  # a cell's object leaves Ray's store once its last reference goes: `pending` and `index` hold them
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=interval)
        while ready:
            r = ready.pop()
            k = index.pop(r)
            # Owned copies: an array read from Ray's store (zero-copy) keeps the whole cell's object there.
            out = copy.deepcopy(ray.get(r))
            del r
            if isinstance(out, str):
                bad[k], ended[k] = out, None
            elif not bad:
                n = len(out.positions)
                ended[k] = (out.row["sim_time_s"], n, n)
                merged.add(out)
            del out
        if shown is not None and board is not None and pending:
            figures = dict(ray.get(board.read.remote()))
            figures.update({k: f for k, f in ended.items() if f is not None})
            stream = shown.stream if shown.stream is not None else sys.stderr
            print(fleet_line(shown.label, cells, figures, len(ended), time.monotonic() - t0), file=stream, flush=True)
    if board is not None:
        ray.kill(board)
    return bad[min(bad)] if bad else None
