"""Fused per-layer CPU kernels for a decoder's elementwise work (varlen/csrc/layer_kernels.c):
RMSNorm; the residual add feeding the post-attention RMSNorm; SiLU·mul feeding the MLP's down
projection. Like varlen/linear_kernels.py, only module `forward`s are swapped, each after a probe
shows it matches the module's own forward to fp32 rounding; a module that does not match keeps its
own code and the description says so. The model's code is not forked: a decoder layer's fused
forward calls its own attention and MLP modules.

The C library is built at first use into the varlen cache (or by scripts/setup.sh). Without it (no
compiler) the same fused forwards run on torch ops, said in a warning and in the description.
`VARLEN_LAYER_KERNELS=0` leaves every module as transformers wrote it; `=torch` forces the torch ops.
RoPE is not fused here: it runs inside the attention module, whose code would have to be forked.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from varlen.c_build import build_cached

SOURCE = Path(__file__).with_name("csrc") / "layer_kernels.c"
ENV = "VARLEN_LAYER_KERNELS"
C, TORCH, OFF = "c", "torch", "off"

# --- building and loading the C library ------------------------------------------------------------


def build(verbose: bool = False) -> Path:
    """Compile the library into the cache (once per source, shared headers, compiler, flags, CPU and Python);
    returns its path. Raises RuntimeError on failure."""
    return build_cached(SOURCE, "layer-kernels", verbose=verbose)


_lib: Any = None  # the loaded library, or the reason it is unavailable (a str), decided once


def load_library() -> tuple[Any, str | None]:
    """(the ctypes library, None) or (None, why it is unavailable); builds it if needed."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(str(build()))
            i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
            lib.varlen_rmsnorm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32]
            lib.varlen_add_rmsnorm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, f32, i32]
            lib.varlen_silu_mul.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i32]
            for fn in (lib.varlen_rmsnorm, lib.varlen_add_rmsnorm, lib.varlen_silu_mul):
                fn.restype = ctypes.c_int
            _lib = lib
        except (RuntimeError, OSError) as err:
            _lib = str(err).splitlines()[0][:300]
    return (None, _lib) if isinstance(_lib, str) else (_lib, None)


# --- the three operations, on torch (the reference and the fallback) and in C ----------------------


