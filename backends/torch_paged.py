"""A CPU backend that attends over the paged KV cache in place, with no per-step copy of contexts.

One call per layer of a C kernel (backends/csrc/paged_attention.c, via ctypes) covers the batch;
requests with >= LONG_SDPA_MIN new tokens go to SDPA (unless a layer soft-caps or has sinks, which
SDPA cannot do: then the kernel takes them too). Sliding windows, soft-capping and sinks are the
kernel's. The kernel is built at first use into the varlen cache, keyed by source, shared headers
(varlen/csrc/vec_exp.h), compiler, flags, CPU and torch; without it (no compiler, fp16,
VARLEN_PAGED_KERNEL=0) torch_sdpa's code runs, or torch_ref's for a model with soft-capping or
sinks. K tiles are stored transposed ([D, block_size]).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from varlen.attention_api import BATCH_INVARIANT, AttentionBackend, AttentionMetadata, LayerAttention
from varlen.batch import ForwardBatch
from varlen.c_build import build_cached

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
_ELEM = {torch.float32: 4, torch.bfloat16: 2}


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (once per source, shared headers, compiler, flags, CPU, torch and Python);
    returns the shared library. Raises on failure."""
    return build_cached(SOURCE, "paged-attn", (torch.__version__,), verbose)


_kernel: Any = None  # the loaded library, False once it failed (warned once per process)


def load_kernel() -> Any:
    """The ctypes library, building it if needed; None (after one warning) if it cannot be had."""
    global _kernel
    if _kernel is None:
        if os.environ.get("VARLEN_PAGED_KERNEL", "1") == "0":
            _kernel = False
        else:
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.varlen_paged_attention
                fn.restype = ctypes.c_int
                i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i32, ptr, i64, ptr, i32,
                               i32, i32, i32, i32, ctypes.c_float, i32, i32, ctypes.c_float, ptr]
                lib.varlen_paged_attention_tile.restype = ctypes.c_int
                _kernel = lib
            except (RuntimeError, OSError) as err:
                warnings.warn(f"torch_paged: the C kernel is unavailable ({str(err).splitlines()[0][:300]}); "
                              f"running torch_sdpa's gather-then-SDPA code instead (torch_ref's for soft-capping "
                              f"or sinks; correct, slower)",
                              RuntimeWarning, stacklevel=3)
                _kernel = False
    return _kernel or None


#: Requests with this many new tokens go to SDPA's flash kernel (faster on long query blocks): a
#: fresh prefill on its own K/V, a chunk on its context gathered once per layer.
LONG_SDPA_MIN = 64


