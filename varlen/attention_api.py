"""The attention plug point: a backend owns its KV layout and per-step metadata; the model runner
calls `prepare` once per step and `forward` once per layer. GPU kernels are imported lazily."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from varlen.batch import ForwardBatch


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine; the message says what is missing and how to install it."""


def first_line(exc: BaseException) -> str:
    """An import error in one line, for BackendUnavailable messages (a broken install's can run long)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class AttentionMetadata:
    """What every backend needs on the device; backends subclass it to add their own."""

    slot_mapping: torch.Tensor  # [N] int64
    batch: ForwardBatch  # the host-side description, for host-side loops and planning


# Optional features a layer may use beyond causal softmax(q·k * scale)·v, which every backend computes.
FEATURES = ("sliding_window", "softcap", "sinks")

#: A capability for `features`: with `batch_invariant=True` each request's attention is bitwise as alone.
BATCH_INVARIANT = "batch_invariant"


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention (transformers' conventions): sliding_window W, position p sees keys
    p-W+1..p; softcap c, scores -> c*tanh(scores/c) (Gemma 2); sinks [Hq], per-head logits joining
    the softmax denominator only (gpt-oss `s_aux`)."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)  # the model's own parameter

    @property
    def features(self) -> frozenset[str]:
        return frozenset(f for f, on in zip(FEATURES, (self.sliding_window is not None, self.softcap is not None,
                                                        self.sinks is not None)) if on)


class AttentionBackend(ABC):
    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    block_size_multiple: ClassVar[int] = 1  # e.g. 256 for PyPI flash-attn 2.x paged KV
    # FEATURES it implements (and BATCH_INVARIANT); an undeclared one is refused at bind/construction.
    features: ClassVar[frozenset[str]] = frozenset()
    layers: tuple[LayerAttention, ...] = ()  # set by bind
    batch_invariant: bool = False  # the constructor option (only a backend declaring BATCH_INVARIANT takes True)

    def __init__(self, batch_invariant: bool = False) -> None:
        if batch_invariant and BATCH_INVARIANT not in self.features:
            raise ValueError(f"backend {self.name!r} has no batch-invariant mode (its features do not declare "
                             f"{BATCH_INVARIANT!r}); use torch_ref, torch_sdpa or torch_paged, or batch_invariant=false")
        self.batch_invariant = batch_invariant

    def bind(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             device: torch.device | str, layers: Sequence[LayerAttention] = (), model_name: str = "model") -> None:
        """The model's attention, once; a layer needing a missing feature is refused (not wrong logits)."""
        for feature in FEATURES:  # first: a missing feature is missing on every machine
            if feature in self.features:
                continue
            using = [i for i, spec in enumerate(layers) if feature in spec.features]
            if using:
                have = ", ".join(f for f in FEATURES if f in self.features) or "none of the optional features"
                raise ValueError(
                    f"{model_name}: layer(s) {_ranges(using)} use {feature}, which backend {self.name!r} does "
                    f"not implement (it supports: {have}); use backend=torch_ref or a backend that declares it")
        self.check(device, dtype, block_size)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype, self.block_size, self.device = dtype, block_size, torch.device(device)
        self.layers = tuple(layers)

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        """Raise ValueError (bad setting) or BackendUnavailable (missing library/hardware)."""
        device = torch.device(device)
        if device.type not in self.devices:
            raise ValueError(f"backend {self.name!r} runs on {', '.join(self.devices)}, not {device.type}: "
                             f"choose the device (engine.device=... / LLM(device=...)) or another backend")
        if dtype not in self.dtypes:
            raise ValueError(f"backend {self.name!r} supports dtypes {[str(d) for d in self.dtypes]}, not {dtype}")
        if block_size < 1 or block_size % self.block_size_multiple:
            raise ValueError(f"backend {self.name!r} needs a block size that is a positive multiple of "
                             f"{self.block_size_multiple}, got {block_size}")

    def require_cuda(self, install_hint: str) -> None:
        """For GPU backends' `check`: one line naming what is missing and how to get it."""
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"backend {self.name!r} needs an NVIDIA GPU, but torch {torch.__version__} sees no CUDA "
                f"device; on a GPU machine install the kernels with {install_hint}")

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache. Default: K and V stacked, NHD inside each block."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> Any:
        """Once per step: move/plan the metadata the layers need (after bind: the shapes are known)."""
        return AttentionMetadata(slot_mapping=self.upload_slot_mapping(batch, device), batch=batch)

    @staticmethod
    def upload_slot_mapping(batch: ForwardBatch, device: torch.device | str) -> torch.Tensor:
        return torch.from_numpy(batch.slot_mapping).to(device, non_blocking=True)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, scale: float) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] → [N, Hq, D], k/v written at the slot mapping first. With
        features, also `layer=` (LayerAttention); never read keys older than a sliding window."""


def _ranges(idx: Sequence[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, [*idx[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)
