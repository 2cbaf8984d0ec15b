"""Request and step metrics, shared by the real engine and the simulator. No torch; pandas is
imported only when a table is asked for, so the simulator starts fast."""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from varlen.request import FinishReason, Request, results_columns
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


class GapCounts:
    """Every inter-token gap of a run as an exact value -> count table: a decode step's gap is shared by
    its whole batch, so the table grows with steps, not tokens. percentiles() is np.percentile of all
    the gaps, bit for bit."""

    FOLD = 1 << 18  # table rows buffered before they are folded into the table

    def __init__(self) -> None:
        self._values = np.empty(0, np.float64)  # sorted, distinct
        self._counts = np.empty(0, np.int64)
        self._buffer: list[tuple[np.ndarray, np.ndarray]] = []  # (values, counts) tables not folded yet
        self._rows = 0  # values buffered
        self._buffered = 0  # gaps buffered
        # add_timelines' method: walk the shared times (True) until a chunk shows the timelines do
        # not move between neighbouring times (replicas' steps interleave), then sort the gaps.
        self.walk = True

    def add(self, gaps: np.ndarray) -> None:
        if len(gaps):
            v, c = _sorted_table(np.sort(np.asarray(gaps, np.float64)))
            self._push(v, c, len(gaps))

    def add_counts(self, values: Sequence[float], counts: Sequence[int]) -> None:
        """counts[i] gaps of values[i] seconds each (an engine's streamed gaps, Engine.stream_token_times)."""
        n = len(values)
        if n:
            if type(values) is list and type(counts) is list:
                v, c = _packed(values, "d"), _packed(counts, "q")
            else:
                v, c = np.asarray(values, np.float64), np.asarray(counts, np.int64)
            self._push(*_table(v, c), int(c.sum()))

    CHUNK = 1 << 18  # token times counted at once: bounds the ~10 temporaries of that size

    def add_timelines(self, times: np.ndarray, lens: np.ndarray) -> None:
        """The gaps between consecutive entries of each timeline (`times`: timelines end to end,
        ascending for speed; `lens`: their lengths). Counted in chunks of whole timelines (no gap
        spans two), so memory stays bounded however many are given."""
        times = np.asarray(times, np.float64)
        lens = np.asarray(lens, np.int64)
        ends = np.cumsum(lens)
        j, t = 0, 0
        while j < len(lens):
            k = max(int(np.searchsorted(ends, t + self.CHUNK, side="right")), j + 1)
            chunk, chunk_lens = times[t:int(ends[k - 1])], lens[j:k]
            if len(chunk) >= 2:
                (self._walk_chunk if self.walk else self._sort_chunk)(chunk, chunk_lens)
            j, t = k, int(ends[k - 1])

    @staticmethod
    def _within(n: int, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each timeline's first index, False where a pair of neighbours spans two timelines)."""
        starts = np.cumsum(lens) - lens
        within = np.ones(n - 1, bool)
        within[starts[(lens > 0) & (starts > 0)] - 1] = False
        return starts, within

    def _sort_chunk(self, times: np.ndarray, lens: np.ndarray) -> None:
        """The gaps, sorted and counted: cheapest where timelines skip over other timelines' times."""
        _, within = self._within(len(times), lens)
        gaps = np.subtract(times[1:], times[:-1])[within]
        if len(gaps):
            gaps.sort()
            v, c = _sorted_table(gaps)
            self._push(v, c, len(gaps))

    def _walk_chunk(self, times: np.ndarray, lens: np.ndarray) -> None:
        """Requests served by the same steps share their times, so their gaps are the same differences
        of the same numbers: a gap between neighbouring distinct times is counted, not sorted; only
        the others (a skipped step) are sorted."""
        n = len(times)
        starts, within = self._within(n, lens)
        s = np.sort(times, kind="stable")  # ascending runs: merged, far cheaper than a sort from scratch
        new = np.empty(n, bool)
        new[0] = True
        np.not_equal(s[1:], s[:-1], out=new[1:])
        distinct = s[new]
        # Each time's index in `distinct`: a timeline that moves step by step walks it one by one
        # from its first time; the entries off that walk are searched.
        live = lens > 0
        rank = np.repeat(np.searchsorted(distinct, times[starts[live]]) - starts[live], lens[live])
        rank += np.arange(n)
        off = rank >= len(distinct)
        rank[off] = 0
        off |= distinct[rank] != times
        n_off = int(off.sum())
        if n_off:
            rank[off] = np.searchsorted(distinct, times[off])
        if 2 * n_off > n:
            self.walk = False  # most times off the walk: the next chunks sort their gaps instead
        nxt = np.diff(rank) == 1
        step = within & nxt
        counts = np.bincount(rank[:-1][step], minlength=len(distinct) - 1)[:len(distinct) - 1]
        used = counts > 0
        other = within & ~nxt
        # Neighbouring distinct times: distinct[k + 1] - distinct[k] is each such gap, to the bit.
        values = np.concatenate([(distinct[1:] - distinct[:-1])[used], times[1:][other] - times[:-1][other]])
        weights = np.concatenate([counts[used], np.ones(int(other.sum()), np.int64)])
        if len(values):
            self._push(*_table(values, weights), int(weights.sum()))

    def _push(self, values: np.ndarray, counts: np.ndarray, gaps: int) -> None:
        self._buffer.append((values, counts))
        self._rows += len(values)
        self._buffered += gaps
        # Fold once the buffer is as large as the table: each row is re-sorted O(log) times in all,
        # where a fixed threshold re-sorts the whole table every FOLD rows (quadratic in a long run).
        if self._rows >= max(self.FOLD, len(self._values)):
            self._fold()

    def _fold(self) -> None:
        if not self._buffer:
            return
        buffer, self._buffer, self._rows, self._buffered = self._buffer, [], 0, 0
        if len(self._values):  # one pass over this table's and the buffered tables' ascending runs
            buffer.insert(0, (self._values, self._counts))
        self._values, self._counts = _table(np.concatenate([v for v, _ in buffer]),
                                            np.concatenate([c for _, c in buffer]))

    def _merge(self, v: np.ndarray, c: np.ndarray) -> None:
        """Add the table (v distinct ascending, c counts) to this one."""
        if len(self._values):
            v, c = _table(np.concatenate([self._values, v]), np.concatenate([self._counts, c]))
        self._values, self._counts = v, c

    def absorb(self, other: "GapCounts") -> None:
        """Count `other`'s gaps too: a fleet's table from its cells' (the counts summed)."""
        v, c = other.table()
        if len(v):
            self._merge(v, c)

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct gaps ascending, how many of each)."""
        self._fold()
        return self._values, self._counts

    def __len__(self) -> int:
        return int(self._counts.sum()) + self._buffered

    def percentiles(self, qs: Sequence[float]) -> list[float]:
        """np.percentile(all gaps, qs) (linear), by numpy's own arithmetic on the two neighbours."""
        values, counts = self.table()
        n = int(counts.sum())
        if n == 0:
            return [float("nan")] * len(qs)
        if np.isnan(values[-1]):
            return [float("nan")] * len(qs)
        virtual, prev_i, next_i = _positions(n, qs)
        ends = np.cumsum(counts)  # sorted position k holds values[searchsorted(ends, k, 'right')]
        a = values[np.searchsorted(ends, np.where(prev_i < 0, n - 1, prev_i), "right")]
        b = values[np.searchsorted(ends, np.where(next_i < 0, n - 1, next_i), "right")]
        return [float(x) for x in _lerp(a, b, virtual, prev_i)]


