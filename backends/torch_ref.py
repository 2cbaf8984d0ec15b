"""The readable reference backend and oracle: plain torch, one request at a time, every optional
feature written as transformers' eager attention defines it."""

from __future__ import annotations

import torch

from backends.kv_write import write_kv
from varlen.attention_api import BATCH_INVARIANT, FEATURES, AttentionBackend, AttentionMetadata, LayerAttention


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    # One request at a time: batch-invariant whatever the option.
    features = frozenset({*FEATURES, BATCH_INVARIANT})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, layer: LayerAttention | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        window = layer.sliding_window if layer else None
        softcap = layer.softcap if layer else None
        sinks = layer.sinks if layer else None
        b = meta.batch
        block_size = kv_cache.shape[2]
        group = q.shape[1] // kv_cache.shape[3]  # query heads per KV head (GQA)
        out = torch.empty_like(q)
        qsl = b.query_start_loc.tolist()
        for i, seq_len in enumerate(b.seq_lens.tolist()):
            start, end = qsl[i], qsl[i + 1]
            n_new = end - start
            # Keys before the first query's window are never read: their blocks may be gone.
            first = 0 if window is None else max(0, seq_len - n_new - window + 1)
            first_block = first // block_size
            blocks = torch.as_tensor(b.block_tables[i, first_block: -(-seq_len // block_size)], device=q.device,
                                     dtype=torch.long)
            offset = first_block * block_size
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len - offset].repeat_interleave(group, dim=1)
            vals = kv_cache[1, blocks].flatten(0, 1)[:seq_len - offset].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys.float()) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            # Bottom-right causal: new token j sits at position seq_len - n_new + j.
            q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
            k_pos = torch.arange(offset, seq_len, device=q.device)
            visible = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is None:
                probs = scores.softmax(-1)
            else:  # a sink column joins the softmax, then is dropped: it attends to nothing
                sink = sinks.float().reshape(-1, 1, 1).expand(-1, n_new, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, vals.float()).to(q.dtype)
        return out
