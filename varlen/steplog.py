"""The engine's per-step log: one StepRecord per step, a run of repeating pure-decode steps (the
simulator's fast-forward) as one compact DecodeRun. It reads as a sequence of StepRecords; columns()
gives the metrics' per-step arrays without expanding runs. StepLog(keep=False) keeps only the
columns the summary and kv_usage.csv read (columns(tokens=False), 32 bytes a step: the counts as
int32 where they fit): the entries are folded into arrays every HOLD steps, per-request list items
and ENTRY per entry held,
handed to `sink` (steps.csv written as the run goes) and dropped. With no sink either, no entry is
held at all: each step's figures go straight to per-entry column lists (append_step, append_run).
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from typing import Callable, Final, Iterable, Iterator

import numpy as np


@dataclass(init=False, slots=True)
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
    num_sampled: int  # requests that sampled a token (logit rows); -1 = not recorded
    num_running: int  # running requests after the step (0 = the engine went idle)

    def __init__(self, step: int, start: float, duration: float, req_ids: list[str], new_tokens: list[int],
                 cached_tokens: list[int], num_preempted: int, kv_reserved_slots: int, kv_live_tokens: int,
                 num_waiting: int, num_sampled: int = -1, num_running: int = -1) -> None:
        self.step, self.start, self.duration, self.req_ids = step, start, duration, req_ids
        self.new_tokens, self.cached_tokens, self.num_preempted = new_tokens, cached_tokens, num_preempted
        self.kv_reserved_slots, self.kv_live_tokens, self.num_waiting = kv_reserved_slots, kv_live_tokens, num_waiting
        self.num_sampled, self.num_running = num_sampled, num_running


@dataclass(init=False, slots=True)
class DecodeRun:
    """Steps step .. step + len(ends) - 1, each decoding every request of `req_ids` by one token."""

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

    def __init__(self, step: int, start: float, ends: list[float], req_ids: list[str], cached_tokens: list[int],
                 kv_reserved_slots: list[int], kv_live_before: int, last_kv_live_tokens: int, num_waiting: int,
                 num_running: int) -> None:
        self.step, self.start, self.ends, self.req_ids, self.cached_tokens = step, start, ends, req_ids, cached_tokens
        self.kv_reserved_slots, self.kv_live_before, self.last_kv_live_tokens = kv_reserved_slots, kv_live_before, last_kv_live_tokens
        self.num_waiting, self.num_running = num_waiting, num_running

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


#: Steps, per-request list items and ENTRY per entry a StepLog(keep=False) holds before folding them
#: (about 60 bytes each: a few hundred KB a replica).
HOLD: Final = 4096  # Final: compiled, a constant rather than a module lookup per append
#: What an entry itself counts toward HOLD beside its steps and its per-request list items: a writer
#: that leaves those out where they are not read (reads_batches) is folded less often, in as much memory.
ENTRY: Final = 8
#: Where a column has no figure for an entry (a run's duration, a record's end); Final: a C constant.
_NAN: Final = float("nan")
#: Folded chunks joined into one every this many (few arrays, not one per fold).
JOIN: Final = 64


class StepLog:
    """The steps of one engine, in order; a sequence of StepRecords to its readers (keep=True)."""

    def __init__(self, entries: Iterable[StepRecord | DecodeRun] = (), keep: bool = True,
                 sink: Callable[[list[StepRecord | DecodeRun]], None] | None = None) -> None:
        self.entries: list[StepRecord | DecodeRun] = []  # keep=False: those not folded yet
        self._first: list[int] = []  # index of each entry's first step
        self._len = 0
        self._appends = 0
        self._columns: dict[str, np.ndarray] | None = None
        self._columns_at = -1
        self._columns_tokens = False
        self._parts: list[tuple[StepLog, int]] = []
        self.keep = keep
        self._sink = sink
        self._chunks: list[dict[str, np.ndarray]] = []  # keep=False: the folded entries' columns
        self._held = 0  # steps, per-request list items and ENTRY per entry, in `entries`
        self._joined = 0  # _chunks[:_joined] are joins of JOIN folds; those after, single folds
        # keep=False without a sink: the entries not folded yet as the lists _compute_columns reads (no
        # entry objects; nothing reads them), one item per entry except ends and reserved (one per step).
        self._held_entries = 0
        self._col_steps: list[int] = []
        self._col_seqs: list[int] = []
        self._col_waiting: list[int] = []
        self._col_start: list[float] = []
        self._col_live0: list[int] = []
        self._col_live_last: list[int] = []
        self._col_duration: list[float] = []  # nan for a run (its steps' durations come from `ends`)
        self._col_ends: list[float] = []  # nan for a record
        self._col_reserved: list[int] = []
        for e in entries:
            self.append(e)

    def reads_batches(self) -> bool:
        """Whether an entry's request ids and per-request token lists are read (kept, or handed to a
        sink); if not, a writer may leave the token lists empty and share one req_ids list among
        batches of a size (it then only gives the batch's size)."""
        return self.keep or self._sink is not None

    def append(self, entry: StepRecord | DecodeRun) -> None:
        if not self.keep and self._sink is None:  # its figures only (what append_step/append_run take)
            if isinstance(entry, DecodeRun):
                self._add_run(entry.start, entry.ends, len(entry.req_ids), entry.kv_reserved_slots,
                              entry.kv_live_before, entry.last_kv_live_tokens, entry.num_waiting,
                              len(entry.cached_tokens))
            else:
                self._add_step(entry.start, entry.duration, len(entry.req_ids), entry.kv_reserved_slots,
                               entry.kv_live_tokens, entry.num_waiting, len(entry.cached_tokens))
            return
        self.entries.append(entry)
        self._first.append(self._len)
        n = len(entry) if type(entry) is DecodeRun else 1
        self._len += n
        self._appends += 1
        if not self.keep:
            self._held += n + len(entry.cached_tokens) + ENTRY
            if self._held >= HOLD:
                self.flush()

    def append_step(self, start: float, duration: float, num_seqs: int, kv_reserved_slots: int,
                    kv_live_tokens: int, num_waiting: int) -> None:
        """append(StepRecord(...)) where the log reads no batches (reads_batches() False): only what
        columns(tokens=False) reads, no record built."""
        if self.reads_batches():
            raise RuntimeError("append_step: this step log reads each step's batch; append a StepRecord")
        self._add_step(start, duration, num_seqs, kv_reserved_slots, kv_live_tokens, num_waiting, 0)

    def append_run(self, start: float, ends: list[float], num_seqs: int, kv_reserved_slots: list[int],
                   kv_live_before: int, last_kv_live_tokens: int, num_waiting: int) -> None:
        """append(DecodeRun(...)) where the log reads no batches (reads_batches() False), as append_step."""
        if self.reads_batches():
            raise RuntimeError("append_run: this step log reads each step's batch; append a DecodeRun")
        self._add_run(start, ends, num_seqs, kv_reserved_slots, kv_live_before, last_kv_live_tokens, num_waiting, 0)

    def _add_step(self, start: float, duration: float, num_seqs: int, reserved: int, live: int, waiting: int,
                  items: int) -> None:
        self._col_steps.append(1)
        self._col_seqs.append(num_seqs)
        self._col_waiting.append(waiting)
        self._col_start.append(start)
        self._col_live0.append(live - num_seqs)
        self._col_live_last.append(live)
        self._col_duration.append(duration)
        self._col_ends.append(_NAN)
        self._col_reserved.append(reserved)
        self._held_ended(1, items)

    def _add_run(self, start: float, ends: list[float], num_seqs: int, reserved: list[int], live_before: int,
                 live_last: int, waiting: int, items: int) -> None:
        n = len(ends)
        self._col_steps.append(n)
        self._col_seqs.append(num_seqs)
        self._col_waiting.append(waiting)
        self._col_start.append(start)
        self._col_live0.append(live_before)
        self._col_live_last.append(live_last)
        self._col_duration.append(_NAN)
        self._col_ends.extend(ends)
        self._col_reserved.extend(reserved)
        self._held_ended(n, items)

    def _held_ended(self, n: int, items: int) -> None:
        """An entry of `n` steps and `items` per-request list items added to the column lists."""
        self._held_entries += 1
        self._len += n
        self._appends += 1
        self._held += n + items + ENTRY  # as append() counts an entry: the same folds
        if self._held >= HOLD:
            self.flush()

    def flush(self) -> None:
        """keep=False: the entries held folded into columns and handed to the sink (at a run's end too)."""
        if self.keep or not (self.entries or self._held_entries):
            return
        chunks = self._chunks
        chunks.append(_narrow(self._compute_columns(False)))
        if len(chunks) - self._joined >= JOIN:
            last = chunks[self._joined:]
            chunks[self._joined:] = [{k: np.concatenate([c[k] for c in last]) for k in last[0]}]
            self._joined += 1
        if self._sink is not None:
            self._sink(self.entries)
        self.entries = []
        self._first = []
        self._held = 0
        if self._held_entries:
            self._held_entries = 0
            self._col_steps, self._col_seqs, self._col_waiting, self._col_start = [], [], [], []
            self._col_live0, self._col_live_last, self._col_duration = [], [], []
            self._col_ends, self._col_reserved = [], []

    @classmethod
    def concat(cls, logs: Iterable[StepLog]) -> StepLog:
        """Several engines' logs as one (step numbers stay each engine's own)."""
        logs = list(logs)
        if not all(log.keep for log in logs):  # columns only: theirs, end to end
            out = cls(keep=False)
            out._chunks = [log.columns(tokens=False) for log in logs]
            out._len = sum(len(log) for log in logs)
            return out
        out = cls(e for log in logs for e in log.entries)
        out._parts = [(log, len(log.entries)) for log in logs]
        return out

    def __len__(self) -> int:
        return self._len

    def _records_kept(self) -> None:
        if not self.keep:
            raise RuntimeError("this step log kept columns only (StepLog(keep=False)), not its step records; "
                               "keep them with StepLog(keep=True) (sim.run: output.token_times=true)")

    def __iter__(self) -> Iterator[StepRecord]:
        self._records_kept()
        for e in self.entries:
            if isinstance(e, DecodeRun):
                for i in range(len(e)):
                    yield e.record(i)
            else:
                yield e

    def __getitem__(self, i: int | slice) -> StepRecord | list[StepRecord]:
        self._records_kept()
        if isinstance(i, slice):
            return [self._record(j) for j in range(*i.indices(self._len))]
        return self._record(i)

    def _record(self, i: int) -> StepRecord:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"step {i} out of range ({self._len} steps)")
        j = bisect.bisect_right(self._first, i) - 1
        e = self.entries[j]
        return e.record(i - self._first[j]) if isinstance(e, DecodeRun) else e

    def __bool__(self) -> bool:
        return self._len > 0

    def columns(self, tokens: bool = True) -> dict[str, np.ndarray]:
        """Per-step read-only arrays as read off the records; tokens=False leaves out the token sums
        (which a StepLog(keep=False) does not keep)."""
        n_entries = len(self.entries)
        want = tokens
        if tokens and not self.keep:
            raise RuntimeError("this step log kept the metrics' columns only (StepLog(keep=False)), not the token "
                               "sums; read columns(tokens=False), or keep the records with StepLog(keep=True) "
                               "(sim.run: output.token_times=true)")
        if self._columns is None or self._columns_at != self._appends or (tokens and not self._columns_tokens):
            parts = self._parts
            if (parts and sum(n for _, n in parts) == n_entries
                    and all(len(log.entries) == n for log, n in parts)):
                cols = [log.columns(tokens) for log, _ in parts]
                self._columns = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
            elif not self.keep:
                if len(self._chunks) > 1:  # joined once, in place: the log holds one copy of its columns
                    chunks = self._chunks
                    self._chunks = [{k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}]
                    self._joined = 1
                held = self.entries or self._held_entries
                rest = [_narrow(self._compute_columns(False))] if held or not self._chunks else []
                both = self._chunks + rest
                self._columns = {k: np.concatenate([c[k] for c in both]) for k in both[0]} if len(both) > 1 \
                    else dict(both[0])
            else:
                self._columns = self._compute_columns(tokens)
            for a in self._columns.values():
                a.flags.writeable = False
            self._columns_at = self._appends
            self._columns_tokens = tokens
        if want:
            return dict(self._columns)
        return {k: v for k, v in self._columns.items() if k not in ("num_new_tokens", "num_cached_tokens")}

    def _compute_columns(self, tokens: bool = True) -> dict[str, np.ndarray]:
        """columns(): a few figures per entry in one pass, spread over the steps by numpy."""
        if self._held_entries:  # held as columns already (no entries beside them)
            return _spread(self._col_steps, self._col_seqs, [], [], self._col_live0, self._col_live_last,
                           self._col_waiting, self._col_start, self._col_duration, self._col_ends,
                           self._col_reserved, False)
        steps: list[int] = []
        seqs: list[int] = []
        new: list[int] = []
        cached0: list[int] = []
        live0: list[int] = []
        live_last: list[int] = []
        waiting: list[int] = []
        start0: list[float] = []
        record_dur: list[float] = []
        ends: list[float] = []
        reserved: list[int] = []
        nan = _NAN
        for e in self.entries:
            B = len(e.req_ids)
            seqs.append(B)
            if tokens:
                cached0.append(sum(e.cached_tokens))
            waiting.append(e.num_waiting)
            start0.append(e.start)
            if isinstance(e, DecodeRun):
                steps.append(len(e.ends))
                if tokens:
                    new.append(B)
                live0.append(e.kv_live_before)
                live_last.append(e.last_kv_live_tokens)
                record_dur.append(nan)
                ends += e.ends
                reserved += e.kv_reserved_slots
            else:
                steps.append(1)
                if tokens:
                    new.append(sum(e.new_tokens))
                live0.append(e.kv_live_tokens - B)
                live_last.append(e.kv_live_tokens)
                record_dur.append(e.duration)
                ends.append(nan)
                reserved.append(e.kv_reserved_slots)
        return _spread(steps, seqs, new, cached0, live0, live_last, waiting, start0, record_dur, ends, reserved,
                       tokens)


