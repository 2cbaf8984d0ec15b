"""The replay cost model: recorded step durations played back, to prove the simulator makes the
engine's decisions."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from mypy_extensions import mypyc_attr
from numpy.typing import ArrayLike

from sim.cost.base import CostModel, load_path, one_gpu


@mypyc_attr(allow_interpreted_subclasses=True)
class ReplayCostModel(CostModel):
    """Recorded step durations in order, whatever the batch (a divergence is a scheduling difference);
    with `starts`, the engine's waits between steps too."""

    def __init__(self, durations: Sequence[float] | str | os.PathLike,
                 starts: Sequence[float] | None = None):
        if isinstance(durations, (str, os.PathLike)):
            text = Path(durations).read_text()
            values: Sequence[Any] = json.loads(text) if text.lstrip().startswith("[") else text.split()
        else:
            values = durations
        self.durations = [float(d) for d in values]
        self.starts = None if starts is None else [float(t) for t in starts]
        if self.starts is not None and len(self.starts) != len(self.durations):
            raise ValueError(f"{len(self.starts)} start times for {len(self.durations)} durations")
        self.position = 0

    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """cost.path: a durations file; one GPU."""
        one_gpu("replay", parallel, "replays or fits one measured engine as it ran")
        return load_path(options, "replay", "a durations file (a JSON list or one number per line)", cls)

    @classmethod
    def from_steps(cls, steps: Sequence[Any], timeline: bool = True) -> ReplayCostModel:
        """From an engine's step log; timeline=True also replays the start times."""
        return cls([s.duration for s in steps], [s.start for s in steps] if timeline else None)

    @property
    def remaining(self) -> int:
        return len(self.durations) - self.position

    def reset(self) -> None:
        self.position = 0

    def next_start(self, now: float) -> float:
        """The recorded start of the next step (never before `now`); `now` without a timeline."""
        if self.starts is None or self.position >= len(self.starts):
            return now
        return max(now, self.starts[self.position])

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        if self.position >= len(self.durations):
            raise RuntimeError(f"replay exhausted: the simulator asked for step {self.position + 1} "
                               f"but only {len(self.durations)} were recorded")
        d = self.durations[self.position]
        self.position += 1
        return d
