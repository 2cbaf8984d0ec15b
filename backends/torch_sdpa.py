"""A fast CPU backend: torch `scaled_dot_product_attention` over contexts gathered once per step.
`prepare` builds a gather plan (blocks, mask) per sliding window of the bound layers; decodes run
padded in groups of similar length, prefills one call each. Soft-capping and sinks are not
declared: SDPA exposes neither the scores nor the softmax's normaliser."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backends.kv_write import write_kv
from varlen.attention_api import BATCH_INVARIANT, AttentionBackend, AttentionMetadata, LayerAttention
from varlen.batch import ForwardBatch


# window (None: full) -> (block ids, or None: the new K/V; key mask, or None: is_causal)
Plans = dict


@dataclass
class SdpaMetadata(AttentionMetadata):
    # (token index of each query [D], plans): one padded SDPA call per group and layer
    decodes: list[tuple[torch.Tensor, Plans]] | None = None
    # (start, end, plans): one SDPA call per prefill or chunk
    prefills: list[tuple[int, int, Plans]] | None = None


def _length_groups(rows: np.ndarray, seq_lens: np.ndarray, max_waste: float = 1.5) -> list[np.ndarray]:
    """Decode rows in groups of similar context length: padding a group to its longest costs at
    most `max_waste` times the real work."""
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
    features = frozenset({"sliding_window", BATCH_INVARIANT})

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> SdpaMetadata:
        q_lens, seq_lens = batch.query_lens, batch.seq_lens.astype(np.int64)
        qsl = batch.query_start_loc
        is_decode = (q_lens == 1) & (not self.batch_invariant)
        windows = {spec.sliding_window for spec in self.layers} or {None}
        meta = SdpaMetadata(slot_mapping=self.upload_slot_mapping(batch, device), batch=batch,
                            decodes=[], prefills=[])
        bs, tables = batch.block_size, batch.block_tables

        def gather(rows: np.ndarray, first_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Rows' whole blocks from the one holding `first_key` to the last: (block ids, key positions)."""
            first = first_key // bs
            width = int((-(-seq_lens[rows] // bs) - first).max())
            if first.any():
                key_pos = (first * bs)[:, None] + np.arange(width * bs)[None, :]
                cols = np.minimum(first[:, None] + np.arange(width)[None, :], tables.shape[1] - 1)
                blocks = tables[rows[:, None], cols]
            else:
                key_pos = np.arange(width * bs)[None, :]
                blocks = tables[rows, :width]
            # Past a row's length: block 0, masked (a table is never read past it).
            blocks = np.where(key_pos[:, ::bs] < seq_lens[rows, None], blocks, 0)
            return blocks.astype(np.int64), key_pos

        for group in _length_groups(np.flatnonzero(is_decode), seq_lens):
            L = seq_lens[group]
            plans = {}
            for w in windows:  # the decode at L - 1 sees keys L - w .. L - 1
                blocks, key_pos = gather(group, np.zeros_like(L) if w is None else np.maximum(L - w, 0))
                visible = key_pos < L[:, None]
                if w is not None:
                    visible &= key_pos >= L[:, None] - w
                plans[w] = (torch.from_numpy(blocks).to(device), torch.from_numpy(visible[:, None, None, :]).to(device))
            meta.decodes.append((torch.from_numpy(qsl[group].astype(np.int64)).to(device), plans))
        for i in np.flatnonzero(~is_decode):
            start, end, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            n = end - start
            plans = {}
            for w in windows:
                if n == L:  # nothing cached: attend to the new K/V directly, with no gather at all
                    cut = w is not None and w < L
                    q_pos, k_pos = np.arange(L)[:, None], np.arange(L)[None, :]
                    mask = torch.from_numpy((k_pos <= q_pos) & (k_pos > q_pos - w)).to(device) if cut else None
                    plans[w] = (None, mask)
                    continue
                first = (0 if w is None else max(L - n - w + 1, 0)) // bs  # block of the first query's window start
                blocks = tables[i, first: -(-L // bs)].astype(np.int64)
                q_pos, k_pos = np.arange(L - n, L)[:, None], np.arange(first * bs, (first + len(blocks)) * bs)[None, :]
                visible = k_pos <= q_pos
                if w is not None:
                    visible &= k_pos > q_pos - w
                plans[w] = (torch.from_numpy(blocks).to(device), torch.from_numpy(visible).to(device))
            meta.prefills.append((start, end, plans))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        window = layer.sliding_window if layer is not None else None
        hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
        group = q.shape[1] // hkv
        out = torch.empty_like(q)
        for rows, plans in meta.decodes:
            blocks, mask = plans[window]
            D = rows.shape[0]
            qd = q[rows].view(D, hkv, group, d)  # GQA: a KV head's query heads side by side
            kd = kv_cache[0][blocks].view(D, -1, hkv, d).transpose(1, 2)  # [D, Hkv, W*bs, d]
            vd = kv_cache[1][blocks].view(D, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            out[rows] = o.reshape(D, -1, d)
        for start, end, plans in meta.prefills:
            blocks, mask = plans[window]
            qp = q[start:end].transpose(0, 1)[None]
            if blocks is None:
                kp, vp = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=mask,
                                                   is_causal=mask is None, scale=scale, enable_gqa=True)
            else:
                kp = kv_cache[0][blocks].view(-1, hkv, d).transpose(0, 1)[None]
                vp = kv_cache[1][blocks].view(-1, hkv, d).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
