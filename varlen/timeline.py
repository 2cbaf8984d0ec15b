"""timeline.json: a run as a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing),
written after the run from what it recorded: each engine's step log and each request's timestamps.

One process per engine (replica; in disaggregated mode each prefill and decode instance), a "steps"
thread with one complete event per step, and request lanes: each request's spans ("queued",
"prefill", "transfer", "decode") on the lowest lane of its engine free at its arrival, so lanes
never overlap. Events are streamed to the file; at most `max_events` are written, and when more
would be, the last event says how many were left out (`timeline_truncated`).
"""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from varlen.request import Request

STEPS_TID = 0
LANE_TID0 = 1  # request lanes: tid 1, 2, ...


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _dur(a: float, b: float, t0: float) -> float:
    # From the rounded ends, so that spans which abut in the run abut in the file.
    return round(_us(b, t0) - _us(a, t0), 3)


def _meta(pid: int, tid: int, what: str, name: str) -> dict[str, Any]:
    return {"name": what, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def step_events(steps: Iterable[Any], pid: int, total_slots: int, t0: float) -> Iterator[dict[str, Any]]:
    """One "X" event per step of an engine's log (a sequence of StepRecords)."""
    for s in steps:
        # A request computing one new token is counted as a decode, as steps.csv's num_decodes does.
        decodes = sum(1 for n in s.new_tokens if n == 1)
        prefill_tokens = sum(n for n in s.new_tokens if n != 1)
        yield {"name": f"step {s.step}: {len(s.new_tokens) - decodes} prefill / {decodes} decode",
               "ph": "X", "ts": _us(s.start, t0), "dur": _dur(s.start, s.start + s.duration, t0),
               "pid": pid, "tid": STEPS_TID,
               "args": {"prefill_tokens": prefill_tokens, "decode_tokens": decodes, "requests": len(s.req_ids),
                        "kv_usage": round(s.kv_reserved_slots / total_slots, 4) if total_slots else None,
                        "num_waiting": s.num_waiting, "num_preempted": s.num_preempted}}


def request_spans(r: Request, transfer: Any = None) -> list[tuple[str, float, float]]:
    """(name, start, end) of a request's phases, in order, each starting where the last ended."""
    end = r.finish_time
    first_token = r.token_times[0] if r.token_times else None
    if end is None:  # not finished (an interrupted run): up to what was recorded
        end = r.token_times[-1] if r.token_times else (r.first_scheduled if r.first_scheduled is not None
                                                       else r.arrival)
    if r.first_scheduled is None:  # never ran: rejected, or aborted while waiting
        return [("queued", r.arrival, end)]
    spans = [("queued", r.arrival, r.first_scheduled)]
    if first_token is None:
        return spans + [("prefill", r.first_scheduled, end)]
    spans.append(("prefill", r.first_scheduled, first_token))
    if transfer is not None and first_token <= transfer.end <= end:
        spans.append(("transfer", first_token, transfer.end))  # waiting for a decode slot, then the KV move
        first_token = transfer.end
    if end > first_token:
        spans.append(("decode", first_token, end))
    return spans


def request_events(requests: Sequence[Request], pid_of: Mapping[str, int], t0: float,
                   transfers: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Each request's spans on a lane of its engine's process (the lowest lane free at its arrival)."""
    free: dict[int, list[tuple[float, int]]] = {}  # per pid: (lane's end, lane) heap
    lanes: dict[int, int] = {}
    for r in sorted(requests, key=lambda r: r.arrival):
        pid = pid_of.get(r.req_id, 0)
        spans = request_spans(r, transfers.get(r.req_id))
        end = spans[-1][2]
        heap = free.setdefault(pid, [])
        if heap and heap[0][0] <= r.arrival:
            lane = heapq.heappop(heap)[1]
        else:
            lane = lanes.get(pid, 0)
            lanes[pid] = lane + 1
            yield _meta(pid, LANE_TID0 + lane, "thread_name", f"requests {lane}")
        heapq.heappush(heap, (end, lane))
        args = {"req_id": r.req_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                "finish_reason": r.finish_reason.value if r.finish_reason else None}
        if r.finish_message:
            args["finish_message"] = r.finish_message
        for name, a, b in spans:
            yield {"name": f"{name} {r.req_id}", "ph": "X", "ts": _us(a, t0), "dur": _dur(a, b, t0),
                   "pid": pid, "tid": LANE_TID0 + lane, "args": args}


class CappedWriter:
    """Streams trace events into a {"traceEvents": [...]} file, at most `max_events` of them."""

    def __init__(self, path: Path, max_events: int):
        if max_events < 2:
            raise ValueError(f"output.timeline_max_events={max_events}: give at least 2")
        self.f = open(path, "w", encoding="utf-8")
        self.f.write('{"traceEvents": [\n')
        self.max_events, self.written, self.dropped = max_events, 0, 0
        self._held: dict[str, Any] | None = None  # the last slot: this event, or the truncation note

    def add(self, event: dict[str, Any]) -> None:
        if self.written < self.max_events - 1:
            self._write(event)
        elif self._held is None:
            self._held = event
        else:
            self.dropped += 1

    def _write(self, event: dict[str, Any]) -> None:
        self.f.write((",\n" if self.written else "") + json.dumps(event, allow_nan=False))
        self.written += 1

    def close(self) -> None:
        if self._held is not None and self.dropped == 0:
            self._write(self._held)
        elif self._held is not None:
            self.dropped += 1
            self._write({"name": "timeline_truncated", "ph": "M", "ts": 0, "pid": 0, "tid": 0,
                         "args": {"max_events": self.max_events, "events_left_out": self.dropped}})
        self.f.write('\n],\n"displayTimeUnit": "ms",\n"otherData": ')
        self.f.write(json.dumps({"max_events": self.max_events, "events_left_out": self.dropped}))
        self.f.write("}\n")
        self.f.close()


def write_timeline(path: Path, engines: Sequence[tuple[str, Any, int]], requests: Sequence[Request],
                   engine_of: Mapping[str, int], max_events: int, transfers: Iterable[Any] = ()) -> int:
    """Write timeline.json at `path`. engines: (name, step log, KV capacity in tokens) per engine, its
    index the process id; engine_of: req_id -> the engine whose lanes hold its spans; transfers:
    objects with req_id and end (disaggregated KV moves). Returns how many events were left out."""
    starts = [r.arrival for r in requests if math.isfinite(r.arrival)]
    starts += [log[0].start for _, log, _ in engines if len(log)]
    t0 = min(starts, default=0.0)
    w = CappedWriter(path, max_events)
    try:
        for pid, (name, _, _) in enumerate(engines):
            w.add(_meta(pid, 0, "process_name", name))
            w.add(_meta(pid, STEPS_TID, "thread_name", "steps"))
        for pid, (_, log, slots) in enumerate(engines):
            for e in step_events(log, pid, slots, t0):
                w.add(e)
        ok = [r for r in requests if math.isfinite(r.arrival)]  # a nan/inf arrival was rejected: no time to draw
        for e in request_events(ok, engine_of, t0, {t.req_id: t for t in transfers}):
            w.add(e)
    finally:
        w.close()
    if w.dropped:
        print(f"timeline: {w.dropped} events left out at output.timeline_max_events={max_events} "
              f"(the last event of {path.name} says so)", flush=True)
    return w.dropped
