"""FlashInfer backend: paged prefill/append attention planned once per step, run once per layer.

Layout: FlashInfer's NHD paged cache accepts a `(k_cache, v_cache)` tuple of
[num_pages, page_size, Hkv, D] tensors, which is exactly `cache[0], cache[1]` of the base
[2, num_blocks, block_size, Hkv, D] layout. So this backend keeps the base `kv_cache_shape` and the
base `write_kv`, and any block size works (FlashInfer has no page-size restriction).

Page table: FlashInfer describes each request's pages in CSR form instead of a padded block
table: `paged_kv_indptr` [B+1] (running sum of page counts), `paged_kv_indices` (the used pages of
every request, end to end) and `paged_kv_last_page_len` [B] (tokens in each last page, 1..page_size),
from which it derives each request's length as (pages - 1) * page_size + last_page_len.
`flashinfer_plan_inputs` builds them with numpy on the host.

Planning: `plan()` needs the head counts, head dim, dtypes and softmax scale, and the backend
first learns those in `forward`, so the plan happens at the first layer of each step and is
reused by the others (the wrappers remember which step they were planned for). Mixed steps use
`BatchPrefillWithPagedKVCacheWrapper` with `causal=True` (its default is False!), whose causal mask
is bottom-right aligned like the project's; pure-decode steps use
`BatchDecodeWithPagedKVCacheWrapper`. FlashInfer kernels take fp16/bf16 (fp8 KV aside), not fp32.

Optional features are plan() arguments (`flashinfer_feature_args`): a sliding window of W keys is
`window_left=W - 1` (inclusive: query i sees keys i - window_left .. i), soft-capping is
`logits_soft_cap`. A plan fixes them, so each distinct kind of layer (e.g. windowed and full, in
alternating models) has its own wrapper, planned once per step; they share the workspace, as
the layers run one after another. Sinks are not declared.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from backends.base import write_kv
from varlen.attention_api import AttentionBackend, AttentionMetadata, BackendUnavailable, LayerAttention
from varlen.batch import ForwardBatch

INSTALL_HINT = 'pip install -e ".[flashinfer]"'
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented default for its split-KV scratch

_step_ids = itertools.count()


def flashinfer_plan_inputs(batch: ForwardBatch) -> dict[str, np.ndarray]:
    """FlashInfer's page-table description of this step, as host int32 arrays (numpy only).

    Returns `qo_indptr` [B+1], `paged_kv_indptr` [B+1], `paged_kv_indices` [total pages] and
    `paged_kv_last_page_len` [B].
    """
    bs = batch.block_size
    seq_lens = batch.seq_lens.astype(np.int64)
    num_pages = -(-seq_lens // bs)  # every request has >= 1 token, hence >= 1 page
    indptr = np.zeros(seq_lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    # Row-major boolean indexing keeps each request's pages in order and the requests in order.
    used = np.arange(batch.block_tables.shape[1])[None, :] < num_pages[:, None]
    return {
        "qo_indptr": np.ascontiguousarray(batch.query_start_loc, dtype=np.int32),
        "paged_kv_indptr": indptr,
        "paged_kv_indices": np.ascontiguousarray(batch.block_tables[used], dtype=np.int32),
        "paged_kv_last_page_len": (seq_lens - (num_pages - 1) * bs).astype(np.int32),
    }


def flashinfer_feature_args(layer: LayerAttention | None) -> dict[str, Any]:
    """plan() keyword arguments for one layer's optional features (empty for a plain layer)."""
    args: dict[str, Any] = {}
    if layer is None:
        return args
    if layer.sliding_window is not None:
        args["window_left"] = layer.sliding_window - 1
    if layer.softcap is not None:
        args["logits_soft_cap"] = float(layer.softcap)
    if layer.sinks is not None:
        raise ValueError("backend 'flashinfer' does not implement attention sinks")  # refused at bind
    return args


@dataclass
class FlashInferMetadata(AttentionMetadata):
    # Host (CPU) tensors: plan() reads them on the host and copies what the kernels need.
    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    step_id: int = field(default_factory=lambda: next(_step_ids))


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - a broken install (missing .so, wrong CUDA) is "unavailable" too
        raise BackendUnavailable(
            f"backend 'flashinfer' needs the flashinfer-python package, which is not importable "
            f"({_first_line(exc)}); install it with {INSTALL_HINT}") from None
    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    features = frozenset({"sliding_window", "softcap"})

    def __init__(self, use_decode_wrapper: bool = True, decode_tensor_cores: bool | None = None,
                 prefill_backend: str = "auto", workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """`use_decode_wrapper`: pure-decode steps use the decode wrapper (else the prefill one).
        `decode_tensor_cores`: None chooses by GQA group size (>= 4 uses the tensor-core kernels).
        `prefill_backend`: FlashInfer's prefill implementation, "auto", "fa2" or "fa3"."""
        self.use_decode_wrapper = use_decode_wrapper
        self.decode_tensor_cores = decode_tensor_cores
        self.prefill_backend = prefill_backend
        self.workspace_bytes = workspace_bytes
        self._fi: Any = None
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[Any, ...], Any] = {}  # (decode, tensor cores, features) -> wrapper
        self._planned: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # wrapper key -> (step_id, shapes, ...)

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        super().check(device, dtype, block_size)
        self.require_cuda(INSTALL_HINT)
        self._fi = _import_flashinfer()

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> FlashInferMetadata:
        host = flashinfer_plan_inputs(batch)
        return FlashInferMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(device, non_blocking=True),
            batch=batch,
            qo_indptr=torch.from_numpy(host["qo_indptr"]),
            paged_kv_indptr=torch.from_numpy(host["paged_kv_indptr"]),
            paged_kv_indices=torch.from_numpy(host["paged_kv_indices"]),
            paged_kv_last_page_len=torch.from_numpy(host["paged_kv_last_page_len"]),
        )

    def _wrapper(self, decode: bool, tensor_cores: bool, features: tuple[Any, ...], device: torch.device) -> Any:
        if self._fi is None:
            self._fi = _import_flashinfer()
        if self._workspace is None or self._workspace.device != device:
            # Zeroed: FlashInfer requires the float workspace to start at 0 on its first use.
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._wrappers, self._planned = {}, {}
        key = (decode, tensor_cores, features)
        if key not in self._wrappers:
            self._wrappers[key] = (
                self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=tensor_cores)
                if decode else
                self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=self.prefill_backend))
        return self._wrappers[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: FlashInferMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        num_qo_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
        decode = self.use_decode_wrapper and meta.batch.is_pure_decode
        tensor_cores = (self.decode_tensor_cores if self.decode_tensor_cores is not None
                        else num_qo_heads // num_kv_heads >= 4)
        features = flashinfer_feature_args(layer)
        wkey = (decode, tensor_cores, tuple(sorted(features.items())))
        wrapper = self._wrapper(decode, tensor_cores, wkey[2], q.device)
        plan = (meta.step_id, num_qo_heads, num_kv_heads, head_dim, page_size, q.dtype, kv_cache.dtype, float(scale))
        if self._planned.get(wkey) != plan:
            common = dict(q_data_type=q.dtype, kv_data_type=kv_cache.dtype, sm_scale=float(scale), **features)
            if decode:
                wrapper.plan(meta.paged_kv_indptr, meta.paged_kv_indices, meta.paged_kv_last_page_len,
                             num_qo_heads, num_kv_heads, head_dim, page_size, **common)
            else:
                wrapper.plan(meta.qo_indptr, meta.paged_kv_indptr, meta.paged_kv_indices,
                             meta.paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                             causal=True, **common)
            self._planned[wkey] = plan
        return wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))
