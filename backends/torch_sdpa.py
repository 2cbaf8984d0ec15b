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
    decode_rows: torch.Tensor | None = None  # [D] token index of each decode's query
    decode_slots: torch.Tensor | None = None  # [D, L] slots of each decode's context (padded)
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, L] True where a key is real
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] | None = None
    # (start, end, context slots or None for a fresh prefill, bottom-right causal mask or None)


def _context_slots(batch: ForwardBatch, i: int, length: int) -> np.ndarray:
    pos = np.arange(length)
    return batch.block_tables[i, pos // batch.block_size].astype(np.int64) * batch.block_size \
        + pos % batch.block_size


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> SdpaMetadata:
        q_lens, seq_lens = batch.query_lens, batch.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc
        is_decode = (q_lens == 1) & (not self.batch_invariant)
        meta = SdpaMetadata(slot_mapping=torch.from_numpy(batch.slot_mapping).to(device), batch=batch, prefills=[])
        dec = np.flatnonzero(is_decode)
        if dec.size:
            L = int(seq_lens[dec].max())
            pos = np.arange(L)
            real = pos[None, :] < seq_lens[dec, None]
            blocks = np.take_along_axis(batch.block_tables[dec], np.minimum(pos // batch.block_size,
                                        batch.block_tables.shape[1] - 1)[None, :].repeat(dec.size, 0), axis=1)
            slots = np.where(real, blocks.astype(np.int64) * batch.block_size + pos % batch.block_size, 0)
            meta.decode_rows = torch.from_numpy(qsl[dec].astype(np.int64)).to(device)
            meta.decode_slots = torch.from_numpy(slots).to(device)
            meta.decode_mask = torch.from_numpy(real[:, None, None, :]).to(device)
        for i in np.flatnonzero(~is_decode):
            start, end, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            n = end - start
            if n == L:  # nothing cached: plain causal attention over the new tokens
                meta.prefills.append((start, end, None, None))
                continue
            visible = np.arange(L)[None, :] <= np.arange(L - n, L)[:, None]
            meta.prefills.append((start, end, torch.from_numpy(_context_slots(batch, i, L)).to(device),
                                  torch.from_numpy(visible).to(device)))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
        flat_k = kv_cache[0].view(-1, hkv, d)
        flat_v = kv_cache[1].view(-1, hkv, d)
        group = q.shape[1] // hkv
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            D = meta.decode_rows.shape[0]
            qd = q[meta.decode_rows].view(D, hkv, group, d)  # GQA: a KV head's query heads side by side
            kd = flat_k[meta.decode_slots].transpose(1, 2)  # [D, Hkv, L, d]
            vd = flat_v[meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
            out[meta.decode_rows] = o.reshape(D, -1, d)
        for start, end, slots, mask in meta.prefills:
            qp = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, d]
            if slots is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype), is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                kp, vp = flat_k[slots].transpose(0, 1)[None], flat_v[slots].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
