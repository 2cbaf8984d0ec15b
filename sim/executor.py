"""The simulator's executor: a cost model instead of a forward pass, a simulated clock instead of
the wall. Plugged into the engine loop (`varlen.engine.Engine`, or `sim.fast_forward.FastForwardEngine`,
which times stretches of pure-decode steps through `decode_run`), so every scheduling decision in
a simulation is the engine's own."""

from __future__ import annotations

import math
from typing import Callable, Final, Sequence

from mypy_extensions import mypyc_attr

from sim.cost.base import FORMULA, CostModel, StepSums
from sim.fast_forward import FastForwardExecutor
from varlen.clock import SimClock
from varlen.kv.base import KVAllocator
from varlen.promises import keeps_promise
from varlen.request import Request

#: What a simulated request "samples": with no EOS or stop tokens only max_tokens ends a request.
SIM_TOKEN: Final = 0  # Final: compiled, a constant rather than a module lookup per request


@mypyc_attr(allow_interpreted_subclasses=True)
class CostModelExecutor(FastForwardExecutor):
    """Advances the clock by the cost model's time and samples SIM_TOKEN wherever the real executor would."""

    def __init__(self, cost: CostModel, clock: SimClock):
        self.cost, self.clock = cost, clock
        # A cost model's shortcuts hold only for the class defining them (varlen/promises.py).
        self._sums = cost.uses_sums and keeps_promise(cost, ("step_time_sums", *FORMULA), ("step_time",), CostModel)
        self._decode = (self._sums and type(cost).next_start is CostModel.next_start
                        and keeps_promise(cost, "decode_step_time", ("step_time_sums",), CostModel))
        self._decode_fns: dict[int, Callable[[int], float]] = {}  # batch size -> cost.decode_step_time
        self._known: list[float] = []  # end times of the pure-decode stretch timed last (decode_run)
        self._known_seqs, self._known_cached, self._known_start = 0, 0, 0.0  # its batch size, cached tokens, start

    def execute(self, scheduled: Sequence[tuple[Request, int]], kv: KVAllocator) -> list[int | None]:
        out: list[int | None] = []
        sampled = 0
        if self._sums:
            tn = tc = tnc = tnn = prefills = 0
            for r, n in scheduled:
                c = r.num_computed_tokens
                tn += n
                tc += c
                tnc += n * c
                tnn += n * n
                if n > 1:
                    prefills += 1
                if c + n == r.num_prompt_tokens + len(r.output_token_ids):
                    out.append(SIM_TOKEN)
                    sampled += 1
                else:
                    out.append(None)
            self.advance_step(len(scheduled), tn, tc, tnc, tnn, sampled, prefills)
            return out
        else:
            new, cached = [], []
            for r, n in scheduled:
                c = r.num_computed_tokens
                new.append(n)
                cached.append(c)
                if c + n == r.num_tokens:
                    out.append(SIM_TOKEN)
                    sampled += 1
                else:
                    out.append(None)
            dt = step_seconds(self.cost, self.cost.step_time(new, cached, sampled))
        self.clock.advance(dt)
        return out

    def advance_step(self, num_seqs: int, new: int, cached: int, new_cached: int, new_sq: int, num_logits: int,
                     num_prefills: int) -> int:
        # The sums path of execute(), also FastForwardEngine's fused step (fuses_steps).
        sums = StepSums(num_seqs, new, cached, new_cached, new_sq, num_logits, num_prefills)
        self.clock.advance(step_seconds(self.cost, self.cost.step_time_sums(sums)))
        return SIM_TOKEN

    def fuses_steps(self) -> bool:
        # This very class only, its cost model keeping the sums promise: a subclass's execute() is called.
        return type(self) is CostModelExecutor and self._sums

    def decode_run(self, batch: Sequence[Request], max_steps: int, until: float) -> tuple[int, list[float]] | None:
        if not self._decode:
            return None
        num_seqs = len(batch)
        step_time: Callable[[int], object] | None = self._decode_fns.get(num_seqs)
        if step_time is None:
            step_time = self._decode_fns[num_seqs] = self.cost.decode_step_time(num_seqs)
        t = self.clock.now()
        reqs: list[Request] = batch if isinstance(batch, list) else list(batch)
        cached = 0
        for r in reqs:
            cached += r.num_computed_tokens
        # Its times depend on (start, batch size, cached tokens) only: the stretch timed last (a replica's
        # horizon times it ahead of the steps) is reused from any of its step boundaries, and extended.
        known = self._known
        ends: list[float] = []
        j = (cached - self._known_cached) // num_seqs
        if (num_seqs == self._known_seqs and cached - self._known_cached == j * num_seqs and 0 <= j <= len(known)
                and t == (self._known_start if j == 0 else known[j - 1])):
            while j < len(known) and len(ends) < max_steps and t < until:
                t = known[j]
                ends.append(t)
                j += 1
            cached += len(ends) * num_seqs
            extend = j == len(known)
        else:
            known = self._known = []
            self._known_seqs, self._known_cached, self._known_start = num_seqs, cached, t
            extend = True
        # The clock's own sum, one step at a time: bit-identical end times.
        reused = len(ends)
        for _ in range(max_steps - reused):
            if t >= until:
                break
            t += step_seconds(self.cost, step_time(cached))
            ends.append(t)
            cached += num_seqs
        if extend and len(ends) > reused:
            known.extend(ends[reused:])  # the same float objects: each end boxed once
        return SIM_TOKEN, ends

    def times_prefixes(self) -> bool:
        # This very class only: a subclass's decode_run is its own.
        return type(self) is CostModelExecutor

    def idle_past_until(self) -> bool:
        # This very class only: a subclass's decode_run is its own.
        return type(self) is CostModelExecutor

    def ready_time(self, now: float) -> float:
        """When the next step may start: now, unless the cost model replays a recorded timeline."""
        t: object = self.cost.next_start(now)
        if isinstance(t, (int, float)) and not isinstance(t, bool) and now <= t < math.inf:
            return float(t)
        raise ValueError(f"cost model {type(self.cost).__name__} returned next_start({now!r}) = {t!r}; "
                         f"a step starts at a finite time no earlier than now")


def step_seconds(cost: CostModel, dt: object) -> float:
    """A cost model's step time checked as it enters the clock: finite and >= 0, else one line naming it."""
    if isinstance(dt, float):
        if 0.0 <= dt < math.inf:
            return dt
    elif isinstance(dt, int) and not isinstance(dt, bool) and dt >= 0:
        return float(dt)
    raise ValueError(f"cost model {type(cost).__name__} returned a step time of {dt!r} seconds; "
                     f"a step time is a finite number of seconds >= 0")
