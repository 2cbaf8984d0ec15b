"""`backend=auto`: the fastest exact attention backend for this device, dtype and model.

The rule lives here and nowhere else: walk the device's backends from fastest to slowest and take
the first that declares every feature the model's layers use, takes the dtype, and runs its own
kernels here (a missing library, GPU or C compiler rules a backend out). The choice, and what was
passed over, is announced in one line. An explicitly named backend never comes through here: one
that cannot serve the model is refused at bind, not swapped.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch

from varlen import registry
from varlen.attention_api import BATCH_INVARIANT, FEATURES, AttentionBackend, BackendUnavailable, LayerAttention

#: Fastest first, per device type.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("torch_paged", "torch_sdpa", "torch_ref"),
    "cuda": ("flashinfer", "flash_attn", "triton", "torch_sdpa", "torch_ref"),
}

#: (name, device, dtype, block size, features needed) -> why the backend cannot serve, or None.
Probe = Callable[[str, torch.device, torch.dtype, int, frozenset], "str | None"]


def why_not(name: str, device: torch.device, dtype: torch.dtype, block_size: int, needs: frozenset) -> str | None:
    """Why backend `name` cannot run this model here at full speed, in a few words; None if it can."""
    cls = registry.target("backend", name)
    missing = sorted(needs - cls.features)
    if missing:
        return f"lacks {', '.join(missing)}"
    try:
        backend = cls()
        backend.check(device, dtype, block_size)
    except (BackendUnavailable, ValueError, ImportError) as err:
        return str(err).splitlines()[0][:160]
    slow = getattr(backend, "slow_path_reason", None)  # a backend that would run another's code instead
    return slow(dtype) if slow is not None else None


def declared(name: str, device: torch.device, dtype: torch.dtype, block_size: int, needs: frozenset) -> str | None:
    """`why_not` on a machine where every backend's kernels are installed: features, devices and
    dtypes only (for documentation: the README's architecture table)."""
    cls = registry.target("backend", name)
    missing = sorted(needs - cls.features)
    if missing:
        return f"lacks {', '.join(missing)}"
    if device.type not in cls.devices or dtype not in cls.dtypes:
        return f"does not run {device.type} {str(dtype).removeprefix('torch.')}"
    return None


def choose(device: torch.device | str, dtype: torch.dtype, block_size: int, needs: frozenset,
           probe: Probe = why_not) -> tuple[str, list[str]]:
    """(the backend to use, 'name: why not' for each faster one passed over); ValueError if none fits."""
    device = torch.device(device)
    order = PREFERENCE.get(device.type)
    if order is None:
        raise ValueError(f"backend=auto knows no backends for device {device.type!r} (it knows "
                         f"{', '.join(PREFERENCE)}); name a backend explicitly")
    passed = []
    for name in order:
        reason = probe(name, device, dtype, block_size, needs)
        if reason is None:
            return name, passed
        passed.append(f"{name}: {reason}")
    raise ValueError(f"backend=auto: no backend can serve this model on {device.type} "
                     f"{str(dtype).removeprefix('torch.')} ({'; '.join(passed)})")


def announcement(name: str, passed: Sequence[str], device: torch.device | str, dtype: torch.dtype) -> str:
    """The one line a run prints, e.g. 'backend: auto -> torch_paged (cpu float32)'."""
    where = f"{torch.device(device).type} {str(dtype).removeprefix('torch.')}"
    return f"backend: auto -> {name} ({where}{'; passed over ' + '; '.join(passed) if passed else ''})"


class AutoBackend(AttentionBackend):
    """Stands in for the backend `choose` picks when the model is bound, then is that backend:
    `name`, `prepare`, `forward` and the KV cache are the chosen one's (`chosen` holds it)."""

    name = "auto"
    features = frozenset({*FEATURES, BATCH_INVARIANT})  # what some backend of the device has; checked at bind

    def __init__(self, batch_invariant: bool = False, probe: Probe = why_not):
        super().__init__(batch_invariant)
        self.probe = probe
        self.chosen: AttentionBackend | None = None
        self.choice = ""  # the announcement, once bound

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        if torch.device(device).type not in PREFERENCE:
            raise ValueError(f"backend=auto knows no backends for device {torch.device(device).type!r}; "
                             f"name a backend explicitly")

    def bind(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             device: torch.device | str, layers: Sequence[LayerAttention] = (), model_name: str = "model") -> None:
        needs = frozenset().union(*(spec.features for spec in layers))
        if self.batch_invariant:
            needs |= {BATCH_INVARIANT}
        name, passed = choose(device, dtype, block_size, needs, self.probe)
        chosen = registry.build("backend", name, batch_invariant=self.batch_invariant)
        chosen.bind(num_q_heads, num_kv_heads, head_dim, dtype, block_size, device, layers, model_name)
        self.choice = announcement(name, passed, device, dtype)
        print(self.choice, file=sys.stderr, flush=True)
        self.chosen, self.name, self.layers = chosen, chosen.name, chosen.layers  # type: ignore[misc]
        self.prepare, self.forward = chosen.prepare, chosen.forward  # type: ignore[method-assign]

    def _bound(self) -> AttentionBackend:
        if self.chosen is None:
            raise RuntimeError("backend=auto chooses when the model is bound (ModelRunner does it); bind first")
        return self.chosen

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return self._bound().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
        return self._bound().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    def prepare(self, batch: Any, device: torch.device | str) -> Any:
        return self._bound().prepare(batch, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                scale: float, **layer: Any) -> torch.Tensor:
        return self._bound().forward(q, k, v, kv_cache, meta, scale, **layer)

    def __getattr__(self, attr: str) -> Any:  # the chosen backend's own extras (e.g. torch_paged.uses_kernel)
        chosen = self.__dict__.get("chosen")
        if chosen is None:
            raise AttributeError(attr)
        return getattr(chosen, attr)
