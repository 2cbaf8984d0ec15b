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
    decode_blocks: torch.Tensor | None = None  # [D, W] block ids of each decode's context (padded)
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, W * block_size] True where a key is real
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] | None = None
    # (start, end, context length, context block ids or None for a fresh prefill, causal mask or None)


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
        dec = np.flatnonzero(is_decode)
        if dec.size:
            # Gather whole blocks (contiguous copies), not single slots: far fewer, larger copies.
            W = -(-int(seq_lens[dec].max()) // bs)
            blocks = batch.block_tables[dec, :W].astype(np.int64)
            real = np.arange(W * bs)[None, :] < seq_lens[dec, None]
            blocks = np.where(real[:, ::bs], blocks, 0)  # unspecified padding entries → block 0, masked
            meta.decode_rows = torch.from_numpy(qsl[dec].astype(np.int64)).to(device)
            meta.decode_blocks = torch.from_numpy(blocks).to(device)
            meta.decode_mask = torch.from_numpy(real[:, None, None, :]).to(device)
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
        if meta.decode_rows is not None:
            D = meta.decode_rows.shape[0]
            qd = q[meta.decode_rows].view(D, hkv, group, d)  # GQA: a KV head's query heads side by side
            kd = kv_cache[0][meta.decode_blocks].view(D, -1, hkv, d).transpose(1, 2)  # [D, Hkv, W*bs, d]
            vd = kv_cache[1][meta.decode_blocks].view(D, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
            out[meta.decode_rows] = o.reshape(D, -1, d)
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
