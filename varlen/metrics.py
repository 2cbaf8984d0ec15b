"""Request and step metrics, shared by the real engine and the simulator. No torch; pandas is
imported only when a table is asked for, so the simulator starts fast."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from varlen.request import Request
from varlen.steplog import step_columns


@dataclass(slots=True)
class RequestMetrics:
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finish: float | None
    ttft: float | None  # arrival → first token
    tpot: float | None  # mean time per output token after the first
    e2e: float | None  # arrival → finish
    itl: list[float]  # gaps between consecutive tokens
    num_preemptions: int
    num_prefix_hit_tokens: int

    @classmethod
    def of(cls, r: Request) -> "RequestMetrics":
        t = r.token_times
        first = t[0] if t else None
        return cls(
            arrival=r.arrival, first_scheduled=r.first_scheduled, first_token=first, finish=r.finish_time,
            ttft=None if first is None else first - r.arrival,
            tpot=(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            e2e=None if r.finish_time is None else r.finish_time - r.arrival,
            itl=np.diff(t).tolist() if len(t) > 1 else [],
            num_preemptions=r.num_preemptions, num_prefix_hit_tokens=r.num_prefix_hit_tokens)


def request_columns(requests: Sequence[Request], latencies: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """request_table's columns (numpy arrays and lists), without pandas. `latencies`:
    request_latencies(requests), when the caller has it already (it is the costly part)."""
    lat = request_latencies(requests) if latencies is None else latencies
    out_tokens = np.array([r.num_output_tokens for r in requests], np.float64)
    first_scheduled = np.array([np.nan if r.first_scheduled is None else r.first_scheduled for r in requests],
                               np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        normalized = np.where(out_tokens > 0, lat["e2e"] / out_tokens, np.nan)
    return dict(
        req_id=[r.req_id for r in requests], prompt_tokens=[r.num_prompt_tokens for r in requests],
        output_tokens=[r.num_output_tokens for r in requests],
        finish_reason=[r.finish_reason.value if r.finish_reason else None for r in requests],
        finish_message=[r.finish_message for r in requests], arrival=lat["arrival"],
        first_scheduled=first_scheduled, scheduling_delay=first_scheduled - lat["arrival"],
        first_token=lat["first_token"], finish=lat["finish"], ttft=lat["ttft"], tpot=lat["tpot"], e2e=lat["e2e"],
        normalized_latency=normalized, max_tbt=lat["max_tbt"], num_preemptions=[r.num_preemptions for r in requests],
        prefix_hit_tokens=[r.num_prefix_hit_tokens for r in requests], priority=[r.priority for r in requests])


def request_table(requests: Iterable[Request], latencies: dict[str, np.ndarray] | None = None):
    """One row per request: lengths, how it ended, its times and latencies (see request_columns)."""
    import pandas as pd

    return pd.DataFrame(request_columns(list(requests), latencies))


def step_table(steps: Sequence, detail: bool = True) -> "pd.DataFrame":  # noqa: F821
    """One row per step; detail=False leaves out the per-request columns, the bulk of a long run's table."""
    import pandas as pd

    rows = []
    for s in steps:
        row = dict(
            step=s.step, start=s.start, duration=s.duration, num_seqs=len(s.req_ids),
            num_new_tokens=sum(s.new_tokens), num_cached_tokens=sum(s.cached_tokens),
            num_decodes=sum(1 for n in s.new_tokens if n == 1), num_preempted=s.num_preempted,
            kv_reserved_slots=s.kv_reserved_slots, kv_live_tokens=s.kv_live_tokens, num_waiting=s.num_waiting)
        if detail:
            row.update(req_ids=" ".join(s.req_ids), new_tokens=" ".join(map(str, s.new_tokens)),
                       cached_tokens=" ".join(map(str, s.cached_tokens)))
        rows.append(row)
    return pd.DataFrame(rows)


