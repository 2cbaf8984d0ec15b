"""The backend-level oracle: a step through torch_ref, the readable backend every other one is
checked against (same output, same cache after the write)."""

from __future__ import annotations

import torch

from backends.torch_ref import TorchRefBackend

ATOL = 1e-5  # fp32: a backend's output against torch_ref's


def reference(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchRefBackend's output and the cache after its write, for a `strategies.problems` draw."""
    ref = TorchRefBackend()
    cache = p["cache"].clone()
    out = ref.forward(p["q"], p["k"], p["v"], cache, ref.prepare(p["batch"], "cpu"), p["scale"])
    return out, cache
