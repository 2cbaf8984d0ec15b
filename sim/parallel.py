"""Tensor and pipeline parallelism in the simulator (`parallel.tensor=N`, `parallel.pipeline=M`).
TP shards GEMMs and heads and pays two all-reduces per layer; PP is M virtual engines per replica
with 1/M of the KV pool each, every batch taking the whole pipeline's latency (no bubbles). The KV
pool is what fits on the fullest GPU beside its share of the weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from sim.cost.communication import CommunicationCostModel
from sim.cost.hardware import MOE_WIDTH_FIELDS, HardwareSpec, ModelShape, load_model_config

__all__ = ["Capacity", "CommunicationCostModel", "Parallelism", "capacity", "shard_config"]


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def of(cls, d: Mapping[str, Any] | None) -> Parallelism:
        d = dict(d or {})
        tp, pp = d.get("tensor"), d.get("pipeline")
        p = cls(1 if tp is None else int(tp), 1 if pp is None else int(pp))
        if p.tensor < 1 or p.pipeline < 1:
            raise ValueError(f"parallel.tensor={p.tensor} parallel.pipeline={p.pipeline}: both must be >= 1")
        return p

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline

    def check(self, shape: ModelShape) -> None:
        """Reject a split the model's shape does not allow (one line, the fix in it)."""
        tp, pp = self.tensor, self.pipeline
        if shape.heads % tp:
            raise ValueError(f"parallel.tensor={tp} does not divide the model's {shape.heads} attention heads; "
                             f"use a divisor of {shape.heads}")
        if shape.kv_heads % tp and tp % shape.kv_heads:
            raise ValueError(f"parallel.tensor={tp} and the model's {shape.kv_heads} KV heads: one must divide the "
                             f"other (each GPU holds whole KV heads, or a replica of one)")
        if pp > shape.layers:
            raise ValueError(f"parallel.pipeline={pp} exceeds the model's {shape.layers} layers")


def shard_config(cfg: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """The HF config of one GPU of a TP group: heads, KV heads, MLP width, vocabulary divided by TP."""
    c = dict(cfg.get("text_config", cfg))
    if tp == 1:
        return dict(cfg)
    shape = ModelShape.from_config(c)
    c.update(num_attention_heads=shape.heads // tp, num_key_value_heads=max(shape.kv_heads // tp, 1),
             head_dim=shape.head_dim, intermediate_size=shape.intermediate // tp,
             vocab_size=math.ceil(shape.vocab / tp))
    c.update({k: int(c[k]) // tp for k in MOE_WIDTH_FIELDS if c.get(k)})  # each expert split over the group
    return c


@dataclass(frozen=True)
class Capacity:
    """Per-GPU memory of one replica's fullest GPU and the KV tokens it leaves room for."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    usable_bytes_per_gpu: float
    kv_tokens: int  # per replica: tokens whose KV fits on every GPU of it


def capacity(model_config: Mapping[str, Any], hardware: HardwareSpec, par: Parallelism,
             memory_fraction: float, dtype_bytes: int | None = None, name: str | None = None) -> Capacity:
    """KV tokens per replica; ValueError with the numbers when the weights do not fit."""
    shape = ModelShape.from_config(load_model_config(model_config))
    par.check(shape)
    d = int(dtype_bytes or hardware.dtype_bytes)
    usable = hardware.memory_bytes * memory_fraction
    if par.gpus == 1:
        # The roofline's own arithmetic, so single-GPU runs keep their KV pool exactly.
        weights = float(shape.num_params * d)
        per_token = float(shape.kv_bytes_per_token(d))
        tokens = max(0, int((usable - weights) // per_token))
    else:
        s = ModelShape.from_config(shard_config(dict(load_model_config(model_config)), par.tensor))
        pp = par.pipeline
        counts = [shape.layers // pp + (1 if i < shape.layers % pp else 0) for i in range(pp)]
        emb = s.vocab * s.hidden
        head = 0 if (shape.tied_embeddings and pp == 1) else emb
        stages = []
        for i, n in enumerate(counts):
            w = n * s.layer_params + (emb if i == 0 else 0) + ((head + s.hidden) if i == pp - 1 else 0)
            stages.append((w * d, n * 2 * s.kv_dim * d))
        tokens = min(max(0, int((usable - w) // kv)) for w, kv in stages)
        weights, per_token = max(w for w, _ in stages), max(kv for _, kv in stages)
    label = name or "the model"
    where = (f"{hardware.name} with parallel.tensor={par.tensor} parallel.pipeline={par.pipeline}")
    if weights >= usable:
        need = math.ceil(weights * par.gpus / usable)
        raise ValueError(f"{label} does not fit on {where}: {weights / 1e9:.1f} GB of weights per GPU vs "
                         f"{usable / 1e9:.1f} GB usable ({memory_fraction:g} x {hardware.memory_gb:g} GB); "
                         f"use at least {need} GPUs (parallel.tensor x parallel.pipeline)")
    return Capacity(weights, per_token, usable, tokens)
