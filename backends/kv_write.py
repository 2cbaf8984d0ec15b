"""Storing a step's new K/V in the [2, num_blocks, block_size, H, D] cache most backends use."""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new K/V of a [2, num_blocks, block_size, H, D] cache at their slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
