"""The engine's per-step log: one StepRecord per step, with runs of repeating pure-decode steps
(the simulator's fast-forward) kept as one compact DecodeRun each.

A long simulation takes hundreds of thousands of steps, most of them decodes of an unchanged
batch; writing each as its own record with per-request lists costs more than deciding it. The
log reads as a sequence of StepRecords all the same (iteration, len, indexing expand runs), and
`columns()` gives the per-step figures the metrics need as arrays without expanding anything.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float
    duration: float
    req_ids: list[str]
    new_tokens: list[int]
    cached_tokens: list[int]
    num_preempted: int
    kv_reserved_slots: int
    kv_live_tokens: int
    num_waiting: int
    num_sampled: int = -1  # requests that sampled a token (logit rows); -1 = not recorded
    num_running: int = -1  # running requests after the step (0 = the engine went idle)


@dataclass(slots=True)
class DecodeRun:
    """Steps step .. step + len(ends) - 1: each decodes every request of `req_ids` by one token
    (all sample), nothing preempted, nothing waiting; step i starts where step i - 1 ended."""

    step: int
    start: float  # the first step's start
    ends: list[float]  # each step's end
    req_ids: list[str]
    cached_tokens: list[int]  # at the first step; each step adds one per request
    kv_reserved_slots: list[int]  # after each step
    kv_live_before: int  # live tokens before the first step; each step adds one per request
    last_kv_live_tokens: int  # after the last step, whose finishes may have freed some
    num_waiting: int
    num_running: int  # after the last step

    def __len__(self) -> int:
        return len(self.ends)

    def record(self, i: int) -> StepRecord:
        """Step `step + i` as the step-by-step engine would have recorded it."""
        B, last = len(self.req_ids), i == len(self.ends) - 1
        start = self.start if i == 0 else self.ends[i - 1]
        return StepRecord(self.step + i, start, self.ends[i] - start, self.req_ids, [1] * B,
                          [c + i for c in self.cached_tokens], 0, self.kv_reserved_slots[i],
                          self.last_kv_live_tokens if last else self.kv_live_before + B * (i + 1),
                          self.num_waiting, B, self.num_running if last else B)


class StepLog:
    """The steps of one engine, in order; a sequence of StepRecords to its readers."""

    def __init__(self, entries: Iterable[StepRecord | DecodeRun] = ()):
        self.entries: list[StepRecord | DecodeRun] = []
        self._first: list[int] = []  # index of each entry's first step
        self._len = 0
        for e in entries:
            self.append(e)

    def append(self, entry: StepRecord | DecodeRun) -> None:
        self.entries.append(entry)
        self._first.append(self._len)
        self._len += len(entry) if type(entry) is DecodeRun else 1

    @classmethod
    def concat(cls, logs: Iterable[StepLog]) -> StepLog:
        """Several engines' logs as one (step numbers stay each engine's own)."""
        return cls(e for log in logs for e in log.entries)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[StepRecord]:
        for e in self.entries:
            if type(e) is DecodeRun:
                for i in range(len(e)):
                    yield e.record(i)
            else:
                yield e

    def __getitem__(self, i: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"step {i} out of range ({self._len} steps)")
        j = bisect.bisect_right(self._first, i) - 1
        e = self.entries[j]
        return e.record(i - self._first[j]) if type(e) is DecodeRun else e

    def __bool__(self) -> bool:
        return self._len > 0

    def columns(self) -> dict[str, np.ndarray]:
        """Per-step arrays (start, duration, num_seqs, num_new_tokens, num_cached_tokens,
        kv_reserved_slots, kv_live_tokens, num_waiting), equal to reading them off the records."""
        start: list[float] = []
        end: list[float] = []  # a run's step ends (NaN for a record, whose duration is kept)
        dur: list[float] = []  # a record's duration (NaN for a run's step)
        seqs: list[int] = []
        new: list[int] = []
        cached: list[int] = []
        reserved: list[int] = []
        live: list[int] = []
        waiting: list[int] = []
        nan = float("nan")
        for e in self.entries:
            if type(e) is DecodeRun:
                k, B = len(e.ends), len(e.req_ids)
                start.append(e.start)
                start += e.ends[:-1]
                end += e.ends
                dur += [nan] * k
                seqs += [B] * k
                new += [B] * k
                c0 = sum(e.cached_tokens)
                cached += range(c0, c0 + B * k, B)
                reserved += e.kv_reserved_slots
                live += range(e.kv_live_before + B, e.kv_live_before + B * k, B)
                live.append(e.last_kv_live_tokens)
                waiting += [e.num_waiting] * k
            else:
                start.append(e.start)
                end.append(nan)
                dur.append(e.duration)
                seqs.append(len(e.req_ids))
                new.append(sum(e.new_tokens))
                cached.append(sum(e.cached_tokens))
                reserved.append(e.kv_reserved_slots)
                live.append(e.kv_live_tokens)
                waiting.append(e.num_waiting)
        f, i = np.float64, np.int64
        start_a, dur_a = np.array(start, f), np.array(dur, f)
        in_run = np.isnan(dur_a)
        dur_a[in_run] = np.array(end, f)[in_run] - start_a[in_run]  # as DecodeRun.record computes it
        return dict(start=start_a, duration=dur_a, num_seqs=np.array(seqs, i),
                    num_new_tokens=np.array(new, i), num_cached_tokens=np.array(cached, i),
                    kv_reserved_slots=np.array(reserved, i), kv_live_tokens=np.array(live, i),
                    num_waiting=np.array(waiting, i))


def step_columns(steps: StepLog | Iterable[StepRecord]) -> dict[str, np.ndarray]:
    """StepLog.columns() of a log, or of a plain sequence of StepRecords."""
    return (steps if isinstance(steps, StepLog) else StepLog(steps)).columns()
