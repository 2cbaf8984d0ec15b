"""Triton backend: one paged varlen attention launch per layer (`backends/triton_paged_kernels.py`),
plus a log-sum-exp merge when keys are split to fill the GPU; sliding windows, logit soft-capping
and sinks are the kernel's. On CPU it runs only in Triton's
interpreter (slow, no bfloat16), which Triton picks once at import: TRITON_INTERPRET=1 must be set
before anything imports triton. This module imports it only in `check()`, which says so in one line.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from backends.kv_write import write_kv
from varlen.attention_api import (FEATURES, AttentionBackend, AttentionMetadata, BackendUnavailable,
                                  LayerAttention, first_line)
from varlen.batch import ForwardBatch

INSTALL_HINT = 'pip install -e ".[triton]"'
LOG2_E = 1.4426950408889634
HOW_TO_RUN = ("backend 'triton' compiles its kernels for a GPU: run it with engine.device=cuda on a GPU machine, "
              "or on CPU in Triton's interpreter (slow; for tests) with TRITON_INTERPRET=1 set before start-up")


def interpret_from_env() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter (what counts is how triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class LaunchPlan:
    """Tile sizes and the KV split of one step for one head layout."""

    block_m: int  # query rows per program: tokens x GROUP heads
    block_n: int
    num_splits: int
    split_len: int  # keys per split (a multiple of 16)


def plan_launch(query_lens: np.ndarray, max_seq_len: int, num_q_heads: int, num_kv_heads: int,
                dtype: torch.dtype, num_sms: int, num_splits: int | None = None, kv_split_size: int = 256,
                max_splits: int = 32, interpreted: bool = False, window: int | None = None) -> LaunchPlan:
    """Tiles and splits (numpy only, tested on CPU): split the keys a query tile reads (the whole
    context, or with a sliding `window` the window's span) into up to `max_splits` ranges of >=
    `kv_split_size` keys when one pass has fewer than two waves of programs. `num_splits` forces a
    count (tests reach the merge on tiny shapes)."""
    group = num_q_heads // num_kv_heads
    decode = int(query_lens.max()) == 1
    # One token x GROUP heads for decodes; 64 rows for prefills. tl.dot needs >= 16 rows.
    block_m = max(16, next_power_of_2(group)) if decode else max(64, next_power_of_2(group))
    block_n = 32 if dtype == torch.float32 else 64  # fp32 tiles are twice the bytes
    if interpreted:
        block_n = 128  # the interpreter costs per operation: fewer, bigger tiles
    tokens = block_m // group
    # A tile's rows see keys from its first row's window start to its last row.
    span = max_seq_len if window is None else min(max_seq_len, window + tokens - 1)
    if num_splits is None:
        programs = int((-(-query_lens // tokens)).sum()) * num_kv_heads
        num_splits = 1
        if programs < 2 * num_sms and span > kv_split_size:
            num_splits = min(max_splits, -(-2 * num_sms // programs), -(-span // kv_split_size))
    num_splits = max(1, int(num_splits))
    split_len = -(-span // num_splits)
    split_len = -(-split_len // 16) * 16  # aligned starts; the kernel takes any length
    return LaunchPlan(block_m, block_n, num_splits, split_len)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


@dataclass
class TritonMetadata(AttentionMetadata):
    query_start_loc: torch.Tensor  # [B+1] int32, on the device
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    plans: dict[tuple[Any, ...], LaunchPlan] = field(default_factory=dict)  # per head layout



@dataclass(frozen=True)
class Kernels:
    attention: Any
    merge: Any
    interpreted: bool


def load_kernels() -> Kernels:
    """Import Triton and the kernels, in the mode Triton was imported in (TRITON_INTERPRET then)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        from backends import triton_paged_kernels as kernels
    except Exception as exc:  # noqa: BLE001 - a broken install is "unavailable" too
        raise BackendUnavailable(f"backend 'triton' needs the triton package, which is not importable "
                                 f"({first_line(exc)}); install it with {INSTALL_HINT}") from None
    # Our kernels must match the mode triton's own library (tl.zeros) took at import.
    interpreted = isinstance(tl.zeros, InterpretedFunction)
    return Kernels(_in_mode(kernels.paged_attention_kernel, interpreted),
                   _in_mode(kernels.merge_splits_kernel, interpreted), interpreted)


@functools.cache
def _in_mode(kernel: Any, interpreted: bool) -> Any:
    """The kernel in the given mode (cached: a compiled kernel keeps its compilations)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, InterpretedFunction) == interpreted:
        return kernel
    return (InterpretedFunction if interpreted else JITFunction)(kernel.fn)


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    features = frozenset(FEATURES)  # sliding_window, softcap, sinks: no batch-invariant mode

    def __init__(self, num_splits: int | None = None, kv_split_size: int = 256, max_splits: int = 32,
                 batch_invariant: bool = False) -> None:
        """`num_splits` forces the KV split count; otherwise `plan_launch` decides."""
        super().__init__(batch_invariant)  # True is refused: no batch-invariant mode
        self.num_splits = num_splits
        self.kv_split_size = kv_split_size
        self.max_splits = max_splits
        self._kernels: Kernels | None = None
        self._num_sms: dict[torch.device, int] = {}

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        super().check(device, dtype, block_size)
        device = torch.device(device)
        if device.type == "cpu" and "triton" not in sys.modules and not interpret_from_env():
            raise BackendUnavailable(HOW_TO_RUN)  # said before importing triton, which takes a second
        if device.type == "cuda":
            self.require_cuda(INSTALL_HINT)
        kernels = load_kernels()
        if device.type == "cpu":
            if not kernels.interpreted:
                raise BackendUnavailable(f"{HOW_TO_RUN} (triton was imported without it)")
            if dtype == torch.bfloat16:
                raise ValueError("backend 'triton' in Triton's CPU interpreter supports float32 and float16, "
                                 "not bfloat16 (the interpreter computes with numpy, which has none): choose "
                                 "engine.dtype=float32 or float16, or run on a GPU")
        if self._kernels is None:
            self._kernels = kernels

    @property
    def interpreted(self) -> bool:
        """Whether the kernels run in Triton's interpreter (benchmarks refuse to time that)."""
        return load_kernels().interpreted

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> TritonMetadata:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

        return TritonMetadata(
            slot_mapping=self.upload_slot_mapping(batch, device), batch=batch,
            query_start_loc=dev(batch.query_start_loc), seq_lens=dev(batch.seq_lens),
            block_tables=dev(batch.block_tables))

    def _sm_count(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 1  # the interpreter runs programs one after another: no waves to fill
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        if self._kernels is None:
            self._kernels = load_kernels()
        attention, merge = self._kernels.attention, self._kernels.merge
        write_kv(kv_cache, k, v, meta.slot_mapping)
        b = meta.batch
        n, hq, d = q.shape
        hkv = kv_cache.shape[3]
        if hq % hkv:
            raise ValueError(f"backend 'triton': {hq} query heads are not a multiple of {hkv} KV heads")
        if kv_cache.stride(-1) != 1:
            raise ValueError("backend 'triton' needs a KV cache whose last dimension is contiguous")
        group = hq // hkv
        window = layer.sliding_window if layer else None
        softcap = layer.softcap if layer else None
        sinks = layer.sinks if layer else None
        if sinks is not None:
            if sinks.numel() != hq:
                raise ValueError(f"backend 'triton': {sinks.numel()} sink logits for {hq} query heads")
            sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
        key = (hq, hkv, kv_cache.dtype, window)
        if key not in meta.plans:
            meta.plans[key] = plan_launch(b.query_lens, b.max_seq_len, hq, hkv, kv_cache.dtype,
                                          self._sm_count(q.device), self.num_splits, self.kv_split_size,
                                          self.max_splits, self._kernels.interpreted, window)
        plan = meta.plans[key]
        out_dtype = q.dtype
        q = q.to(kv_cache.dtype)  # the kernel's dots take one dtype; the model's q has the cache's anyway
        if q.stride(-1) != 1:
            q = q.contiguous()
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty(n, hq, d, dtype=kv_cache.dtype, device=q.device)
        split = plan.num_splits > 1
        if split:  # fp32 parts and their log-sum-exps, merged into `out` below
            dst = torch.empty(plan.num_splits, n, hq, d, dtype=torch.float32, device=q.device)
            lse = torch.empty(plan.num_splits, n, hq, dtype=torch.float32, device=q.device)
        else:  # straight into `out`; lse is never touched
            dst, lse = out.unsqueeze(0), out
        block_d = max(16, next_power_of_2(d))
        grid = (-(-b.max_query_len // (plan.block_m // group)), b.num_seqs, hkv * plan.num_splits)
        attention[grid](
            dst, lse, q, k_cache, v_cache,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            q if sinks is None else sinks,  # an unread stand-in pointer without sinks
            float(scale) / softcap if softcap is not None else float(scale) * LOG2_E,
            float(softcap or 0.0) * LOG2_E, int(window or 0), b.block_size, plan.split_len,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0),
            dst.stride(0), dst.stride(1), dst.stride(2),
            lse.stride(0), lse.stride(1),
            NUM_KV_HEADS=hkv, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            SPLIT=split, DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
            HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
            num_warps=4, num_stages=2,
        )
        if split:
            block_s = next_power_of_2(plan.num_splits)
            # Heads per merge program: all in the interpreter, else a ~8k-element fp32 tile (registers).
            block_h = next_power_of_2(hq) if self._kernels.interpreted else \
                min(next_power_of_2(hq), max(1, 8192 // (block_s * block_d)))
            merge[(n, -(-hq // block_h))](
                out, dst, lse, plan.num_splits, hq,
                out.stride(0), out.stride(1),
                dst.stride(0), dst.stride(1), dst.stride(2),
                lse.stride(0), lse.stride(1),
                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_H=block_h,
            )
        return out if out.dtype == out_dtype else out.to(out_dtype)
