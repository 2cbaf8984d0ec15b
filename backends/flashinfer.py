"""FlashInfer backend: paged prefill/append attention planned once per step, run once per layer.

Layout: FlashInfer's NHD paged cache accepts a `(k_cache, v_cache)` tuple of
[num_pages, page_size, Hkv, D] tensors, which is exactly `cache[0], cache[1]` of the base
[2, num_blocks, block_size, Hkv, D] layout. So this backend keeps the base `kv_cache_shape` and the
`write_kv` (backends/kv_write.py), and any block size works (FlashInfer has no page-size restriction).

Page table: FlashInfer describes each request's pages in CSR form instead of a padded block
table: `paged_kv_indptr` [B+1] (running sum of page counts), `paged_kv_indices` (the used pages of
every request, end to end) and `paged_kv_last_page_len` [B] (tokens in each last page, 1..page_size),
from which it derives each request's length as (pages - 1) * page_size + last_page_len.
`flashinfer_plan_inputs` builds them with numpy on the host.

Planning: `plan()` needs the head counts, head dim, dtypes and softmax scale, which `bind` gives
once (with each layer's spec), so `prepare` plans every wrapper the step needs, on the host, and
the layers only run (`flashinfer_plans` builds the plan() arguments, tested on CPU). Mixed steps use
`BatchPrefillWithPagedKVCacheWrapper` with `causal=True` (its default is False!), whose causal mask
is bottom-right aligned like the project's; pure-decode steps use
`BatchDecodeWithPagedKVCacheWrapper`. FlashInfer kernels take fp16/bf16 (fp8 KV aside), not fp32.

Optional features are plan() arguments (`flashinfer_feature_args`): a sliding window of W keys is
`window_left=W - 1` (inclusive: query i sees keys i - window_left .. i), soft-capping is
`logits_soft_cap`. A plan fixes them and the softmax scale, so each distinct kind of layer (e.g.
windowed and full, in alternating models) has its own wrapper, planned once per step; they share
the workspace, as the layers run one after another. Sinks are not declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from backends.kv_write import write_kv
from varlen.attention_api import AttentionBackend, AttentionMetadata, BackendUnavailable, LayerAttention, first_line
from varlen.batch import ForwardBatch

INSTALL_HINT = 'pip install -e ".[flashinfer]"'
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented default for its split-KV scratch


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


#: What a plan fixes about a layer besides the step's shapes: its feature arguments and softmax scale.
LayerKind = tuple[tuple[tuple[str, Any], ...], float]


def layer_kind(layer: LayerAttention | None, scale: float) -> LayerKind:
    return tuple(sorted(flashinfer_feature_args(layer).items())), float(scale)


def flashinfer_plans(batch: ForwardBatch, kinds: set[LayerKind] | frozenset[LayerKind], num_q_heads: int,
                     num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     decode: bool) -> dict[LayerKind, tuple[tuple[Any, ...], dict[str, Any]]]:
    """The plan() call (positional and keyword arguments) of each kind of layer for this step:
    the decode wrapper's when `decode`, else the prefill wrapper's (causal=True: its default is
    False). Host tensors only: plan() reads them on the host."""
    host = {k: torch.from_numpy(a) for k, a in flashinfer_plan_inputs(batch).items()}
    pages = (host["paged_kv_indptr"], host["paged_kv_indices"], host["paged_kv_last_page_len"])
    shape = (num_q_heads, num_kv_heads, head_dim, batch.block_size)
    plans = {}
    for kind in sorted(kinds):
        features, scale = kind
        kwargs: dict[str, Any] = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=scale, **dict(features))
        if decode:
            plans[kind] = ((*pages, *shape), kwargs)
        else:
            plans[kind] = ((host["qo_indptr"], *pages, *shape), {"causal": True, **kwargs})
    return plans


@dataclass
class FlashInferMetadata(AttentionMetadata):
    wrappers: dict[LayerKind, Any] = field(default_factory=dict)  # each kind of layer's wrapper, planned


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - a broken install (missing .so, wrong CUDA) is "unavailable" too
        raise BackendUnavailable(
            f"backend 'flashinfer' needs the flashinfer-python package, which is not importable "
            f"({first_line(exc)}); install it with {INSTALL_HINT}") from None
    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    features = frozenset({"sliding_window", "softcap"})

    def __init__(self, use_decode_wrapper: bool = True, decode_tensor_cores: bool | None = None,
                 prefill_backend: str = "auto", workspace_bytes: int = WORKSPACE_BYTES,
                 batch_invariant: bool = False) -> None:
        """`use_decode_wrapper`: pure-decode steps use the decode wrapper (else the prefill one).
        `decode_tensor_cores`: None chooses by GQA group size (>= 4 uses the tensor-core kernels).
        `prefill_backend`: FlashInfer's prefill implementation, "auto", "fa2" or "fa3"."""
        super().__init__(batch_invariant)  # True is refused: no batch-invariant mode
        self.use_decode_wrapper = use_decode_wrapper
        self.decode_tensor_cores = decode_tensor_cores
        self.prefill_backend = prefill_backend
        self.workspace_bytes = workspace_bytes
        self._fi: Any = None
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[Any, ...], Any] = {}  # (decode, layer kind) -> wrapper
        self._kinds: frozenset[LayerKind] = frozenset()

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int) -> None:
        super().check(device, dtype, block_size)
        self.require_cuda(INSTALL_HINT)
        self._fi = _import_flashinfer()

    def bind(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             device: torch.device | str, layers: Sequence[LayerAttention] = (), model_name: str = "model") -> None:
        """As the base, and the kinds of layer each step plans for (no layers given: every layer
        plain, at the default scale 1/sqrt(head_dim))."""
        super().bind(num_q_heads, num_kv_heads, head_dim, dtype, block_size, device, layers, model_name)
        self._kinds = frozenset(layer_kind(spec, spec.scale) for spec in self.layers) or \
            frozenset({layer_kind(None, head_dim ** -0.5)})

    @property
    def tensor_cores(self) -> bool:
        """Whether the decode wrapper uses the tensor-core kernels (by GQA group size unless set)."""
        if self.decode_tensor_cores is not None:
            return self.decode_tensor_cores
        return self.num_q_heads // self.num_kv_heads >= 4

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> FlashInferMetadata:
        if not self._kinds:
            raise RuntimeError("backend 'flashinfer': bind(...) the model's shapes before prepare (the model runner does)")
        decode = self.use_decode_wrapper and batch.is_pure_decode
        plans = flashinfer_plans(batch, self._kinds, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                 self.dtype, decode)
        wrappers = {}
        for kind, (args, kwargs) in plans.items():
            wrappers[kind] = wrapper = self._wrapper(decode, kind, torch.device(device))
            wrapper.plan(*args, **kwargs)
        return FlashInferMetadata(slot_mapping=self.upload_slot_mapping(batch, device), batch=batch, wrappers=wrappers)

    def _wrapper(self, decode: bool, kind: LayerKind, device: torch.device) -> Any:
        if self._fi is None:
            self._fi = _import_flashinfer()
        if self._workspace is None or self._workspace.device != device:
            # Zeroed: FlashInfer requires the float workspace to start at 0 on its first use.
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._wrappers = {}
        key = (decode, kind)
        if key not in self._wrappers:
            self._wrappers[key] = (
                self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=self.tensor_cores)
                if decode else
                self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=self.prefill_backend))
        return self._wrappers[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: FlashInferMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        wrapper = meta.wrappers.get(layer_kind(layer, scale))
        if wrapper is None:
            raise ValueError(f"backend 'flashinfer': a layer with scale {scale} and features "
                             f"{dict(layer_kind(layer, scale)[0]) or 'none'} that bind(...) was not told of "
                             f"(it plans for: {sorted(meta.wrappers)})")
        return wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))
