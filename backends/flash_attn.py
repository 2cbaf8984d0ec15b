"""flash-attn backend: `flash_attn_varlen_func` over the base paged cache through a block table.

flash-attn 2.x (pages a multiple of 256; pure decodes via `flash_attn_with_kvcache`) takes
`cu_seqlens_k`; flash-attn 4 (`flash_attn.cute`, when 2.x is missing or `version="4"`) takes
`page_table` and `seqused_k`. Both are imported lazily, causal bottom-right. Sinks not declared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from backends.kv_write import write_kv
from varlen.attention_api import AttentionBackend, AttentionMetadata, BackendUnavailable, LayerAttention, first_line
from varlen.batch import ForwardBatch

INSTALL_HINT = 'pip install -e ".[flash-attn]"'


def flash_attn_inputs(batch: ForwardBatch) -> dict[str, Any]:
    """The step's arguments for flash-attn's paged varlen call, as numpy int32 arrays (tested on CPU)."""
    seq_lens = np.ascontiguousarray(batch.seq_lens, dtype=np.int32)
    cu_seqlens_k = np.zeros(seq_lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=cu_seqlens_k[1:])
    return {
        "cu_seqlens_q": np.ascontiguousarray(batch.query_start_loc, dtype=np.int32),
        "cu_seqlens_k": cu_seqlens_k,
        "seqused_k": seq_lens,
        "block_table": np.ascontiguousarray(batch.block_tables, dtype=np.int32),
        "max_seqlen_q": int(batch.max_query_len),
        "max_seqlen_k": int(batch.max_seq_len),
    }


def flash_attn_feature_args(layer: LayerAttention | None, version: str = "2") -> dict[str, Any]:
    """Keyword arguments for one layer's optional features (empty for a plain layer).
    flash-attn's left window bound is inclusive, hence W - 1."""
    args: dict[str, Any] = {}
    if layer is None:
        return args
    if layer.sliding_window is not None:
        args["window_size"] = (layer.sliding_window - 1, 0)
    if layer.softcap is not None:
        args["softcap"] = float(layer.softcap)
    if layer.sinks is not None:
        raise ValueError("backend 'flash_attn' does not implement attention sinks")  # refused at bind
    return args


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    seqused_k: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class _Kernels:
    version: str
    varlen: Callable[..., Any]
    with_kvcache: Callable[..., Any] | None  # flash-attn 2 only



def _load_kernels(version: str) -> _Kernels:
    """Import the kernel library; BackendUnavailable (one line) when neither is importable."""
    errors: list[str] = []
    if version in ("auto", "2"):
        try:
            # A wheel built for another CUDA/torch fails with OSError or RuntimeError: unavailable too.
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
            return _Kernels("2", flash_attn_varlen_func, flash_attn_with_kvcache)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"flash-attn 2 ({first_line(exc)})")
    if version in ("auto", "4"):
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
            return _Kernels("4", fa4_varlen, None)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"flash-attn 4 ({first_line(exc)})")
    raise BackendUnavailable(
        f"backend 'flash_attn' needs the flash-attn package, which is not importable: "
        f"{'; '.join(errors)}; install it with {INSTALL_HINT} (or pip install flash-attn-4)")


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    block_size_multiple = 256  # flash-attn 2.x paged KV refuses other page sizes
    features = frozenset({"sliding_window", "softcap"})

    def __init__(self, version: str = "auto", decode_with_kvcache: bool = True, batch_invariant: bool = False) -> None:
        """`version`: "auto" (2.x if importable, else 4), "2" or "4"."""
        super().__init__(batch_invariant)  # True is refused: no batch-invariant mode
        if version not in ("auto", "2", "4"):
            raise ValueError(f"flash_attn version must be 'auto', '2' or '4', got {version!r}")
        self.version = version
        self.decode_with_kvcache = decode_with_kvcache
        self._kernels: _Kernels | None = None

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        super().check(device, dtype, block_size)
        self.require_cuda(INSTALL_HINT)
        self._kernels = _load_kernels(self.version)

    @property
    def kernel_version(self) -> str:
        """"2" or "4": which flash-attn this backend calls (imports it if not done yet)."""
        if self._kernels is None:
            self._kernels = _load_kernels(self.version)
        return self._kernels.version

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> FlashAttnMetadata:
        host = flash_attn_inputs(batch)

        def dev(name: str) -> torch.Tensor:
            return torch.from_numpy(host[name]).to(device, non_blocking=True)

        return FlashAttnMetadata(
            slot_mapping=self.upload_slot_mapping(batch, device),
            batch=batch,
            cu_seqlens_q=dev("cu_seqlens_q"),
            cu_seqlens_k=dev("cu_seqlens_k"),
            seqused_k=dev("seqused_k"),
            block_table=dev("block_table"),
            max_seqlen_q=host["max_seqlen_q"],
            max_seqlen_k=host["max_seqlen_k"],
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: FlashAttnMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if self._kernels is None:
            self._kernels = _load_kernels(self.version)
        fa = self._kernels
        extra = flash_attn_feature_args(layer, fa.version)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # HF hands q over as a transposed view; the kernels want unit-stride rows they can TMA.
        q = q.contiguous()
        if fa.version == "2":
            if meta.batch.is_pure_decode and self.decode_with_kvcache and fa.with_kvcache is not None:
                # K/V are already in the cache: cache_seqlens are the whole lengths.
                out = fa.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqused_k,
                                      block_table=meta.block_table, softmax_scale=scale, causal=True, **extra)
                return out.squeeze(1)
            return fa.varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                             meta.max_seqlen_k, softmax_scale=scale, causal=True, block_table=meta.block_table,
                             **extra)
        out = fa.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                        max_seqlen_k=meta.max_seqlen_k, seqused_k=meta.seqused_k, page_table=meta.block_table,
                        softmax_scale=scale, causal=True, **extra)
        return out[0] if isinstance(out, tuple) else out
