"""Where time comes from: the wall in a real run, the event loop in a simulation."""

from __future__ import annotations

import time


class WallClock:
    """Seconds since the clock was made."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class SimClock:
    """Simulated seconds; only the simulation moves it."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