def _sorted_table(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, how many of each) of sorted `s`; NaNs (sorted last) count as one value, as
    np.unique counts them."""
    new = np.empty(len(s), bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    if len(s) and s[-1] != s[-1]:
        new[int(np.searchsorted(s, np.nan)) + 1:] = False
    first = np.flatnonzero(new)
    return s[first], np.diff(first, append=len(s))


def _table(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending, their summed counts) of values with counts. A stable sort: the
    concatenated tables it mostly sees are ascending runs, which it merges."""
    order = np.argsort(values, kind="stable")
    s = values[order]
    v, n = _sorted_table(s)
    return v, np.add.reduceat(counts[order], np.cumsum(n) - n) if len(v) else counts[:0]


def _packed(values: list, code: str) -> np.ndarray:
    """A list of Python floats (code "d") or ints ("q") as a read-only array, packed whole: ~4x cheaper than
    np.array's element by element."""
    return np.frombuffer(struct.pack(f"{len(values)}{code}", *values), np.float64 if code == "d" else np.int64)


def _num_streamed(r: Any) -> int:
    """A request's streamed token times (0 for any other object with a Request's fields, sim.cells')."""
    return getattr(r, "num_token_times", 0)


_REASONS = (None, "length", "stop", "aborted", "rejected")
#: Each finish reason's index in _REASONS.
_CODES = {None if v is None else FinishReason(v): i for i, v in enumerate(_REASONS)}
#: The same by the reason's id: the members and None are singletons, and an int hashes without a call.
_CODE_OF_ID = {id(k): v for k, v in _CODES.items()}
#: RequestResults.add's integer columns and the request field each is read from.
_COUNTS = (("prompt_tokens", "num_prompt_tokens"), ("output_tokens", "num_output_tokens"),
           ("num_preemptions", "num_preemptions"), ("prefix_hit_tokens", "num_prefix_hit_tokens"),
           ("priority", "priority"))