class Ops:
    """rmsnorm(x, w, eps), add_rmsnorm(a, b, w, eps) -> (a + b, rmsnorm(a + b)), silu_mul(g, u)."""

    name = TORCH

    @staticmethod
    def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def add_rmsnorm(self, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        s = a + b
        return s, self.rmsnorm(s, w, eps)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with the last dimension contiguous (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class COps(Ops):
    """The same operations in the C library, for fp32 tensors; anything else goes to torch."""

    name = C

    def __init__(self, lib: Any):
        self.lib = lib

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or w.dtype != torch.float32:
            return Ops.rmsnorm(x, w, eps)
        x2 = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        d = x2.shape[1]
        self.lib.varlen_rmsnorm(x2.data_ptr(), x2.stride(0), w.data_ptr(), out.data_ptr(), d, x2.shape[0], d, eps,
                                torch.get_num_threads())
        return out

    def add_rmsnorm(self, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if a.dtype != torch.float32 or b.dtype != torch.float32 or w.dtype != torch.float32 or a.shape != b.shape:
            return Ops.add_rmsnorm(self, a, b, w, eps)
        a2, b2 = _rows(a), _rows(b)
        s, out = torch.empty(a.shape, dtype=a.dtype), torch.empty(a.shape, dtype=a.dtype)
        d = a2.shape[1]
        self.lib.varlen_add_rmsnorm(a2.data_ptr(), a2.stride(0), b2.data_ptr(), b2.stride(0), w.data_ptr(),
                                    s.data_ptr(), d, out.data_ptr(), d, a2.shape[0], d, eps, torch.get_num_threads())
        return s, out

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if g.dtype != torch.float32 or u.dtype != torch.float32 or g.shape != u.shape:
            return Ops.silu_mul(g, u)
        g2, u2 = _rows(g), _rows(u)
        out = torch.empty(g.shape, dtype=g.dtype)
        d = g2.shape[1]
        self.lib.varlen_silu_mul(g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), out.data_ptr(), d,
                                 g2.shape[0], d, torch.get_num_threads())
        return out


# --- the fused forwards ---------------------------------------------------------------------------


def _eps(norm: torch.nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _norm_forward(norm: torch.nn.Module, ops: Ops, x: torch.Tensor) -> torch.Tensor:
    return ops.rmsnorm(x, norm.weight, norm._varlen_eps)


def _mlp_forward(mlp: torch.nn.Module, ops: Ops, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _layer_forward(layer: torch.nn.Module, ops: Ops, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A pre-norm decoder layer: norm, attention, (add + norm) fused, MLP, add; the attention and MLP
    are the layer's own modules, called as the layer's own forward calls them."""
    pre, post = layer.input_layernorm, layer.post_attention_layernorm
    attn, _ = layer.self_attn(hidden_states=ops.rmsnorm(hidden_states, pre.weight, pre._varlen_eps), **kwargs)
    hidden_states, normed = ops.add_rmsnorm(hidden_states, attn, post.weight, post._varlen_eps)
    return hidden_states + layer.mlp(normed)


class _AttentionStandIn(torch.nn.Module):
    """Takes the attention's place during a decoder layer's probe: a fixed nonlinear map of its input,
    recording the other arguments it was given (the fused forward must pass the same ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict[str, Any]]] = []

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        self.calls.append((args, kwargs))
        return torch.tanh(hidden_states) * 0.5 + 0.25, None


def _same_arguments(calls: list[tuple[tuple, dict[str, Any]]]) -> bool:
    """Two recorded calls passed the same objects under the same names (a name one call leaves out
    counts as None: the layer's own forward passes its defaults, e.g. `cache=None`)."""
    (args0, kw0), (args1, kw1) = calls
    return (len(args0) == len(args1) and all(a is b for a, b in zip(args0, args1))
            and all(kw0.get(k) is kw1.get(k) for k in kw0.keys() | kw1.keys()))


def _close(got: Any, want: Any) -> bool:
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.shape != want.shape:
        return False
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-6))


def _probe(module: torch.nn.Module, fused: Callable[[torch.Tensor], Any], original: Callable[[torch.Tensor], Any],
           width: int) -> bool:
    """Does the fused forward match the module's own on a random input (3 rows, 2 of them in a batch)?"""
    dtype = next(module.parameters()).dtype
    x = torch.randn(1, 3, width, generator=torch.Generator().manual_seed(0)).to(dtype) * 2
    try:
        return _close(fused(x), original(x))
    except Exception:  # noqa: BLE001 - a module of another shape: it keeps its own forward
        return False


def _is_rmsnorm(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return ("RMSNorm" in type(m).__name__ and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and getattr(m, "bias", None) is None and _eps(m) is not None)


def _is_gated_mlp(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _is_prenorm_layer(m: torch.nn.Module) -> bool:
    return (all(hasattr(m, n) for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
            and _is_rmsnorm(m.input_layernorm) and _is_rmsnorm(m.post_attention_layernorm))


KINDS = {_layer_forward: "decoder layers (add+RMSNorm)", _mlp_forward: "MLPs (SiLU·mul)", _norm_forward: "RMSNorms"}


def fuse_layers(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Swap the fused forwards into every module whose probe matches; return describe_layers(model).
    Modules already swapped (by an earlier runner over a shared model) are left as they are."""
    raw = os.environ.get(ENV, "1")
    choice = {"1": C, C: C, "on": C, TORCH: TORCH, "0": OFF, OFF: OFF}.get(raw.strip().lower())
    if choice is None:
        raise ValueError(f"{ENV}={raw!r}: must be 1 (the C kernels, the default), torch (their torch ops) or 0 (off)")
    if choice == OFF:
        return f"{OFF} ({ENV}={raw})"
    if device.type != "cpu" or dtype != torch.float32:
        return f"{OFF} (CPU float32 only; this model runs on {device.type} {str(dtype).removeprefix('torch.')})"
    ops: Ops = Ops()
    if choice == C:
        lib, why = load_library()
        if lib is None:
            warnings.warn(f"layer kernels: the C library is unavailable ({why}); the fused forwards run on torch "
                          f"ops instead (correct, slower)", RuntimeWarning, stacklevel=2)
        else:
            ops = COps(lib)
    width = model.config.hidden_size
    mods = list(model.modules())
    with torch.inference_mode():
        # Decoder layers first, probed against their own forward with untouched MLPs and norms.
        for m in mods:
            if _is_prenorm_layer(m) and "forward" not in m.__dict__:
                for n in (m.input_layernorm, m.post_attention_layernorm):
                    n._varlen_eps = _eps(n)
                attn, stand_in = m.self_attn, _AttentionStandIn()
                m.self_attn = stand_in
                # Arguments the model passes its layers, as objects the stand-in can tell apart.
                kw = dict(attention_mask=None, position_ids=torch.arange(3)[None],
                          position_embeddings=(torch.ones(1, 3, 1), torch.zeros(1, 3, 1)), use_cache=False)
                try:
                    ok = _probe(m, lambda x: _layer_forward(m, ops, x, **kw), lambda x: type(m).forward(m, x, **kw),
                                width) and _same_arguments(stand_in.calls)
                finally:
                    m.self_attn = attn
                m._varlen_fusable = ok
        for m in mods:
            if _is_gated_mlp(m) and "forward" not in m.__dict__:
                w = m.gate_proj.in_features
                if _probe(m, partial(_mlp_forward, m, ops), lambda x: type(m).forward(m, x), w):
                    m.forward = partial(_mlp_forward, m, ops)
                else:
                    m._varlen_fusable = False
        for m in mods:
            if _is_rmsnorm(m) and "forward" not in m.__dict__:
                m._varlen_eps = _eps(m)
                if _probe(m, partial(_norm_forward, m, ops), lambda x: type(m).forward(m, x), m.weight.shape[0]):
                    m.forward = partial(_norm_forward, m, ops)
                else:
                    m._varlen_fusable = False
        for m in mods:
            if getattr(m, "_varlen_fusable", False) and "forward" not in m.__dict__ and _is_prenorm_layer(m):
                m.forward = partial(_layer_forward, m, ops)
    return describe_layers(model)


def describe_layers(model: torch.nn.Module) -> str:
    """What runs the model's norms, MLP activations and residual adds now, read from the modules:
    the ops ("c" or "torch") and the fused count per kind, then any module a probe kept on its own code."""
    fused: dict[str, int] = {}
    kept: dict[str, int] = {}
    names = set()
    for m in model.modules():
        f = m.__dict__.get("forward")
        kind = KINDS.get(getattr(f, "func", None))
        if kind is not None:
            fused[kind] = fused.get(kind, 0) + 1
            names.add(f.args[1].name)
        elif getattr(m, "_varlen_fusable", None) is False:
            kept[type(m).__name__] = kept.get(type(m).__name__, 0) + 1
    if not fused:
        head = "none"
    else:
        head = f"{'/'.join(sorted(names))}: " + ", ".join(f"{n} {k}" for k, n in fused.items())
    if kept:
        head += "; kept on their own code (probe mismatch): " + ", ".join(f"{n} {k}" for k, n in kept.items())
    return head


if __name__ == "__main__":
    try:
        print(f"built: {build(verbose=True)}")
    except RuntimeError as err:
        print(f"WARNING: {err}", file=sys.stderr)
        sys.exit(1)
