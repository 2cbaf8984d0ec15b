"""Attention backends, by name. Modules are imported only when a backend is asked for, so GPU
libraries are never imported on machines that do not use them."""

from __future__ import annotations

import importlib

from backends.base import AttentionBackend, BackendUnavailable

BACKENDS: dict[str, str] = {
    "torch_ref": "backends.torch_ref:TorchRefBackend",
    "torch_sdpa": "backends.torch_sdpa:TorchSdpaBackend",
    "torch_paged": "backends.torch_paged:TorchPagedBackend",
    "flash_attn": "backends.flash_attn:FlashAttnBackend",
    "flashinfer": "backends.flashinfer:FlashInferBackend",
    "triton": "backends.triton_paged:TritonPagedBackend",
}


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def usable_backends(device: str, dtype: "torch.dtype", block_size: int = 16) -> list[str]:  # noqa: F821
    """Names of the backends that can run here with these settings."""
    names = []
    for name in BACKENDS:
        try:
            make_backend(name).check(device, dtype, block_size)
        except (ValueError, BackendUnavailable, ImportError):
            continue
        names.append(name)
    return names


__all__ = ["AttentionBackend", "BackendUnavailable", "BACKENDS", "make_backend", "usable_backends"]