class RequestResults:
    """Every request's figures as columns (numpy), filled as requests end: what the summary and
    requests.csv read, without the Request objects (or their token times). itl: the done
    (finished by length or stop) requests' inter-token gaps, as a GapCounts."""

    def __init__(self, n: int) -> None:
        f64, i64 = np.float64, np.int64
        self.req_id: list[str] = [""] * n
        self.finish_message: list[str] = [""] * n
        self.reason = np.zeros(n, np.int8)  # index in _REASONS
        self.prompt_tokens, self.output_tokens = np.zeros(n, i64), np.zeros(n, i64)
        self.num_preemptions, self.prefix_hit_tokens, self.priority = np.zeros(n, i64), np.zeros(n, i64), np.zeros(n, i64)
        self.arrival, self.first_scheduled, self.first_token, self.finish, self.tpot, self.max_tbt = (
            np.full(n, np.nan, f64) for _ in range(6))
        self.itl = GapCounts()
        self.filled = np.zeros(n, bool)

    def __len__(self) -> int:
        return len(self.req_id)

    _ARRAYS = ("reason", "prompt_tokens", "output_tokens", "num_preemptions", "prefix_hit_tokens", "priority",
               "arrival", "first_scheduled", "first_token", "finish", "tpot", "max_tbt", "filled")

    def place(self, part: "RequestResults", rows: np.ndarray) -> None:
        """`part`'s row j into my row rows[j], its gap table added to mine (a fleet's results from its
        cells', rows back in trace order)."""
        for k in self._ARRAYS:
            getattr(self, k)[rows] = getattr(part, k)
        req_id, message = self.req_id, self.finish_message
        for j, i in enumerate(rows.tolist()):
            req_id[i], message[i] = part.req_id[j], part.finish_message[j]
        self.itl.absorb(part.itl)

    @classmethod
    def of(cls, requests: Sequence[Request]) -> "RequestResults":
        out = cls(len(requests))
        out.add(range(len(requests)), requests)
        return out

    TOKENS = 1 << 18  # token times folded at once: bounds the few temporaries of that size

    def add(self, rows: Sequence[int], requests: Sequence[Request]) -> None:
        """Requests (ended, or the run is over) into rows `rows`. Each request's fields are read once,
        field by field (one column at a time); its token times in groups of about TOKENS, so that
        folding thousands of requests at once (a run's end) needs little memory."""
        n = len(requests)
        if not n:
            return
        requests = requests if isinstance(requests, list) else list(requests)
        get = operator.attrgetter
        idx = np.fromiter(rows, np.intp, n)
        # Requests (a simulation's): every field read in one compiled pass; other rows field by field.
        cols = results_columns(requests)
        if cols is not None:
            (reasons, ids, messages, arrival, scheduled, finish, prompt, output, preemptions, hits, priority, times,
             num_streamed, first, last, longest) = cols
            # Compiled fields: exactly floats and ints, packed whole (_packed).
            arrivals = _packed(arrival, "d")
            counts: Iterable[tuple[str, np.ndarray]] = zip(
                [c for c, _ in _COUNTS], (_packed(v, "q") for v in (prompt, output, preemptions, hits, priority)))
        else:
            reasons = list(map(get("finish_reason"), requests))
            ids, messages = list(map(get("req_id"), requests)), list(map(get("finish_message"), requests))
            arrivals = np.fromiter(map(get("arrival"), requests), np.float64, n)
            scheduled, finish = list(map(get("first_scheduled"), requests)), list(map(get("finish_time"), requests))
            counts = ((c, np.fromiter(map(get(f), requests), np.int64, n)) for c, f in _COUNTS)
            times = list(map(get("token_times"), requests))
        known = list(map(_CODE_OF_ID.get, map(id, reasons)))
        codes = np.fromiter(known if None not in known else map(_CODES.__getitem__, reasons), np.int8, n)
        self.reason[idx] = codes
        req_id, finish_message = self.req_id, self.finish_message
        for j, r, m in zip(idx.tolist(), ids, messages):
            req_id[j], finish_message[j] = r, m
        self.arrival[idx] = arrivals
        # None (not scheduled, not finished) becomes NaN in a float column.
        self.first_scheduled[idx] = scheduled
        self.finish[idx] = finish
        for column, values in counts:
            getattr(self, column)[idx] = values
        self.filled[idx] = True
        lens = np.fromiter(map(len, times), np.int64, n)
        ends = np.cumsum(lens)
        done = (codes == 1) | (codes == 2)
        start = 0 if ends[-1] else n  # no token times kept (all streamed): the figures are NaN, as computed
        if start:
            self.first_token[idx] = self.tpot[idx] = self.max_tbt[idx] = np.nan
        while start < n:
            before = int(ends[start - 1]) if start else 0
            end = max(int(np.searchsorted(ends, before + self.TOKENS, side="right")), start + 1)
            self._add_times(idx[start:end], times[start:end], lens[start:end], done[start:end])
            start = end
        if cols is not None:
            streamed = _packed(num_streamed, "q")
            if streamed.any():
                has = streamed > 0
                self._streamed_figures(idx[has], streamed[has], _packed(first, "d")[has], _packed(last, "d")[has],
                                       _packed(longest, "d")[has])
            return
        try:
            streamed = np.fromiter(map(get("num_token_times"), requests), np.int64, n)
        except AttributeError:  # not every one a Request (sim.cells' rows): read as _num_streamed reads them
            streamed = np.fromiter(map(_num_streamed, requests), np.int64, n)
        if streamed.any():  # their gaps are in their engine's gap table already (Engine.stream_token_times)
            self._add_streamed(idx, requests, streamed)

    def _add_streamed(self, idx: np.ndarray, requests: list[Request], streamed: np.ndarray) -> None:
        """First token, TPOT and longest gap of the requests whose engine streamed their token times,
        computed as _timeline_figures computes them from the times."""
        get = operator.attrgetter
        has = streamed > 0
        reqs = [r for r, h in zip(requests, has.tolist()) if h]
        m, rows, lens = len(reqs), idx[has], streamed[has]
        first = np.fromiter(map(get("first_token_time"), reqs), np.float64, m)
        last = np.fromiter(map(get("last_token_time"), reqs), np.float64, m)
        longest = np.fromiter(map(get("max_token_gap"), reqs), np.float64, m)
        self._streamed_figures(rows, lens, first, last, longest)

    def _streamed_figures(self, rows: np.ndarray, lens: np.ndarray, first: np.ndarray, last: np.ndarray,
                          longest: np.ndarray) -> None:
        """Rows `rows`' first token, TPOT and longest gap from their streamed figures (lens: token times, > 0)."""
        m = len(rows)
        many = lens > 1
        tpot, max_tbt = np.full(m, np.nan), np.full(m, np.nan)
        tpot[many] = (last[many] - first[many]) / (lens[many] - 1)
        max_tbt[many] = longest[many]
        self.first_token[rows], self.tpot[rows], self.max_tbt[rows] = first, tpot, max_tbt

    def _add_times(self, idx: np.ndarray, times: Sequence[list[float]], lens: np.ndarray, done: np.ndarray) -> None:
        """First token, TPOT and longest gap of requests `idx` from their token times; the done
        requests' gaps into the gap table."""
        flat = _flatten(times)
        first_token, tpot, max_tbt = _timeline_figures(flat, lens)
        self.first_token[idx], self.tpot[idx], self.max_tbt[idx] = first_token, tpot, max_tbt
        if done.all():
            self.itl.add_timelines(flat, lens)
        elif done.any():
            self.itl.add_timelines(flat[np.repeat(done, lens)], lens[done])

    def finish_reasons(self) -> list[str | None]:
        return [_REASONS[c] for c in self.reason.tolist()]

    @property
    def done(self) -> np.ndarray:
        """Finished by length or stop (not aborted, rejected or still running)."""
        return (self.reason == 1) | (self.reason == 2)


