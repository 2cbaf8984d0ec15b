"""The readable reference backend: plain torch, one request at a time. The oracle for every other backend."""

from __future__ import annotations

import torch

from backends.base import AttentionBackend, AttentionMetadata, write_kv


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    batch_invariant = True  # one request at a time: nothing else in the batch touches its numbers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        b = meta.batch
        block_size = kv_cache.shape[2]
        group = q.shape[1] // kv_cache.shape[3]  # query heads per KV head (GQA)
        out = torch.empty_like(q)
        qsl = b.query_start_loc.tolist()
        for i, seq_len in enumerate(b.seq_lens.tolist()):
            start, end = qsl[i], qsl[i + 1]
            n_new = end - start
            blocks = torch.as_tensor(b.block_tables[i, : -(-seq_len // block_size)], device=q.device,
                                     dtype=torch.long)
            # Gather this request's context through its block table, then cut at its length.
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            vals = kv_cache[1, blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys.float()) * scale
            # Bottom-right causal: new token j sits at position seq_len - n_new + j.
            q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
            visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(q.dtype)
        return out
