"""Which kernel computes the model's `nn.Linear` layers on the CPU: oneDNN with the weight packed
once beats `F.linear` on large layers (benchmarks/linear_kernels.py). Only each module's `forward`
is swapped, after checking it matches `F.linear` to rounding; the dense weight stays."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

ONEDNN = "onednn_packed"
TORCH = "torch"
TILED = "torch_tiled"  # batch-invariant mode's fixed-shape GEMMs
#: `auto` packs only layers this large: below it oneDNN's per-call cost loses.
MIN_PACKED_ELEMENTS = 1 << 18
#: the row count oneDNN lays the packed weight out for; one layout serves every row count.
_PACK_ROWS = 64


def _onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _tiled_linear(layer: torch.nn.Linear, tile: int, x: torch.Tensor) -> torch.Tensor:
    """A linear layer in GEMMs of exactly `tile` rows (the last zero-padded): GEMM libraries pick
    kernels by shape, so one shape makes every row's result independent of the batch."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n == 0:
        return F.linear(x, layer.weight, layer.bias)
    pad = -n % tile
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = torch.cat([F.linear(chunk, layer.weight, layer.bias) for chunk in flat.split(tile)])
    return out[:n].reshape(*x.shape[:-1], -1)


def make_batch_invariant(model: torch.nn.Module, tile: int = 16) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = partial(_tiled_linear, m, tile)


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the packed oneDNN kernel cannot serve this device and dtype, or None if it can."""
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype != torch.float32:
        return f"dtype {dtype} (only float32 is checked)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build lacks mkldnn._linear_pointwise"
    return None


def pack_linears(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 min_elements: int = MIN_PACKED_ELEMENTS) -> str:
    """Route `nn.Linear` layers of >= `min_elements` weights through packed oneDNN where it is exact
    to rounding; return what the layers run on (describe_linears), or why oneDNN cannot serve."""
    why = onednn_unavailable(device, dtype)
    if why is not None:
        return f"{TORCH} ({why})"
    with torch.inference_mode():
        for m in model.modules():
            if not isinstance(m, torch.nn.Linear) or "forward" in m.__dict__:
                # Already replaced (packed, tiled, a user's hook): left as it is.
                continue
            w = m.weight.detach()
            if w.numel() < min_elements:
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
            bias = None if m.bias is None else m.bias.detach()
            probe = torch.randn(3, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))
            want, got = F.linear(probe, w, bias), _onednn_linear(packed, bias, probe)
            if torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-6):
                m.forward = partial(_onednn_linear, packed, bias)
    return describe_linears(model)


def _kernel_of(m: torch.nn.Linear) -> str:
    f = m.__dict__.get("forward")
    if f is None:
        return TORCH
    func = getattr(f, "func", None)
    return ONEDNN if func is _onednn_linear else TILED if func is _tiled_linear else "custom forward"


def describe_linears(model: torch.nn.Module) -> str:
    """What computes the model's linear layers now, read from the modules (a shared model reports its
    state): one kernel name, or each kernel with its number of layers."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            k = _kernel_of(m)
            counts[k] = counts.get(k, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), "none")
    return ", ".join(f"{k}: {n} layers" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