def results_of(requests: "Sequence[Request] | RequestResults") -> RequestResults:
    return requests if isinstance(requests, RequestResults) else RequestResults.of(requests)


def request_columns(requests: "Sequence[Request] | RequestResults", latencies: Any = None) -> dict[str, Any]:
    """request_table's columns (numpy arrays and lists), without pandas. `latencies`: the requests'
    RequestResults when the caller has them (anything else is ignored)."""
    res = latencies if isinstance(latencies, RequestResults) else results_of(requests)
    out_tokens = res.output_tokens.astype(np.float64)
    e2e = res.finish - res.arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        normalized = np.where(out_tokens > 0, e2e / out_tokens, np.nan)
    return dict(
        req_id=res.req_id, prompt_tokens=res.prompt_tokens, output_tokens=res.output_tokens,
        finish_reason=res.finish_reasons(), finish_message=res.finish_message, arrival=res.arrival,
        first_scheduled=res.first_scheduled, scheduling_delay=res.first_scheduled - res.arrival,
        first_token=res.first_token, finish=res.finish, ttft=res.first_token - res.arrival, tpot=res.tpot, e2e=e2e,
        normalized_latency=normalized, max_tbt=res.max_tbt, num_preemptions=res.num_preemptions,
        prefix_hit_tokens=res.prefix_hit_tokens, priority=res.priority)


