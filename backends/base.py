"""What the attention backends share: the plug point's interface (re-exported from
`varlen/attention_api.py`, where it sits below the backends and the model runner; README:
layers) and the helpers several backends use.
"""

from __future__ import annotations

import torch

from varlen.attention_api import (FEATURES, AttentionBackend, AttentionMetadata, BackendUnavailable,
                                  LayerAttention)

__all__ = ["FEATURES", "AttentionBackend", "AttentionMetadata", "BackendUnavailable", "LayerAttention", "first_line",
           "write_kv"]


def first_line(exc: BaseException) -> str:
    """An import error in one line, for BackendUnavailable messages (a broken install's can run long)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new K/V of a [2, num_blocks, block_size, H, D] cache at their slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
