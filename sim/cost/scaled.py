"""A cost model's step times on a machine that runs steps a known factor slower or faster than the one
it was timed on (`cost.time_scale`): every step's time, and each part of it, multiplied by one factor.

The factor comes from outside the simulation, e.g. a short reference workload timed on both machines
(benchmarks/sim_fidelity.py's speed probe): 1.08 says steps take 8% longer here than where the model's
tables or fit were taken.
"""

from __future__ import annotations

import math
from typing import Any

from sim.cost.base import CostModel, StepFixed, StepSums, formula_holds


def check_time_scale(scale: Any) -> float:
    """`scale` as a float; ValueError in one line unless it is a finite number above 0."""
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
    if not ok:
        raise ValueError(f"cost.time_scale={scale!r}: must be a finite number above 0 (this machine's step time "
                         f"over the one the cost model was timed at, e.g. 1.08 for 8% slower); 1 leaves it as is")
    return float(scale)


class ScaledCostModel(CostModel):
    """`inner`'s step formula with its total multiplied by `scale`: step_time, the decode closure and
    every part sim.explain shows are `scale` x inner's (the same floats, then one multiply)."""

    def __init__(self, inner: CostModel, scale: float) -> None:
        self.scale = check_time_scale(scale)
        cls = type(inner)
        # A model without a step formula, or with start times of its own (replay), times steps by
        # rules this wrapper cannot scale without changing what they mean.
        if not formula_holds(cls) or cls.next_start is not CostModel.next_start:
            raise ValueError(f"cost.time_scale: {cls.__name__} has no step formula to scale (it times steps by "
                             f"step_time or replays start times); scale needs roofline, measured or profiled")
        self.inner = inner
        self.notes = [*getattr(inner, "notes", []), f"time scale: every step x {self.scale:g} (cost.time_scale)"]

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        return self.inner.step_fixed(num_seqs, new, num_logits, num_prefills)

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        return self.inner.layer_attention(f, pairs, cached)

    def step_total(self, f: StepFixed, attention: float) -> float:
        return self.inner.step_total(f, attention) * self.scale

    def parts(self, s: StepSums) -> dict[str, float | None]:
        return {k: None if v is None else v * self.scale for k, v in self.inner.parts(s).items()}

    @property
    def overhead_form(self) -> tuple[float, float, float]:
        base, per_seq, per_prefill = getattr(self.inner, "overhead_form")
        return base * self.scale, per_seq * self.scale, per_prefill * self.scale