def request_table(requests: "Iterable[Request] | RequestResults", latencies: Any = None):
    """One row per request: lengths, how it ended, its times and latencies (see request_columns)."""
    import pandas as pd

    return pd.DataFrame(request_columns(requests if isinstance(requests, RequestResults) else list(requests),
                                        latencies))


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
        keep = np.sort(np.append(np.arange(0, n, -(-n // max_points)), cols["kv_usage"].argmax()))
        keep = keep[np.append(True, keep[1:] != keep[:-1])]  # np.unique's, without its numpy.ma import
        cols = {k: v[keep] for k, v in cols.items()}
    return cols


def kv_usage_table(steps: Sequence, total_slots: int, max_points: int | None = 2000) -> "pd.DataFrame":  # noqa: F821
    """kv_usage_columns as a table."""
    import pandas as pd

    return pd.DataFrame(kv_usage_columns(steps, total_slots, max_points))


def _pcts(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    # One call for all: each call partitions the values anew.
    return percentiles(x, qs) if len(x) else [float("nan")] * len(qs)


def percentiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    """np.percentile(x, qs) (linear) of a non-empty 1-D array, by numpy's own steps and arithmetic,
    bit for bit; without np.percentile's np.unique, whose first call imports numpy.ma at a run's start."""
    arr = np.asanyarray(x)
    n = len(arr)
    virtual, prev_i, next_i = _positions(n, qs)
    kth = sorted({k % n for k in (0, -1, *prev_i.tolist(), *next_i.tolist())})
    part = np.partition(arr, kth)
    out = _lerp(part[prev_i], part[next_i], virtual, prev_i)
    if np.issubdtype(arr.dtype, np.inexact) and np.isnan(part[-1]):
        return [float("nan")] * len(qs)
    return [float(v) for v in out]


def _positions(n: int, qs: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.percentile's (virtual index, lower and upper neighbour) for n sorted values: -1 (the last)
    at and past the top, 0 below the bottom."""
    virtual = (n - 1) * np.true_divide(np.asanyarray(qs), 100)
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= n - 1
    prev[above] = -1
    nxt[above] = -1
    below = virtual < 0
    prev[below] = 0
    nxt[below] = 0
    return virtual, prev.astype(np.intp), nxt.astype(np.intp)


def _lerp(a: np.ndarray, b: np.ndarray, virtual: np.ndarray, prev_i: np.ndarray) -> np.ndarray:
    """np.percentile's linear interpolation between neighbours a and b, its arithmetic to the bit."""
    gamma = np.asanyarray(virtual - prev_i, dtype=virtual.dtype)
    diff = np.subtract(b, a)
    out = np.asanyarray(np.add(a, diff * gamma))
    np.subtract(b, diff * (1 - gamma), out=out, where=gamma >= 0.5, casting="unsafe", dtype=type(out.dtype))
    return out


def median(x: np.ndarray) -> float:
    """np.median(x) of a non-empty 1-D array of integers, by numpy's own steps (the mean of the one
    or two middle values), without the numpy.ma import of its first call."""
    arr = np.asanyarray(x)
    if not np.issubdtype(arr.dtype, np.integer):
        return float(np.median(arr))
    n = len(arr)
    part = np.partition(arr, [n // 2 - 1, n // 2] if n % 2 == 0 else [(n - 1) // 2])
    h = n // 2
    return float(np.mean(part[h:h + 1] if n % 2 else part[h - 1:h + 1]))


def _time_weighted_kv(c: dict[str, np.ndarray], total_slots: int) -> float:
    """Reserved KV fraction averaged over busy time (each step weighs its duration)."""
    busy = float(c["duration"].sum())
    if busy <= 0 or total_slots <= 0:
        return 0.0
    # numpy's pairwise sum, not np.dot: BLAS splits a long dot across its threads, so its last bits
    # moved with OPENBLAS_NUM_THREADS.
    return float(np.sum(c["kv_reserved_slots"] * c["duration"])) / busy / total_slots


def request_latencies(reqs: Sequence[Request]) -> dict[str, np.ndarray]:
    """Per request: arrival, first_token, finish, ttft, tpot, e2e, max_tbt (longest gap; NaN where
    undefined), and all inter-token gaps as one array (itl). Costly on long runs: compute once and
    pass it to summarize and request_columns."""
    return _latencies(reqs)[0]


def _latencies(reqs: Sequence[Request]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(request_latencies, every token time end to end, each request's count of them)."""
    times = [r.token_times for r in reqs]
    lens = np.fromiter(map(len, times), np.int64, len(times))
    flat = _flatten(times)
    arrival = np.array([r.arrival for r in reqs], np.float64)
    finish = np.array([np.nan if r.finish_time is None else r.finish_time for r in reqs], np.float64)
    first_token, tpot, max_tbt, itl = _timeline_figures(flat, lens, gaps=True)
    return dict(arrival=arrival, first_token=first_token, finish=finish, ttft=first_token - arrival, tpot=tpot,
                e2e=finish - arrival, itl=itl, max_tbt=max_tbt), flat, lens


def _flatten(times: Sequence[Sequence[float]]) -> np.ndarray:
    """Timelines end to end as one float64 array (read-only). Each packed whole by a struct of its
    length: about half the work of converting time by time (np.fromiter)."""
    packers = _PACKERS
    return np.frombuffer(b"".join([(packers.get(len(t)) or _packer(len(t)))(*t) for t in times]), np.float64)


_PACKERS: dict[int, Any] = {}  # timeline length -> its struct's pack


def _packer(n: int) -> Any:
    pack = _PACKERS[n] = struct.Struct(f"{n}d").pack
    return pack


def _timeline_figures(flat: np.ndarray, lens: np.ndarray, gaps: bool = False) -> tuple[np.ndarray, ...]:
    """(first token, TPOT, longest gap; NaN where undefined) of timelines `flat` (end to end, `lens` long
    each), and with gaps=True every gap within a timeline, end to end."""
    n = len(lens)
    first = np.cumsum(lens) - lens
    has, many = lens > 0, lens > 1
    first_token = np.full(n, np.nan)
    first_token[has] = flat[first[has]]
    tpot = np.full(n, np.nan)
    tpot[many] = (flat[first[many] + lens[many] - 1] - flat[first[many]]) / (lens[many] - 1)
    diffs = np.diff(flat)
    spans = first[has & (first > 0)] - 1  # the differences that span two timelines
    max_tbt = np.full(n, np.nan)
    if gaps:
        between = np.ones(len(diffs), bool)
        between[spans] = False
        itl = diffs[between]
    if many.any():
        # Each timeline's gaps lie end to end from its first index, then the spanning differences (made
        # -inf: no gap is) and any one-time timelines': one reduceat gives each one's longest gap.
        diffs[spans] = -np.inf
        max_tbt[many] = np.maximum.reduceat(diffs, first[many])
    return (first_token, tpot, max_tbt, itl) if gaps else (first_token, tpot, max_tbt)


def summarize(requests: "Sequence[Request] | RequestResults", steps: Sequence, total_slots: int,
              ttft_slo: float | None = None, tpot_slo: float | None = None,
              tbt_slo: float | None = None, latencies: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """One row of headline figures: throughput, latency percentiles, preemptions, KV usage, goodput
    (requests meeting every SLO set; TBT: no single gap above it, so a stall fails it). `requests`:
    the Request objects or their RequestResults (the same figures); `latencies`: unused."""
    c = step_columns(steps, tokens=False)
    res = results_of(requests)
    done = res.done
    n_done = int(done.sum())
    arrival, finish = res.arrival[done], res.finish[done]
    first_token = res.first_token[done]
    ttft_all, tpot_all, max_tbt_all = first_token - arrival, res.tpot[done], res.max_tbt[done]
    has, many = ~np.isnan(ttft_all), ~np.isnan(tpot_all)
    ttft, tpot = ttft_all[has], tpot_all[many]
    e2e_all = finish - arrival
    e2e = e2e_all[~np.isnan(finish)]
    start = min(res.arrival.tolist(), default=0.0)  # min() as over the requests (a NaN arrival stays where it is)
    end = float(np.nanmax(finish)) if n_done and not np.isnan(finish).all() else start
    span = max(end - start, 1e-9)
    out = res.output_tokens[done]
    out_tokens = int(out.sum())
    reason = res.reason
    row = dict(requests=len(res), finished=n_done,
               rejected=int((reason == 4).sum()), aborted=int((reason == 3).sum()),
               duration_s=span, requests_per_s=n_done / span, output_tokens_per_s=out_tokens / span,
               preemptions=int(res.num_preemptions.sum()),
               peak_kv_usage=int(c["kv_reserved_slots"].max(initial=0)) / max(total_slots, 1),
               mean_kv_usage=_time_weighted_kv(c, total_slots),
               mean_batch_size=float(c["num_seqs"].mean()) if len(c["num_seqs"]) else 0.0)
    for name, qv in (("ttft", _pcts(ttft, (50, 90, 99))), ("tpot", _pcts(tpot, (50, 90, 99))),
                     ("itl", res.itl.percentiles((50, 90, 99))), ("e2e", _pcts(e2e, (50, 90, 99)))):
        for q, v in zip((50, 90, 99), qv):
            row[f"{name}_p{q}"] = v
    # Over all inter-token gaps, as Sarathi-Serve reports it: the same figure as itl_p99.
    row["tbt_p99"] = row["itl_p99"]
    # Each request's longest gap: a rare stall shows here, where tbt_p99 over all gaps hides it.
    max_tbt = max_tbt_all[~np.isnan(max_tbt_all)]
    for q, v in zip((50, 90, 99), _pcts(max_tbt, (50, 90, 99))):
        row[f"max_tbt_p{q}"] = v
    # Queueing before the first step that serves a request (Sarathi-Serve's scheduling delay).
    first_scheduled = res.first_scheduled[done]
    sched = (first_scheduled - arrival)[~np.isnan(first_scheduled)]
    for q, v in zip((50, 99), _pcts(sched, (50, 99))):
        row[f"scheduling_delay_p{q}"] = v
    # vLLM's mean normalized latency: end-to-end latency over output length, averaged over requests.
    out_f = out.astype(np.float64)
    fin = ~np.isnan(finish) & (out_f > 0)
    row["normalized_latency_mean"] = float(np.mean(e2e_all[fin] / out_f[fin])) if fin.any() else float("nan")
    if ttft_slo is not None or tpot_slo is not None or tbt_slo is not None:
        ok_ttft = np.ones(n_done, bool) if ttft_slo is None else has & (np.nan_to_num(ttft_all, nan=np.inf) <= ttft_slo)
        ok_tpot = np.ones(n_done, bool) if tpot_slo is None else ~many | (np.nan_to_num(tpot_all) <= tpot_slo)
        ok_tbt = np.ones(n_done, bool)
        if tbt_slo is not None:  # a request with one token has no gap to exceed it
            ok_tbt = ~many | (np.nan_to_num(max_tbt_all) <= tbt_slo)
            row["tbt_attainment"] = int(ok_tbt.sum()) / max(len(res), 1)
        ok = int((ok_ttft & ok_tpot & ok_tbt).sum())
        row["goodput_requests_per_s"] = ok / span
        row["slo_attainment"] = ok / max(len(res), 1)
    return row