def work_units(batch: ForwardBatch, tile: int, skip: np.ndarray | None = None) -> np.ndarray:
    """[U, 3] int32 (request, first query row, end query row): every request's new tokens (but
    those of requests flagged in `skip`) in tiles of `tile` rows, heaviest first (rows x keys), so
    dynamic scheduling ends with the small ones."""
    q_lens = batch.query_lens.astype(np.int64)
    if skip is not None:
        q_lens = np.where(skip, 0, q_lens)
    tiles = -(-q_lens // tile)
    seq = np.repeat(np.arange(batch.num_seqs), tiles)
    first = (np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * tile
    end = np.minimum(first + tile, q_lens[seq])
    keys = batch.seq_lens[seq].astype(np.int64) - q_lens[seq] + end  # keys seen by the tile's last row
    units = np.stack([seq, first, end], axis=1).astype(np.int32)
    return np.ascontiguousarray(units[np.argsort(-(end - first) * keys, kind="stable")])


def decode_units(seq_lens: np.ndarray) -> np.ndarray:
    """work_units of a pure-decode step, cheaper: same units, same order (tests/backends/test_torch_paged.py)."""
    units = np.zeros((len(seq_lens), 3), dtype=np.int32)
    units[:, 0] = np.argsort(-seq_lens, kind="stable")  # lengths are positive: no overflow
    units[:, 2] = 1
    return units


def to_nhd(cache: torch.Tensor) -> torch.Tensor:
    """This backend's cache as the default [2, num_blocks, block_size, Hkv, D] layout (a copy)."""
    _, nb, hkv, bs, d = cache.shape
    k = cache[0].reshape(nb, hkv, d, bs).permute(0, 3, 1, 2)
    v = cache[1].permute(0, 2, 1, 3)
    return torch.stack([k, v])


def from_nhd(nhd: torch.Tensor) -> torch.Tensor:
    """A default-layout cache in this backend's layout (a copy)."""
    _, nb, bs, hkv, d = nhd.shape
    k = nhd[0].permute(0, 2, 3, 1).reshape(nb, hkv, bs, d)
    v = nhd[1].permute(0, 2, 1, 3)
    return torch.stack([k, v]).contiguous()


def write_paged(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                offsets: torch.Tensor) -> None:
    """Store new K/V [N, Hkv, D] at (block, offset) in this backend's layout."""
    _, nb, hkv, bs, d = cache.shape
    cache[0].view(nb, hkv, d, bs)[blocks, :, :, offsets] = k.to(cache.dtype)
    cache[1][blocks, :, offsets, :] = v.to(cache.dtype)


@dataclass
class PagedMetadata(AttentionMetadata):
    arrays: tuple[np.ndarray, ...] = ()  # kept alive: the kernel reads them through raw pointers
    pointers: tuple[int, ...] = ()  # query_start_loc, seq_lens, block_tables, units
    bt_stride: int = 0
    num_units: int = 0
    fallback: Any = None  # torch_sdpa's metadata
    # SDPA requests: (start, end, context length, plans); plans[window] = (first key gathered,
    # context blocks or None when fresh, key mask or None for plain causal)
    long: list[tuple[int, int, int, dict]] = field(default_factory=list)
    blocks: torch.Tensor | None = None  # [N] each new token's block and offset in it
    offsets: torch.Tensor | None = None


def _blocks_and_offsets(batch: ForwardBatch, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's cache block and offset in it."""
    blocks, offsets = np.divmod(batch.slot_mapping, batch.block_size)
    return torch.from_numpy(blocks).to(device), torch.from_numpy(offsets).to(device)


def _long_plans(L: int, n: int, table: np.ndarray, bs: int, windows: set, device: torch.device | str) -> dict:
    """An SDPA request's K/V per window: (first key gathered, context blocks or None when nothing is
    cached, key mask or None for plain causal). Blocks wholly before the first query's window are
    never read (they may be freed)."""
    plans = {}
    for w in windows:
        if n == L:
            cut = w is not None and w < L
            pos = np.arange(L)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w) if cut else None
            plans[w] = (0, None, None if mask is None else torch.from_numpy(mask).to(device))
            continue
        first = (0 if w is None else max(L - n - w + 1, 0)) // bs * bs
        q_pos, k_pos = np.arange(L - n, L)[:, None], np.arange(first, L)[None, :]
        visible = k_pos <= q_pos
        if w is not None:
            visible &= k_pos > q_pos - w
        blocks = torch.from_numpy(table[first // bs: -(-L // bs)].astype(np.int64)).to(device)
        plans[w] = (first, blocks, torch.from_numpy(visible).to(device))
    return plans


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"
    devices = ("cpu",)
    features = frozenset({"sliding_window", "softcap", "sinks", BATCH_INVARIANT})

    def __init__(self, batch_invariant: bool = False):
        super().__init__(batch_invariant)
        self._slow: Any = None
        self._bound: tuple = ()
        self._sdpa_ok = True  # no layer soft-caps or has sinks: long requests may go to SDPA
        self._windows: set = {None}
        self._sinks: dict[int, torch.Tensor] = {}  # id(layer.sinks) -> fp32 copy the kernel reads

    def bind(self, *args: Any, **kwargs: Any) -> None:
        super().bind(*args, **kwargs)
        self._bound = (args, kwargs)
        self._sdpa_ok = not any(spec.softcap is not None or spec.sinks is not None for spec in self.layers)
        self._windows = {spec.sliding_window for spec in self.layers} or {None}
        self._sinks = {id(spec.sinks): spec.sinks.detach().float().contiguous()
                       for spec in self.layers if spec.sinks is not None}

    @property
    def long_query_min(self) -> int:
        """New tokens from which a request takes SDPA (cost ~ its n x (cached + n) rectangle) rather than the
        kernel (~ its causal pairs); 0 when every request takes the kernel. sim.profile records it per table."""
        return LONG_SDPA_MIN if self._sdpa_ok else 0

    def slow_path_reason(self, dtype: torch.dtype) -> str | None:
        """Why this backend would run another backend's code (for backend=auto), or None."""
        if dtype not in _ELEM:
            return f"no kernel for {str(dtype).removeprefix('torch.')} (it would run torch_sdpa's code)"
        return None if load_kernel() is not None else "its C kernel is unavailable"

    def _fallback(self) -> Any:
        """torch_sdpa, or torch_ref for layers SDPA cannot do, bound like this backend."""
        if self._slow is None:
            from backends.torch_ref import TorchRefBackend
            from backends.torch_sdpa import TorchSdpaBackend

            cls = TorchSdpaBackend if self._sdpa_ok else TorchRefBackend
            self._slow = cls(batch_invariant=self.batch_invariant)
            if self._bound:
                self._slow.bind(*self._bound[0], **self._bound[1])
        return self._slow

    def _kernel_for(self, dtype: torch.dtype) -> Any:
        return load_kernel() if dtype in _ELEM else None

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
        # The kernel is built here and decides the layout; forward makes the same choice by dtype.
        if self._kernel_for(dtype) is None:
            return super().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def uses_kernel(self) -> bool:
        """Builds (or finds) the kernel; False when the backend runs on the fallback."""
        return load_kernel() is not None

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> PagedMetadata:
        slots = self.upload_slot_mapping(batch, device)
        lib = load_kernel()
        if lib is None:
            return PagedMetadata(slot_mapping=slots, batch=batch, fallback=self._fallback().prepare(batch, device))
        qsl = np.ascontiguousarray(batch.query_start_loc, dtype=np.int32)
        lens = np.ascontiguousarray(batch.seq_lens, dtype=np.int32)
        tables = np.ascontiguousarray(batch.block_tables, dtype=np.int32)
        long: list[tuple[int, int, int, dict]] = []
        if batch.max_query_len == 1:  # pure decode: no request for SDPA
            units = decode_units(lens)
            blocks, offsets = _blocks_and_offsets(batch, device)
            return PagedMetadata(slot_mapping=slots, batch=batch, arrays=(qsl, lens, tables, units), long=long,
                                 pointers=(qsl.ctypes.data, lens.ctypes.data, tables.ctypes.data, units.ctypes.data),
                                 bt_stride=tables.shape[1], num_units=units.shape[0], blocks=blocks, offsets=offsets)
        q_lens = np.diff(qsl)
        is_long = q_lens >= LONG_SDPA_MIN if self._sdpa_ok else np.zeros(len(q_lens), dtype=bool)
        units = work_units(batch, lib.varlen_paged_attention_tile(), skip=is_long)
        arrays = (qsl, lens, tables, units)
        blocks, offsets = _blocks_and_offsets(batch, device)
        for i in np.flatnonzero(is_long):
            start, end, L = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
            long.append((start, end, L, _long_plans(L, end - start, tables[i], batch.block_size, self._windows, device)))
        return PagedMetadata(slot_mapping=slots, batch=batch, arrays=arrays, long=long,
                             pointers=tuple(a.ctypes.data for a in arrays), bt_stride=tables.shape[1],
                             num_units=units.shape[0], blocks=blocks, offsets=offsets)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: PagedMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        elem = _ELEM.get(kv_cache.dtype)
        if meta.fallback is not None or elem is None:
            if meta.fallback is None:
                meta.fallback = self._fallback().prepare(meta.batch, q.device)
            extra = {"layer": layer} if layer is not None else {}
            return self._fallback().forward(q, k, v, kv_cache, meta.fallback, scale, **extra)
        window = layer.sliding_window if layer is not None else None
        softcap = layer.softcap if layer is not None else None
        sinks = None
        if layer is not None and layer.sinks is not None:
            sinks = self._sinks.get(id(layer.sinks))
            if sinks is None:  # a layer this backend was not bound to
                sinks = self._sinks[id(layer.sinks)] = layer.sinks.detach().float().contiguous()
        write_paged(kv_cache, k, v, meta.blocks, meta.offsets)
        if not kv_cache.is_contiguous():
            raise ValueError("torch_paged needs a contiguous KV cache (allocate it with allocate_kv_cache)")
        if q.dtype != kv_cache.dtype or q.stride(-1) != 1:
            q = q.to(kv_cache.dtype).contiguous()
        n, hq, d = q.shape
        hkv = kv_cache.shape[2]
        out = torch.empty((n, hq, d), dtype=q.dtype)
        qsl, lens, tables, units = meta.pointers
        rc = load_kernel().varlen_paged_attention(
            q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
            elem, qsl, lens, meta.batch.num_seqs, tables, meta.bt_stride, units, meta.num_units, hq, hkv, d,
            kv_cache.shape[3], scale, torch.get_num_threads(), window or 0, softcap or 0.0,
            None if sinks is None else sinks.data_ptr())
        if rc != 0:
            raise MemoryError("torch_paged: the attention kernel could not allocate its scratch memory")
        _, nb, _, bs, _ = kv_cache.shape
        for start, end, L, plans in meta.long:
            first, blocks, mask = plans[window]
            qp = q[start:end].transpose(0, 1)[None]
            if blocks is None:
                kp, vp = (t[start:end].to(q.dtype).transpose(0, 1)[None] for t in (k, v))
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                   enable_gqa=True)
            else:  # [W, Hkv, D, bs] K tiles and [W, Hkv, bs, D] V tiles → [1, Hkv, L - first, D]
                kp = kv_cache[0].view(nb, hkv, d, bs)[blocks].permute(1, 0, 3, 2).reshape(hkv, -1, d)[None, :, :L - first]
                vp = kv_cache[1][blocks].transpose(0, 1).reshape(hkv, -1, d)[None, :, :L - first]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out


if __name__ == "__main__":
    try:
        print(f"built: {build(verbose=True)}")
    except RuntimeError as err:
        print(f"WARNING: {err}", file=sys.stderr)
        sys.exit(1)
