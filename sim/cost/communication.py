"""Tensor / pipeline parallel communication on top of a per-GPU cost model (sim/parallel.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from sim.cost.base import CostModel, StepFixed
from sim.cost.hardware import HardwareSpec, ModelShape


@mypyc_attr(allow_interpreted_subclasses=True)
class CommunicationCostModel(CostModel):
    """A per-GPU model plus 2 all-reduces per layer and pipeline - 1 send/recvs, added last."""

    def __init__(self, inner: CostModel, shape: ModelShape, hardware: HardwareSpec, tensor: int, pipeline: int,
                 profiles: str | os.PathLike | None = None, dtype_bytes: int | None = None):
        from sim.cost.collectives import Collectives
        from sim.cost.profiles import GRID_TOKENS, load_profiles

        self.inner, self.shape, self.tensor, self.pipeline = inner, shape, tensor, pipeline
        self.comm = Collectives(hardware.node, load_profiles(profiles))
        if hardware.node is None:
            raise ValueError(f"hardware {hardware.name!r} names no node (hardware.node) to time tensor/pipeline "
                             f"communication with; set e.g. hardware.node=h100_dgx to borrow its collective tables")
        d = int(dtype_bytes or hardware.dtype_bytes)
        tokens = np.arange(GRID_TOKENS + 1, dtype=np.float64)
        act: Any = tokens * shape.hidden * d
        ms = shape.layers * 2.0 * self.comm.all_reduce_ms(act, tensor)
        if pipeline > 1:
            ms = ms + (pipeline - 1) * self.comm.send_recv_ms(act)
        ms[0] = 0.0
        self._comm: list[float] = (ms * 1e-3).tolist()
        self.notes = [*getattr(inner, "notes", []), *self.comm.notes]

    @property
    def overhead_form(self) -> tuple[float, float, float]:
        form: tuple[float, float, float] = getattr(self.inner, "overhead_form")
        return form

    def communication_s(self, tokens: float) -> float:
        t, n = int(tokens), len(self._comm) - 1
        return self._comm[t] if t <= n else self._comm[n] * t / n

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        f = self.inner.step_fixed(num_seqs, new, num_logits, num_prefills)
        f.communication_s = self.communication_s(new)
        return f

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        return self.inner.layer_attention(f, pairs, cached)

    def step_total(self, f: StepFixed, attention: float) -> float:
        return self.inner.step_total(f, attention) + f.communication_s
