"""The Triton kernels behind `backends/triton_paged.py` (imported lazily, by it alone).

Conventions as backends/torch_ref.py. One program per (query tile, request, KV head, KV split); a
tile's rows are tokens x the GROUP query heads of one KV head, so each K/V tile is read once per
group. Split parts carry their log-sum-exp, by which `merge_splits_kernel` weights them. The
optional features (sliding window, logit soft-cap, sinks) are constexpr switches: a model without
them runs the plain kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)


# Arguments that vary per step are not specialised, to keep compilations few.
@triton.jit(do_not_specialize=["window", "block_size", "split_len", "stride_table", "stride_o_split", "stride_lse_split",
                               "stride_lse_tok"])
def paged_attention_kernel(
    out_ptr, lse_ptr,  # out: [N, Hq, D] (one split) or [S, N, Hq, D] fp32 parts; lse: [S, N, Hq] fp32
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    sinks_ptr,  # [Hq] fp32 sink logits (HAS_SINKS; any pointer otherwise)
    score_scale,  # softmax scale * log2(e) (the kernel works in base 2: exp2 is the hardware's exp);
                  # with SOFTCAP, scale / cap
    softcap_log2,  # cap * log2(e) (SOFTCAP)
    window,  # W (HAS_WINDOW): position p sees keys p-W+1..p
    block_size, split_len,
    stride_q_tok, stride_q_head,
    stride_kv_block, stride_kv_row, stride_kv_head,
    stride_table,
    stride_o_split, stride_o_tok, stride_o_head,
    stride_lse_split, stride_lse_tok,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    split = tl.program_id(2) // NUM_KV_HEADS

    q_start = tl.load(query_start_loc_ptr + req)
    n_new = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * TOKENS >= n_new:  # the grid is sized for the longest request; shorter ones end here
        return
    seq_len = tl.load(seq_lens_ptr + req)
    n_cached = seq_len - n_new

    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // GROUP  # index among the request's new tokens
    head = kv_head * GROUP + rows % GROUP  # query head
    row_ok = (rows < TOKENS * GROUP) & (tok < n_new)
    q_pos = n_cached + tok  # the query's position: the last key it may see
    d = tl.arange(0, BLOCK_D)  # BLOCK_D: D rounded up to a power of two >= 16
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    q_first = n_cached + tile * TOKENS  # the tile's first query position
    kv_end = tl.minimum(seq_len, q_first + TOKENS)
    if HAS_WINDOW:
        # From the first key the tile's first row sees: blocks wholly behind it may be freed, and
        # splits share the window's span, not the whole context.
        kv_first = tl.maximum(q_first - window + 1, 0)
    else:
        kv_first = 0
    kv_lo = kv_first + split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    # Online softmax: running row max m, running sum l, output accumulated unnormalised.
    if HAS_SINKS:
        # The sink joins the denominator once (split 0's): it starts that split's max and sum.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2_E
        m = tl.where(split == 0, sink, float("-inf"))
        l = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_hi
        block = tl.load(block_tables_ptr + req * stride_table + j // block_size, mask=j_ok, other=0)
        kv_off = block.to(tl.int64) * stride_kv_block + (j % block_size) * stride_kv_row + kv_head * stride_kv_head
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * score_scale
        if SOFTCAP:
            # cap * tanh(x / cap) with tanh from exp2 (the interpreter has no tanh): with
            # t = e^(-2|y|), tanh(|y|) = (1 - t) / (1 + t), which never overflows.
            t = tl.exp2(tl.abs(s) * (-2.0 * LOG2_E))
            s = tl.where(s < 0.0, t - 1.0, 1.0 - t) / (1.0 + t) * softcap_log2
        visible = j_ok[None, :] & (j[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with no visible key yet subtracts 0, not -inf: no NaN, p and alpha exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    if SPLIT:
        # A row with no visible key (nor sink) in this split gets lse = -inf: weight 0 in the merge.
        seen = l > 0.0
        l_safe = tl.where(seen, l, 1.0)
        lse = tl.where(seen, m + tl.log2(l_safe), float("-inf"))
        o = acc / l_safe[:, None]
        o_ptrs = (out_ptr + split * stride_o_split + (q_start + tok)[:, None] * stride_o_tok
                  + head[:, None] * stride_o_head + d[None, :])
        tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + split * stride_lse_split + (q_start + tok) * stride_lse_tok + head, lse, mask=row_ok)
    else:
        # Every real row saw its own key at least, so l > 0 there; padding rows (not stored) may
        # see none under a window: 1, not 0/0.
        o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits", "stride_p_split", "stride_lse_split", "stride_lse_tok"])
def merge_splits_kernel(
    out_ptr, parts_ptr, lse_ptr, num_splits, num_heads,
    stride_o_tok, stride_o_head,
    stride_p_split, stride_p_tok, stride_p_head,
    stride_lse_split, stride_lse_tok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per (token, BLOCK_H query heads): the log-sum-exp weighted mean of the split parts."""
    tok = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sh_ok = (s < num_splits)[:, None] & (h < num_heads)[None, :]
    lse = tl.load(lse_ptr + s[:, None] * stride_lse_split + tok * stride_lse_tok + h[None, :], mask=sh_ok,
                  other=float("-inf"))
    # Every real row sees its own key in some split: each real head's max is finite, its weights sum > 0.
    lse_max = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max)[None, :])  # padding heads: all 0
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)[None, :]
    parts = tl.load(parts_ptr + s[:, None, None] * stride_p_split + tok * stride_p_tok
                    + h[None, :, None] * stride_p_head + d[None, None, :],
                    mask=sh_ok[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)  # [S, H, D]
    o = tl.sum(parts * w[:, :, None], 0)
    tl.store(out_ptr + tok * stride_o_tok + h[:, None] * stride_o_head + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(h < num_heads)[:, None] & (d < HEAD_DIM)[None, :])