def kv_usage_columns(steps: Sequence, total_slots: int, max_points: int | None = 2000) -> dict[str, np.ndarray]:
    """KV utilisation at each step's end (reserved and live fractions of the pool, queue lengths);
    max_points thins a long run to every k-th step plus the peak."""
    c = step_columns(steps, tokens=False)
    cols = {
        "time": c["start"] + c["duration"],
        "kv_usage": c["kv_reserved_slots"] / total_slots,
        "kv_live": c["kv_live_tokens"] / total_slots,
        "batch_size": c["num_seqs"],
        "num_waiting": c["num_waiting"],
    }
    n = len(cols["time"])
    if max_points and n > max_points:
        keep = np.unique(np.append(np.arange(0, n, -(-n // max_points)), cols["kv_usage"].argmax()))
        cols = {k: v[keep] for k, v in cols.items()}
    return cols


def kv_usage_table(steps: Sequence, total_slots: int, max_points: int | None = 2000) -> "pd.DataFrame":  # noqa: F821
    """kv_usage_columns as a table."""
    import pandas as pd

    return pd.DataFrame(kv_usage_columns(steps, total_slots, max_points))


def _pcts(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    # One call for all: each call partitions the values anew.
    return [float(v) for v in np.percentile(x, qs)] if len(x) else [float("nan")] * len(qs)


def _time_weighted_kv(c: dict[str, np.ndarray], total_slots: int) -> float:
    """Reserved KV fraction averaged over busy time (each step weighs its duration)."""
    busy = float(c["duration"].sum())
    if busy <= 0 or total_slots <= 0:
        return 0.0
    return float(np.dot(c["kv_reserved_slots"], c["duration"])) / busy / total_slots


def request_latencies(reqs: Sequence[Request]) -> dict[str, np.ndarray]:
    """Per request: arrival, first_token, finish, ttft, tpot, e2e, max_tbt (longest gap; NaN where
    undefined), and all inter-token gaps as one array (itl). Costly on long runs: compute once and
    pass it to summarize and request_columns."""
    times = [r.token_times for r in reqs]
    lens = np.fromiter(map(len, times), np.int64, len(times))
    flat = np.fromiter(itertools.chain.from_iterable(times), np.float64, int(lens.sum()))
    first = np.cumsum(lens) - lens
    has, many = lens > 0, lens > 1
    arrival = np.array([r.arrival for r in reqs], np.float64)
    finish = np.array([np.nan if r.finish_time is None else r.finish_time for r in reqs], np.float64)
    first_token = np.full(len(reqs), np.nan)
    first_token[has] = flat[first[has]]
    tpot = np.full(len(reqs), np.nan)
    tpot[many] = (flat[first[many] + lens[many] - 1] - flat[first[many]]) / (lens[many] - 1)
    gaps = np.diff(flat)
    between = np.ones(len(gaps), bool)  # False where a gap spans two requests
    between[first[has & (first > 0)] - 1] = False
    itl = gaps[between]
    del gaps  # large on a long run
    # Each request's gaps lie end to end in itl: one reduceat gives each one's longest.
    max_tbt = np.full(len(reqs), np.nan)
    if many.any():
        ngaps = np.where(many, lens - 1, 0)
        max_tbt[many] = np.maximum.reduceat(itl, (np.cumsum(ngaps) - ngaps)[many])
    return dict(arrival=arrival, first_token=first_token, finish=finish, ttft=first_token - arrival, tpot=tpot,
                e2e=finish - arrival, itl=itl, max_tbt=max_tbt)


def summarize(requests: Sequence[Request], steps: Sequence, total_slots: int,
              ttft_slo: float | None = None, tpot_slo: float | None = None,
              tbt_slo: float | None = None, latencies: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """One row of headline figures: throughput, latency percentiles, preemptions, KV usage, goodput
    (requests meeting every SLO set; TBT: no single gap above it, so a stall fails it)."""
    c = step_columns(steps, tokens=False)
    reasons = [None if r.finish_reason is None else r.finish_reason.value for r in requests]
    done = [r for r, why in zip(requests, reasons) if why in ("length", "stop")]
    lat = latencies if latencies is not None and len(done) == len(requests) else request_latencies(done)
    finish, ttft_all, tpot_all = lat["finish"], lat["ttft"], lat["tpot"]
    has, many = ~np.isnan(ttft_all), ~np.isnan(tpot_all)
    ttft, tpot, itl = ttft_all[has], tpot_all[many], lat["itl"]
    e2e = lat["e2e"][~np.isnan(finish)]
    start = min((r.arrival for r in requests), default=0.0)
    end = float(np.nanmax(finish)) if len(done) and not np.isnan(finish).all() else start
    span = max(end - start, 1e-9)
    out_tokens = sum(r.num_output_tokens for r in done)
    row = dict(requests=len(requests), finished=len(done),
               rejected=reasons.count("rejected"), aborted=reasons.count("aborted"),
               duration_s=span, requests_per_s=len(done) / span, output_tokens_per_s=out_tokens / span,
               preemptions=sum(r.num_preemptions for r in requests),
               peak_kv_usage=int(c["kv_reserved_slots"].max(initial=0)) / max(total_slots, 1),
               mean_kv_usage=_time_weighted_kv(c, total_slots),
               mean_batch_size=float(c["num_seqs"].mean()) if len(c["num_seqs"]) else 0.0)
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q, v in zip((50, 90, 99), _pcts(xs, (50, 90, 99))):
            row[f"{name}_p{q}"] = v
    # Over all inter-token gaps, as Sarathi-Serve reports it: the same figure as itl_p99.
    row["tbt_p99"] = row["itl_p99"]
    # Each request's longest gap: a rare stall shows here, where tbt_p99 over all gaps hides it.
    max_tbt = lat["max_tbt"][~np.isnan(lat["max_tbt"])]
    for q, v in zip((50, 90, 99), _pcts(max_tbt, (50, 90, 99))):
        row[f"max_tbt_p{q}"] = v
    # Queueing before the first step that serves a request (Sarathi-Serve's scheduling delay).
    sched = np.array([r.first_scheduled - r.arrival for r in done if r.first_scheduled is not None], np.float64)
    for q, v in zip((50, 99), _pcts(sched, (50, 99))):
        row[f"scheduling_delay_p{q}"] = v
    # vLLM's mean normalized latency: end-to-end latency over output length, averaged over requests.
    out = np.array([r.num_output_tokens for r in done], np.float64)
    fin = ~np.isnan(finish) & (out > 0)
    row["normalized_latency_mean"] = float(np.mean(lat["e2e"][fin] / out[fin])) if fin.any() else float("nan")
    if ttft_slo is not None or tpot_slo is not None or tbt_slo is not None:
        ok_ttft = np.ones(len(done), bool) if ttft_slo is None else has & (np.nan_to_num(ttft_all, nan=np.inf) <= ttft_slo)
        ok_tpot = np.ones(len(done), bool) if tpot_slo is None else ~many | (np.nan_to_num(tpot_all) <= tpot_slo)
        ok_tbt = np.ones(len(done), bool)
        if tbt_slo is not None:  # a request with one token has no gap to exceed it
            ok_tbt = ~many | (np.nan_to_num(lat["max_tbt"]) <= tbt_slo)
            row["tbt_attainment"] = int(ok_tbt.sum()) / max(len(requests), 1)
        ok = int((ok_ttft & ok_tpot & ok_tbt).sum())
        row["goodput_requests_per_s"] = ok / span
        row["slo_attainment"] = ok / max(len(requests), 1)
    return row
