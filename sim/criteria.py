"""Capacity criteria: when does a run at some arrival rate "serve" it? A plug-in group
(`conf/criterion/<name>.yaml`) chosen by `capacity.criterion`; it gets the per-request table and
summary row and returns a Verdict. Every probe must also be steady (`steady_state`): a finite trace
can meet a latency criterion at a rate no system sustains.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """ok: the run passes; bound_by: the condition that failed (None when ok); reason: one line."""

    ok: bool
    bound_by: str | None
    reason: str


class Criterion(ABC):
    """Subclass and implement `check`; the yaml's keys (other than `_target_`) are the
    constructor's keywords, and may interpolate the run's config (e.g. ${slo.ttft_s})."""

    name = "criterion"

    @abstractmethod
    def check(self, requests: Any, summary: Mapping[str, Any]) -> Verdict: ...


def _threshold(owner: str, key: str, value: Any, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"criterion {owner}: {key}={value!r} must be a positive number of seconds{hint}")
    return float(value)


class SloAttainment(Criterion):
    """At least `attainment` of all requests meet every SLO set (TTFT, mean TPOT, longest gap)."""

    name = "slo_attainment"

    def __init__(self, attainment: float, ttft_s: float | None = None, tpot_s: float | None = None,
                 tbt_s: float | None = None) -> None:
        if isinstance(attainment, bool) or not isinstance(attainment, (int, float)) or not 0 < attainment <= 1:
            raise ValueError(f"criterion slo_attainment: attainment={attainment!r} must be in (0, 1], e.g. 0.9")
        self.attainment = float(attainment)
        self.slos = {k: None if v is None else _threshold(self.name, k, v, "")
                     for k, v in (("ttft_s", ttft_s), ("tpot_s", tpot_s), ("tbt_s", tbt_s))}
        if all(v is None for v in self.slos.values()):
            raise ValueError("criterion slo_attainment needs an SLO: set slo.ttft_s, slo.tpot_s and/or slo.tbt_s (seconds)")

    def check(self, requests: Any, summary: Mapping[str, Any]) -> Verdict:
        n = len(requests)
        ok = requests["finish_reason"].isin(["length", "stop"]).to_numpy().copy()
        many = ~np.isnan(requests["tpot"].to_numpy(np.float64))
        if self.slos["ttft_s"] is not None:
            ok &= np.nan_to_num(requests["ttft"].to_numpy(np.float64), nan=np.inf) <= self.slos["ttft_s"]
        if self.slos["tpot_s"] is not None:
            ok &= ~many | (np.nan_to_num(requests["tpot"].to_numpy(np.float64)) <= self.slos["tpot_s"])
        if self.slos["tbt_s"] is not None:
            ok &= ~many | (np.nan_to_num(requests["max_tbt"].to_numpy(np.float64)) <= self.slos["tbt_s"])
        got = int(ok.sum()) / max(n, 1)
        text = ", ".join(f"{k[:-2].upper()} <= {v:g} s" for k, v in self.slos.items() if v is not None)
        verdict = f"{got:.1%} of requests meet {text} (need {self.attainment:.0%})"
        return Verdict(got >= self.attainment, None if got >= self.attainment else self.name, verdict)


class NormalizedLatency(Criterion):
    """vLLM (SOSP'23): mean over finished requests of end-to-end latency / output tokens <= max_s_per_token.
    Every request must finish: one rejected or aborted fails the run."""

    name = "normalized_latency"

    def __init__(self, max_s_per_token: float) -> None:
        self.max_s_per_token = _threshold(self.name, "max_s_per_token", max_s_per_token, " per output token, e.g. 0.1")

    def check(self, requests: Any, summary: Mapping[str, Any]) -> Verdict:
        lost = int((~requests["finish_reason"].isin(["length", "stop"])).sum())
        if lost:
            return Verdict(False, self.name, f"{lost} of {len(requests)} requests did not finish")
        norm = requests["normalized_latency"].to_numpy(np.float64)
        norm = norm[~np.isnan(norm)]
        if not len(norm):
            return Verdict(False, self.name, "no request has an output token to normalize by")
        mean = float(norm.mean())
        ok = mean <= self.max_s_per_token
        return Verdict(ok, None if ok else self.name,
                       f"mean normalized latency {mean:.4g} s/token (need <= {self.max_s_per_token:g})")


class TbtP99SchedDelay(Criterion):
    """Sarathi-Serve (OSDI'24): P99 over all inter-token gaps <= tbt_p99_s and the median scheduling
    delay (first scheduled - arrival) <= sched_delay_p50_s."""

    name = "tbt_p99_sched_delay"

    def __init__(self, tbt_p99_s: float | None, sched_delay_p50_s: float = 2.0) -> None:
        if tbt_p99_s is None:
            raise ValueError("criterion tbt_p99_sched_delay needs a P99 TBT bound: set slo.tbt_s (seconds), "
                             "or +capacity.criterion_options.tbt_p99_s=...")
        self.tbt_p99_s = _threshold(self.name, "tbt_p99_s", tbt_p99_s, "")
        self.sched_delay_p50_s = _threshold(self.name, "sched_delay_p50_s", sched_delay_p50_s, ", e.g. 2")

    def check(self, requests: Any, summary: Mapping[str, Any]) -> Verdict:
        lost = int((~requests["finish_reason"].isin(["length", "stop"])).sum())
        if lost:
            return Verdict(False, self.name, f"{lost} of {len(requests)} requests did not finish")
        tbt, delay = float(summary["tbt_p99"]), float(summary["scheduling_delay_p50"])
        text = (f"TBT p99 {tbt:.4g} s (need <= {self.tbt_p99_s:g}), median scheduling delay {delay:.4g} s "
                f"(need <= {self.sched_delay_p50_s:g})")
        ok = not math.isnan(tbt) and tbt <= self.tbt_p99_s and delay <= self.sched_delay_p50_s
        return Verdict(ok, None if ok else self.name, text)


def build_criterion(name: Any, options: Mapping[str, Any] | None, context: Mapping[str, Any]) -> Criterion:
    """The criterion `capacity.criterion` names, with `options` over its yaml (one-line ValueError)."""
    from varlen import registry

    crit = registry.build("criterion", name, context=context, **dict(options or {}))
    if not isinstance(crit, Criterion):
        raise ValueError(f"capacity.criterion={name}: {type(crit).__name__} is not a capacity criterion "
                         f"(a subclass of sim.criteria.Criterion)")
    return crit


def checked(crit: Criterion, requests: Any, summary: Mapping[str, Any]) -> Verdict:
    """crit.check's answer, checked: anything but a consistent Verdict is an error, never a pass."""
    v = crit.check(requests, summary)
    if not isinstance(v, Verdict) or not isinstance(v.ok, (bool, np.bool_)):
        raise TypeError(f"criterion {type(crit).__name__}.check returned {v!r}; it must return "
                        f"sim.criteria.Verdict(ok: bool, bound_by: str | None, reason: str)")
    if not v.ok and not v.bound_by:
        return Verdict(False, getattr(crit, "name", type(crit).__name__), v.reason)
    return Verdict(bool(v.ok), None if v.ok else v.bound_by, str(v.reason))


@dataclass(frozen=True)
class SteadyState:
    """Thresholds of the steady-state test (capacity.steady_state in the config)."""

    warmup_fraction: float = 0.1     # of the arrival window, at least; more when latencies are longer
    warmup_latency_quantile: float = 0.9  # warm-up lasts at least this quantile of end-to-end latency
    min_completion_ratio: float = 0.95  # completion rate / arrival rate within the judged window
    max_queue_growth: float = 0.1    # growth of the unscheduled queue, per arrival (slope / arrival rate)
    max_warmup_fraction: float = 0.5  # a longer warm-up leaves too short a window to see a slow overload
    min_window_requests: int = 20    # fewer arrivals than this in the judged window: cannot tell, fails

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> "SteadyState":
        opts = dict(options or {})
        unknown = set(opts) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"capacity.steady_state: unknown setting(s) {', '.join(sorted(unknown))}; "
                             f"the settings are {', '.join(cls.__dataclass_fields__)}")
        s = cls(**opts)
        for k in ("warmup_fraction", "warmup_latency_quantile", "min_completion_ratio", "max_warmup_fraction"):
            v = getattr(s, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"capacity.steady_state.{k}={v!r} must be a fraction in [0, 1]")
        if isinstance(s.max_queue_growth, bool) or not isinstance(s.max_queue_growth, (int, float)) \
                or not s.max_queue_growth >= 0:
            raise ValueError(f"capacity.steady_state.max_queue_growth={s.max_queue_growth!r} must be >= 0, e.g. 0.1")
        if isinstance(s.min_window_requests, bool) or not isinstance(s.min_window_requests, int) \
                or s.min_window_requests < 1:
            raise ValueError(f"capacity.steady_state.min_window_requests={s.min_window_requests!r} must be an integer >= 1")
        return s


def steady_state(requests: Any, s: SteadyState = SteadyState()) -> Verdict:
    """Whether completions keep up with arrivals and the unscheduled queue does not grow, judged over
    the arrival window less a warm-up (longer than max_warmup_fraction fails); the drain is never judged."""
    arrival = requests["arrival"].to_numpy(np.float64)
    finish = requests["finish"].to_numpy(np.float64)
    t0, t1 = float(arrival.min()), float(arrival.max())
    e2e = finish - arrival
    e2e = e2e[~np.isnan(e2e)]
    latency = float(np.quantile(e2e, s.warmup_latency_quantile)) if len(e2e) else math.inf
    start = t0 + max(s.warmup_fraction * (t1 - t0), latency)
    if start - t0 > s.max_warmup_fraction * (t1 - t0):
        return Verdict(False, "throughput",
                       f"steady state cannot be judged: the p{s.warmup_latency_quantile * 100:g} latency {latency:.3g} s "
                       f"is over {s.max_warmup_fraction:.0%} of the {t1 - t0:.3g} s arrival window, too short to "
                       f"show a slow overload; the rate is not shown sustainable (a longer trace, workload.limit, tells)")
    in_window = (arrival >= start) & (arrival <= t1)
    arrived = int(in_window.sum())
    if arrived < s.min_window_requests:
        return Verdict(False, "throughput",
                       f"steady state cannot be judged: {arrived} arrivals after the {start - t0:.3g} s warm-up "
                       f"< {s.min_window_requests}: the rate is not shown sustainable (a longer trace tells)")
    # Least-squares slopes of in-system and unscheduled counts, less what a steady state would hold.
    times = np.linspace(start, t1, 256)
    arrived_by = np.searchsorted(np.sort(arrival), times, side="right")

    def slope(leave: np.ndarray) -> float:
        leave = np.where(np.isnan(leave), np.inf, leave)
        stay = np.sort(leave - arrival)
        since = times[:, None] - arrival[None, :]
        expected = np.where(since >= 0, 1 - np.searchsorted(stay, since, side="right") / len(stay), 0).sum(axis=1)
        count = (arrived_by - np.searchsorted(np.sort(leave), times, side="right")).astype(np.float64)
        return float(np.polyfit(times, count - expected, 1)[0]) if t1 > start else 0.0

    rate = arrived / max(t1 - start, 1e-12)
    ratio = 1 - slope(finish) / rate
    if ratio < s.min_completion_ratio:
        return Verdict(False, "throughput", f"completions keep up with {ratio:.0%} of arrivals after the warm-up "
                                            f"(need >= {s.min_completion_ratio:.0%})")
    sched = requests["first_scheduled"].to_numpy(np.float64)
    growth = slope(np.where(np.isnan(sched), finish, sched)) / rate  # a rejected request leaves when it ends
    if growth > s.max_queue_growth:
        return Verdict(False, "queue_growth", f"the unscheduled queue grows by {growth:.2f} per arrival after "
                                              f"the warm-up (need <= {s.max_queue_growth:g})")
    return Verdict(True, None, f"steady: completions keep up with {ratio:.0%} of arrivals, queue growth {growth:+.2f} per arrival")
