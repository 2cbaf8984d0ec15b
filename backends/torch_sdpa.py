"""A fast CPU backend: torch `scaled_dot_product_attention` over contexts gathered once per step.

`prepare` turns the block tables into flat slot indices and masks once per step, so each layer
only gathers and calls SDPA. Decodes (one new token each) are batched into a single padded SDPA
call; prefills and chunks run one SDPA each (there are few per step, and each is big). A prefill
with nothing cached attends to its own new K/V directly, with no gather at all.

With `batch_invariant=True` every request is computed on its own shapes (no padding to the
batch's longest context), so its result does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backends.base import AttentionBackend, AttentionMetadata, write_kv
from varlen.batch import ForwardBatch


@dataclass
class SdpaMetadata(AttentionMetadata):
    # Decodes in groups of similar context length, each one padded SDPA call:
    # (token index of each query [D], block ids [D, W], key mask [D, 1, 1, W * block_size])
    decodes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] | None = None
    # (start, end, context length, context block ids or None for a fresh prefill, causal mask or None)


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

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> SdpaMetadata:
        q_lens, seq_lens = batch.query_lens, batch.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc
        is_decode = (q_lens == 1) & (not self.batch_invariant)
        meta = SdpaMetadata(slot_mapping=torch.from_numpy(batch.slot_mapping).to(device), batch=batch, prefills=[])
        bs = batch.block_size
        meta.decodes = []
        for group in _length_groups(np.flatnonzero(is_decode), seq_lens):
            # Gather whole blocks (contiguous copies), not single slots: far fewer, larger copies.
            W = -(-int(seq_lens[group].max()) // bs)
            blocks = batch.block_tables[group, :W].astype(np.int64)
            real = np.arange(W * bs)[None, :] < seq_lens[group, None]
            blocks = np.where(real[:, ::bs], blocks, 0)  # unspecified padding entries → block 0, masked
            meta.decodes.append((torch.from_numpy(qsl[group].astype(np.int64)).to(device),
                                 torch.from_numpy(blocks).to(device),
                                 torch.from_numpy(real[:, None, None, :]).to(device)))
        for i in np.flatnonzero(~is_decode):
            start, end, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            n = end - start
            if n == L:  # nothing cached: plain causal attention over the new tokens
                meta.prefills.append((start, end, L, None, None))
                continue
            visible = np.arange(L)[None, :] <= np.arange(L - n, L)[:, None]
            blocks = batch.block_tables[i, : -(-L // bs)].astype(np.int64)
            meta.prefills.append((start, end, L, torch.from_numpy(blocks).to(device),
                                  torch.from_numpy(visible).to(device)))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
        group = q.shape[1] // hkv
        out = torch.empty_like(q)
        for rows, blocks, mask in meta.decodes:
            D = rows.shape[0]
            qd = q[rows].view(D, hkv, group, d)  # GQA: a KV head's query heads side by side
            kd = kv_cache[0][blocks].view(D, -1, hkv, d).transpose(1, 2)  # [D, Hkv, W*bs, d]
            vd = kv_cache[1][blocks].view(D, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            out[rows] = o.reshape(D, -1, d)
        for start, end, L, blocks, mask in meta.prefills:
            qp = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, d]
            if blocks is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype), is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                kp = kv_cache[0][blocks].view(-1, hkv, d)[:L].transpose(0, 1)[None]
                vp = kv_cache[1][blocks].view(-1, hkv, d)[:L].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