def _spread(steps: list[int], seqs: list[int], new: list[int], cached0: list[int], live0: list[int],
            live_last: list[int], waiting: list[int], start0: list[float], record_dur: list[float],
            ends: list[float], reserved: list[int], tokens: bool) -> dict[str, np.ndarray]:
    """The per-step columns from per-entry figures (ends and reserved: per step), spread by numpy."""
    n = len(steps)
    steps_a = _ints(steps)
    first = np.cumsum(steps_a) - steps_a
    per_step: np.ndarray = np.repeat(np.arange(n), steps_a)
    offset = np.arange(len(per_step)) - first[per_step]
    seqs_s = _ints(seqs)[per_step]
    live = _ints(live0)[per_step] + seqs_s * (offset + 1)
    live[first + steps_a - 1] = _ints(live_last)
    end = _floats(ends)
    start = np.empty(len(end))
    start[1:] = end[:-1]  # a run's step starts where the one before it ended...
    start[first] = _floats(start0)  # ...but its first, and every record, start where recorded
    in_run = ~np.isnan(end)
    duration = _floats(record_dur)[per_step]
    duration[in_run] = end[in_run] - start[in_run]
    cols = dict(start=start, duration=duration, num_seqs=seqs_s)
    if tokens:
        cols.update(num_new_tokens=_ints(new)[per_step],
                    num_cached_tokens=_ints(cached0)[per_step] + seqs_s * offset)
    cols.update(kv_reserved_slots=_ints(reserved), kv_live_tokens=live,
                num_waiting=_ints(waiting)[per_step])
    return cols


def _ints(values: list[int]) -> np.ndarray:
    """np.array(values, np.int64), packed as C integers in one call rather than converted one by one."""
    return np.frombuffer(bytearray(struct.pack(f"{len(values)}q", *values)), np.int64)


def _floats(values: list[float]) -> np.ndarray:
    """np.array(values, np.float64), packed as C doubles in one call rather than converted one by one."""
    return np.frombuffer(bytearray(struct.pack(f"{len(values)}d", *values)), np.float64)


#: Counts a StepLog(keep=False) keeps as int32 where every value fits (half the memory of int64).
_COUNTS = ("num_seqs", "kv_reserved_slots", "kv_live_tokens", "num_waiting")
_I32 = np.iinfo(np.int32)


def _narrow(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for k in _COUNTS:
        a = cols[k]
        if not len(a) or (int(a.min()) >= _I32.min and int(a.max()) <= _I32.max):
            cols[k] = a.astype(np.int32)
    return cols


def step_columns(steps: StepLog | Iterable[StepRecord], tokens: bool = True) -> dict[str, np.ndarray]:
    """StepLog.columns(tokens) of a log, or of a plain sequence of StepRecords."""
    return (steps if isinstance(steps, StepLog) else StepLog(steps)).columns(tokens)
