"""Which kernel computes the model's linear layers (`nn.Linear`) on the CPU.

torch's `F.linear` on a CPU fp32 tensor goes to MKL's sgemm, which re-reads the weight in its
row-major layout on every call. oneDNN's matmul with the weight reordered once into its blocked
layout (what torch's own inductor does for low-precision weights, and what vLLM's CPU build does
for every linear layer) is 1.5-3.8x faster at decode-sized batches (8-128 rows) on this project's
50M benchmark shapes and 1.1-1.5x at prefill sizes: `python benchmarks/linear_kernels.py`. On small
layers its per-call cost loses, so `auto` packs only layers of MIN_PACKED_ELEMENTS weights or more;
`onednn` packs every layer.

The swap replaces each linear module's `forward`, never the model's code or its weights (the dense
weight stays: tied embeddings and batch-invariant mode read it). It is checked before it is used:
a layer whose packed result differs from `F.linear` beyond rounding keeps `F.linear`, and the
runner reports which kernel each run used (`ModelRunner.linear_kernel`). The packed copy is one
more copy of the linear weights in memory; `linear_kernel=torch` avoids it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

ONEDNN = "onednn_packed"
TORCH = "torch"
TILED = "torch_tiled"  # batch-invariant mode's fixed-shape GEMMs
#: `auto` packs a layer only from this many weight elements (1 MiB in fp32): below it oneDNN's
#: per-call cost outweighs its faster inner loop (benchmarks/linear_kernels.py: 0.2-0.9x of F.linear
#: on the tiny model's 32x64..512x64 layers; 1.0-1.6x from 512x512 up at 8-64 rows).
MIN_PACKED_ELEMENTS = 1 << 18
#: the row count oneDNN lays the packed weight out for; one layout serves every row count
#: (benchmarks/linear_kernels.py measured 64 against the step's own row count: no difference).
_PACK_ROWS = 64


def _onednn_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _tiled_linear(layer: torch.nn.Linear, tile: int, x: torch.Tensor) -> torch.Tensor:
    """A linear layer computed in GEMMs of exactly `tile` rows (the last one zero-padded).

    GEMM libraries pick kernels and blockings by the matrix shape, so a row's result can change
    with the number of rows beside it. With every call the same shape, each row goes through the
    same kernel whatever the batch holds: this is what makes batch-invariant mode bitwise exact.
    """
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
    """Route the model's `nn.Linear` layers of at least `min_elements` weights through oneDNN with
    packed weights where that is possible and exact to rounding; return what the layers run on (see
    describe_linears), with the reason when oneDNN cannot serve at all."""
    why = onednn_unavailable(device, dtype)
    if why is not None:
        return f"{TORCH} ({why})"
    with torch.inference_mode():
        for m in model.modules():
            if not isinstance(m, torch.nn.Linear) or "forward" in m.__dict__:
                # Already packed, or replaced by something else (batch-invariant tiling, a user's
                # hook): left as it is, and describe_linears says what it is.
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
    """What computes the model's linear layers now, read from the modules themselves (a model shared
    by several runners reports its state, not what one runner asked for): one kernel name, or each
    kernel with its number of layers."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            k = _kernel_of(m)
            counts[k] = counts.get(k, 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), "none")
    return ", ".join(f"{k}: {n} layers" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
