"""FlashInfer backend: the base cache as NHD pages, block tables as its CSR page table. A plan fixes
features and scale, so `prepare` plans one wrapper per kind of layer per step (sharing one
workspace) and the layers only run. Sinks are not declared."""

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
    """This step's CSR page table (`qo_indptr`, `paged_kv_indptr`, `paged_kv_indices`,
    `paged_kv_last_page_len`) as numpy int32 arrays."""
    bs = batch.block_size
    seq_lens = batch.seq_lens.astype(np.int64)
    num_pages = -(-seq_lens // bs)  # every request has >= 1 token, hence >= 1 page
    indptr = np.zeros(seq_lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
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
    """Each kind of layer's plan() arguments for this step, decode or prefill wrapper (host tensors).
    causal=True is explicit: the prefill wrapper's default is False."""
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
        """`decode_tensor_cores`: None chooses by GQA group size. `prefill_backend`: "auto", "fa2" or "fa3"."""
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
        """As the base, and the kinds of layer each step plans for (none given: plain, 1/sqrt(head_dim))."""
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
