"""Progress of a running simulation: requests done of the total, simulated time, wall rate, ETA.

A command turns it on for its simulations (`with showing(interval_s=...)`, from the `progress`
settings); `sim.simulator.simulate` then asks `for_run` for a hook, which its event loop calls
every few thousand events. On a terminal it draws a tqdm bar; otherwise (a pipe, CI, a log file)
it writes one plain line to stderr every `interval_s` seconds of wall time.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator, Sequence


@dataclass(frozen=True)
class Settings:
    interval_s: float = 5.0
    label: str = "simulating"
    stream: IO[str] | None = None  # None: sys.stderr at the time of the run
    tty: bool | None = None  # None: the stream's isatty()
    sink: Callable[[float, int, int], None] | None = None  # instead of lines: sink(simulated s, done, total)


_active: list[Settings] = []  # innermost last; empty: no progress shown


@contextmanager
def showing(interval_s: float = 5.0, label: str = "simulating", stream: IO[str] | None = None,
            tty: bool | None = None, enabled: bool = True,
            sink: Callable[[float, int, int], None] | None = None) -> Iterator[None]:
    """Show the progress of every simulation run inside the block (enabled=False: none); sink:
    hand the figures to it every interval_s instead (a cell reporting to its fleet's line)."""
    if not enabled:
        yield
        return
    _active.append(Settings(float(interval_s), label, stream, tty, sink))
    try:
        yield
    finally:
        _active.pop()


@contextmanager
def labelled(label: str) -> Iterator[None]:
    """Name the simulations inside the block (a capacity probe, a search point) in their progress."""
    if not _active:
        yield
        return
    s = _active[-1]
    _active.append(Settings(s.interval_s, label, s.stream, s.tty, s.sink))
    try:
        yield
    finally:
        _active.pop()


def settings() -> Settings | None:
    """The innermost `showing` block's settings, or None when no command asked for progress."""
    return _active[-1] if _active else None


def for_run(total: int) -> Progress | None:
    """A hook for one simulation of `total` requests, or None when no command asked for progress."""
    return Progress(total, _active[-1]) if _active else None


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Called by the event loop as hook(simulated time, requests arrived, replicas); cheap unless a
    line is due: the requests done are counted only then."""

    def __init__(self, total: int, settings: Settings):
        self.total, self.settings = total, settings
        self.stream = settings.stream if settings.stream is not None else sys.stderr
        tty = settings.tty
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.bar: Any = None
        if tty and settings.sink is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc=settings.label, file=self.stream, leave=False,
                            dynamic_ncols=True, mininterval=min(0.1, settings.interval_s))
        self.t0 = self.last = time.monotonic()
        self.lines = 0

    def __call__(self, sim_time: float, arrived: int, replicas: Sequence[Any]) -> None:
        now = time.monotonic()
        if self.bar is None and now - self.last < self.settings.interval_s:
            return
        # Requests routed and no longer held by their engine are done (finished or rejected).
        done = arrived - sum(len(r.engine.requests) for r in replicas)
        self.show(sim_time, done, now)

    def show(self, sim_time: float, done: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last = now
        if self.settings.sink is not None:
            self.settings.sink(sim_time, done, self.total)
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"simulated {sim_time:,.1f} s", refresh=False)
            self.bar.update(done - self.bar.n)
            return
        wall = now - self.t0
        rate = done / wall if wall > 0 else 0.0
        eta = _duration((self.total - done) / rate) if rate > 0 else "?"
        pct = done / self.total if self.total else 1.0
        print(f"{self.settings.label}: {done:,}/{self.total:,} requests done ({pct:.0%}), simulated "
              f"{sim_time:,.1f} s, {rate:,.0f} requests/s of wall time, elapsed {_duration(wall)}, ETA {eta}",
              file=self.stream, flush=True)
        self.lines += 1

    def close(self, sim_time: float, done: int) -> None:
        """The run ended: a last line when the run was long enough to have shown any."""
        if self.bar is not None:
            self.show(sim_time, done)
            self.bar.refresh()  # the last figures, whatever tqdm's own pacing skipped
            self.bar.close()
        elif time.monotonic() - self.t0 >= self.settings.interval_s:
            self.show(sim_time, done)
