"""Attention backends. They are named only by `conf/backend/<name>.yaml` (varlen/registry.py), and
each module is imported only when its backend is asked for, so GPU libraries are never imported
on machines that do not use them. The interface is `varlen.attention_api`."""

from __future__ import annotations

from typing import Any


def usable_backends(device: str, dtype: "torch.dtype", block_size: int = 16) -> list[str]:  # noqa: F821
    """Names of the backends (conf/backend/, and the user's) that can run here with these settings."""
    from varlen import registry
    from varlen.attention_api import BackendUnavailable

    names = []
    for name in registry.names("backend"):
        backend = registry.build("backend", name)  # one that cannot even be built is an error, not skipped
        try:
            backend.check(device, dtype, block_size)
        except (ValueError, BackendUnavailable, ImportError):
            continue
        names.append(name)
    return names


def __getattr__(name: str) -> Any:
    """The names this package re-exported before (`from backends import AttentionBackend`): deprecated."""
    if name in ("AttentionBackend", "BackendUnavailable", "first_line"):
        from backends.base import moved

        return moved(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["usable_backends"]
