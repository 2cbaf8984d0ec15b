"""Deprecated import path: the attention interface lives in `varlen.attention_api`, `write_kv` in
`backends.kv_write`. An old name still resolves here, with a DeprecationWarning naming its home."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

HOMES = {**dict.fromkeys(("FEATURES", "AttentionBackend", "AttentionMetadata", "BackendUnavailable", "LayerAttention",
                          "first_line"), "varlen.attention_api"), "write_kv": "backends.kv_write"}


def moved(old: str, name: str) -> Any:
    """`name` from its home, with a warning that `old` no longer holds it."""
    if name not in HOMES:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(f"import {name} from {HOMES[name]}: {old}.{name} is deprecated", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(HOMES[name]), name)


def __getattr__(name: str) -> Any:
    return moved(__name__, name)
