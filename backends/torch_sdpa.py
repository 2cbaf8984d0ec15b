"""A fast CPU backend: torch `scaled_dot_product_attention` over contexts gathered once per step.

`prepare` turns the block tables into flat slot indices and masks once per step, so each layer
only gathers and calls SDPA. Decodes (one new token each) are batched into a single padded SDPA
call; prefills and chunks run one SDPA each (there are few per step, and each is big). A prefill
with nothing cached attends to its own new K/V directly, with no gather at all.

With `batch_invariant=True` every request is computed on its own shapes (no padding to the
batch's longest context), so its result does not depend on what else is in the batch.

Sliding windows are masks: `prepare` builds one mask per distinct window of the bound layers
(alternating models have two: the window and full attention). Soft-capping and sinks need the
scores or the softmax's normaliser, which SDPA does not expose, so they are not declared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backends.base import AttentionBackend, AttentionMetadata, LayerAttention, write_kv
from varlen.batch import ForwardBatch


Masks = dict  # sliding window (None: full causal) -> boolean mask, or None for SDPA's is_causal


@dataclass
class SdpaMetadata(AttentionMetadata):
    # Decodes in groups of similar context length, each one padded SDPA call:
    # (token index of each query [D], block ids [D, W], {window: key mask [D, 1, 1, W * block_size]})
    decodes: list[tuple[torch.Tensor, torch.Tensor, Masks]] | None = None
    prefills: list[tuple[int, int, int, torch.Tensor | None, Masks]] | None = None
    # (start, end, context length, context block ids or None for a fresh prefill, {window: mask or None})


def _length_groups(rows: np.ndarray, seq_lens: np.ndarray, max_waste: float = 1.5) -> list[np.ndarray]:
    """Split decode rows into groups of similar context length, so that padding each group to its
    longest context costs at most `max_waste` times the real work (one long context would
    otherwise make every short one attend over its length)."""
    if rows.size == 0:
        return []
    order = rows[np.argsort(seq_lens[rows], kind="stable")]
    groups, start, total = [], 0, 0
    for i, r in enumerate(order):
        length = int(seq_lens[r])
        if i > start and length * (i - start + 1) > max_waste * (total + length):
            groups.append(order[start:i])
            start, total = i, 0
        total += length
    groups.append(order[start:])
    return groups


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"
    features = frozenset({"sliding_window"})

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> SdpaMetadata:
        q_lens, seq_lens = batch.query_lens, batch.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc
        is_decode = (q_lens == 1) & (not self.batch_invariant)
        windows = {spec.sliding_window for spec in self.layers} or {None}
        meta = SdpaMetadata(slot_mapping=torch.from_numpy(batch.slot_mapping).to(device), batch=batch, prefills=[])
        bs = batch.block_size
        meta.decodes = []
        for group in _length_groups(np.flatnonzero(is_decode), seq_lens):
            # Gather whole blocks (contiguous copies), not single slots: far fewer, larger copies.
            W = -(-int(seq_lens[group].max()) // bs)
            blocks = batch.block_tables[group, :W].astype(np.int64)
            real = np.arange(W * bs)[None, :] < seq_lens[group, None]
            blocks = np.where(real[:, ::bs], blocks, 0)  # unspecified padding entries → block 0, masked
            key_pos = np.arange(W * bs)[None, :]
            masks = {w: torch.from_numpy((real if w is None else real & (key_pos >= seq_lens[group, None] - w))
                                         [:, None, None, :]).to(device) for w in windows}
            meta.decodes.append((torch.from_numpy(qsl[group].astype(np.int64)).to(device),
                                 torch.from_numpy(blocks).to(device), masks))
        for i in np.flatnonzero(~is_decode):
            start, end, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            n = end - start
            q_pos, k_pos = np.arange(L - n, L)[:, None], np.arange(L)[None, :]
            causal = k_pos <= q_pos

            def mask(w: int | None) -> torch.Tensor | None:
                if n == L and (w is None or w >= L):
                    return None  # nothing cached, nothing cut: SDPA's own is_causal
                return torch.from_numpy(causal if w is None else causal & (k_pos > q_pos - w)).to(device)

            # A fresh prefill (nothing cached) attends to its own new K/V: no block to gather.
            blocks = None if n == L else torch.from_numpy(batch.block_tables[i, : -(-L // bs)].astype(np.int64))
            meta.prefills.append((start, end, L, None if blocks is None else blocks.to(device),
                                  {w: mask(w) for w in windows}))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        window = layer.sliding_window if layer is not None else None
        hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
        group = q.shape[1] // hkv
        out = torch.empty_like(q)
        for rows, blocks, masks in meta.decodes:
            mask = masks[window]
            D = rows.shape[0]
            qd = q[rows].view(D, hkv, group, d)  # GQA: a KV head's query heads side by side
            kd = kv_cache[0][blocks].view(D, -1, hkv, d).transpose(1, 2)  # [D, Hkv, W*bs, d]
            vd = kv_cache[1][blocks].view(D, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            out[rows] = o.reshape(D, -1, d)
        for start, end, L, blocks, masks in meta.prefills:
            mask = masks[window]
            qp = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, d]
            if blocks is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=mask,
                                                   is_causal=mask is None, scale=scale, enable_gqa=True)
            else:
                kp = kv_cache[0][blocks].view(-1, hkv, d)[:L].transpose(0, 1)[None]
                vp = kv_cache[1][blocks].view(-1, hkv, d)[:L].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
