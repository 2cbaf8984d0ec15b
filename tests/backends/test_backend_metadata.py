"""The GPU backends' host-side metadata, proved on CPU against the kernel libraries' documented semantics.

FlashInfer and flash-attn cannot run here, but what they are given can be checked: this file
re-implements, in plain torch, what each library's documentation says its paged attention
computes from those inputs (an "emulated kernel"), and requires the result to equal the torch
reference backend on random mixed batches. The emulators are written from the docs alone, and
never share code with the backends:

- FlashInfer (`BatchPrefillWithPagedKVCacheWrapper.plan/run`, decode wrapper): request b owns pages
  `indices[indptr[b]:indptr[b+1]]`; its KV length is (pages - 1) * page_size + last_page_len[b];
  its queries are `q[qo_indptr[b]:qo_indptr[b+1]]`; with causal=True query i sees keys
  j <= i + kv_len - q_len (bottom-right). The NHD cache may be a (k, v) tuple of
  [num_pages, page_size, H, D] tensors.
- flash-attn 2 (`flash_attn_varlen_func(..., block_table=...)`): with a block table, request b has
  seqlen_k = cu_seqlens_k[b+1] - cu_seqlens_k[b] keys, key j lives in block
  `block_table[b, j // page]` at row j % page; causal is bottom-right aligned.
  `flash_attn_with_kvcache` (decode): q [B, 1, H, D], `cache_seqlens` keys per request.
- flash-attn 4 (`flash_attn.cute.flash_attn_varlen_func`): `page_table` plus `seqused_k` per request.

Then the backends' own `prepare`/`forward` run on CPU against fake kernel modules built from the
same emulators, which checks the glue (argument order, causal=True, plan once per step, the
decode path, FlashInfer planning in prepare), and the error messages for a machine without CUDA or without the package.
"""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from varlen import registry
from backends.kv_write import write_kv
from varlen.attention_api import BackendUnavailable, LayerAttention
from backends.flash_attn import FlashAttnBackend, flash_attn_feature_args, flash_attn_inputs
from backends.flashinfer import (FlashInferBackend, flashinfer_feature_args, flashinfer_plan_inputs, flashinfer_plans,
                                 layer_kind)
from backends.torch_ref import TorchRefBackend
from varlen.batch import ForwardBatch, SeqSlice, build_batch
from varlen.testing.attention import ATOL, reference
from varlen.testing.strategies import mixed_batches, problems


def written_cache(p: dict) -> torch.Tensor:
    cache = p["cache"].clone()
    write_kv(cache, p["k"], p["v"], torch.from_numpy(p["batch"].slot_mapping))
    return cache


# ------------------------------------------------------- emulated kernels, from the docs

def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float, causal: bool,
            left: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hq, D] against keys/vals [L, Hkv, D]; query i sits at position i + L - n (bottom-right).

    GQA as both libraries document it: query head h reads KV head h // (Hq // Hkv). A query that
    sees no key gets zeros (flash-attn: "If the row of the mask is all zero, the output will be zero").
    `left`: a sliding window as both document it, query i sees keys i + L - n - left .. (inclusive);
    `softcap` > 0: the scaled logits x become softcap * tanh(x / softcap).
    """
    n, hq, _ = q.shape
    length, hkv = keys.shape[0], keys.shape[1]
    kv_head = torch.arange(hq) // (hq // hkv)
    scores = torch.einsum("nhd,lhd->hnl", q, keys[:, kv_head]) * scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = (torch.arange(n) + length - n)[:, None]
    if causal:
        visible = torch.arange(length)[None, :] <= q_pos
    else:
        visible = torch.ones(n, length, dtype=torch.bool)
    if left is not None and left >= 0:
        visible &= torch.arange(length)[None, :] >= q_pos - left
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("hnl,lhd->nhd", probs, vals[:, kv_head])


def fi_pages(paged_kv_cache: tuple[torch.Tensor, torch.Tensor], indptr: torch.Tensor, indices: torch.Tensor,
             last_page_len: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values, read the FlashInfer way (CSR pages + last page length)."""
    k_pages, v_pages = paged_kv_cache
    page_size = k_pages.shape[1]
    pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
    last = int(last_page_len[b])
    assert 1 <= last <= page_size, f"last_page_len {last} outside [1, page_size={page_size}]"
    kv_len = (len(pages) - 1) * page_size + last if len(pages) else 0
    return k_pages[pages].flatten(0, 1)[:kv_len], v_pages[pages].flatten(0, 1)[:kv_len]


def fi_prefill_emulated(q, paged_kv_cache, qo_indptr, indptr, indices, last_page_len, causal, sm_scale,
                        window_left=-1, logits_soft_cap=0.0):
    out = torch.zeros_like(q)
    for b in range(len(qo_indptr) - 1):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        keys, vals = fi_pages(paged_kv_cache, indptr, indices, last_page_len, b)
        out[lo:hi] = _attend(q[lo:hi], keys, vals, sm_scale, causal, window_left, logits_soft_cap or 0.0)
    return out


def fi_decode_emulated(q, paged_kv_cache, indptr, indices, last_page_len, sm_scale, window_left=-1,
                       logits_soft_cap=0.0):
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):  # one query per request, which sees the request's whole KV (or its window)
        keys, vals = fi_pages(paged_kv_cache, indptr, indices, last_page_len, b)
        out[b:b + 1] = _attend(q[b:b + 1], keys, vals, sm_scale, False, window_left, logits_soft_cap or 0.0)
    return out


def fa_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, b: int, seqlen_k: int):
    """Request b's first `seqlen_k` keys through flash-attn's block table: key j in block j // page."""
    page = k_cache.shape[1]
    j = torch.arange(max(seqlen_k, 0))
    blocks = block_table[b, j // page].long()
    return k_cache[blocks, j % page], v_cache[blocks, j % page]


def fa2_varlen_emulated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):
    assert block_table is not None, "the paged path needs a block table"
    q_lens, k_lens = torch.diff(cu_seqlens_q), torch.diff(cu_seqlens_k)
    # The kernels size their grids from these bounds; a bound below a real length drops work.
    assert max_seqlen_q >= int(q_lens.max()) and max_seqlen_k >= int(k_lens.max())
    out = torch.zeros_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        keys, vals = fa_keys(k, v, block_table, b, int(k_lens[b]))
        out[lo:hi] = _attend(q[lo:hi], keys, vals, softmax_scale, causal, window_size[0], softcap)
    return out


def fa2_kvcache_emulated(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                         softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    assert k is None and v is None and q.dim() == 4
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        keys, vals = fa_keys(k_cache, v_cache, block_table, b, int(cache_seqlens[b]))
        out[b] = _attend(q[b], keys, vals, softmax_scale, causal, window_size[0], softcap)
    return out


def fa4_varlen_emulated(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                        softcap=0.0):
    assert qv is None and page_table is not None and cu_seqlens_k is None, "FA4: page_table with seqused_k only"
    out = torch.zeros_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        keys, vals = fa_keys(k, v, page_table, b, int(seqused_k[b]))
        left = window_size[0] if window_size[0] is not None else -1
        out[lo:hi] = _attend(q[lo:hi], keys, vals, softmax_scale, causal, left, softcap)
    return out, None  # FA4 returns (out, lse)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a))


# ---------------------------------------------------------------- FlashInfer metadata

@given(mixed_batches())
def test_flashinfer_inputs_describe_each_request(drawn):
    batch, pool = drawn
    fi = flashinfer_plan_inputs(batch)
    assert all(a.dtype == np.int32 for a in fi.values())
    np.testing.assert_array_equal(fi["qo_indptr"], batch.query_start_loc)
    assert fi["paged_kv_indices"].shape[0] == fi["paged_kv_indptr"][-1]
    assert ((fi["paged_kv_last_page_len"] >= 1) & (fi["paged_kv_last_page_len"] <= batch.block_size)).all()
    # Rebuild every request's KV sequence from the CSR description over a pool of distinct
    # values, and compare with a gather through the block table (the torch_ref way).
    bs = batch.block_size
    token_pool = torch.arange(pool * bs, dtype=torch.float32).reshape(pool, bs, 1, 1)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        keys, _ = fi_pages((token_pool, token_pool), t(fi["paged_kv_indptr"]), t(fi["paged_kv_indices"]),
                           t(fi["paged_kv_last_page_len"]), b)
        blocks = torch.as_tensor(batch.block_tables[b, : -(-seq_len // bs)], dtype=torch.long)
        expected = token_pool[blocks].flatten(0, 1)[:seq_len]
        assert torch.equal(keys, expected), f"request {b}: pages or lengths wrong"


@given(problems())
def test_flashinfer_emulated_kernel_matches_torch_ref(p):
    batch = p["batch"]
    fi = {name: t(a) for name, a in flashinfer_plan_inputs(batch).items()}
    want, ref_cache = reference(p)
    cache = written_cache(p)
    assert torch.equal(cache, ref_cache)
    got = fi_prefill_emulated(p["q"], (cache[0], cache[1]), fi["qo_indptr"], fi["paged_kv_indptr"],
                              fi["paged_kv_indices"], fi["paged_kv_last_page_len"], True, p["scale"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if batch.is_pure_decode:
        got = fi_decode_emulated(p["q"], (cache[0], cache[1]), fi["paged_kv_indptr"], fi["paged_kv_indices"],
                                 fi["paged_kv_last_page_len"], p["scale"])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _mutations(fi: dict[str, np.ndarray], batch: ForwardBatch) -> list[tuple[str, dict[str, np.ndarray]]]:
    """Plausible bugs: off-by-one last page lengths, a shifted request boundary, lengths from cached tokens."""
    out = []
    for b in range(batch.num_seqs):
        for delta in (-1, 1):
            m = dict(fi, paged_kv_last_page_len=fi["paged_kv_last_page_len"].copy())
            m["paged_kv_last_page_len"][b] += delta
            out.append((f"last_page_len[{b}] {delta:+d}", m))
    for b in range(1, batch.num_seqs):
        for delta in (-1, 1):
            m = dict(fi, paged_kv_indptr=fi["paged_kv_indptr"].copy())
            m["paged_kv_indptr"][b] += delta
            if (np.diff(m["paged_kv_indptr"]) >= 0).all():
                out.append((f"indptr[{b}] {delta:+d}", m))
    return out


def differs(run, want: torch.Tensor) -> bool:
    """True when the emulated kernel's output differs from `want`, or the emulator rejects its inputs
    (an out-of-range page length or a key past the block table: a real kernel reads garbage there)."""
    try:
        got = run()
    except (AssertionError, IndexError):
        return True
    return not torch.allclose(got, want, atol=ATOL, rtol=0)


@given(problems())
def test_flashinfer_mutated_metadata_is_caught(p):
    """The comparison above has teeth: each plausible metadata bug changes the output."""
    batch = p["batch"]
    fi = flashinfer_plan_inputs(batch)
    want, _ = reference(p)
    cache = written_cache(p)

    def run(m: dict[str, np.ndarray], causal: bool = True) -> torch.Tensor:
        return fi_prefill_emulated(p["q"], (cache[0], cache[1]), t(m["qo_indptr"]), t(m["paged_kv_indptr"]),
                                   t(m["paged_kv_indices"]), t(m["paged_kv_last_page_len"]), causal, p["scale"])

    for what, m in _mutations(fi, batch):
        assert differs(lambda: run(m), want), f"{what} went unnoticed"
    # Forgetting causal=True (FlashInfer's default is False) is caught whenever a chunk has >1 token.
    if batch.max_query_len > 1:
        assert differs(lambda: run(fi, causal=False), want), "causal=False went unnoticed"


# ---------------------------------------------------------------- flash-attn metadata

@given(mixed_batches())
def test_flash_attn_inputs_describe_each_request(drawn):
    batch, _ = drawn
    fa = flash_attn_inputs(batch)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table"):
        assert fa[name].dtype == np.int32 and fa[name].flags.c_contiguous, name
    np.testing.assert_array_equal(fa["cu_seqlens_q"], batch.query_start_loc)
    np.testing.assert_array_equal(np.diff(fa["cu_seqlens_k"]), batch.seq_lens)
    np.testing.assert_array_equal(fa["seqused_k"], batch.seq_lens)
    assert fa["cu_seqlens_k"][0] == 0
    assert fa["max_seqlen_q"] == int(np.diff(batch.query_start_loc).max())
    assert fa["max_seqlen_k"] == int(batch.seq_lens.max())
    # Every key a request may read lies inside the table's width.
    assert fa["block_table"].shape[1] * batch.block_size >= fa["max_seqlen_k"]


@given(problems())
def test_flash_attn_emulated_kernels_match_torch_ref(p):
    batch = p["batch"]
    fa = flash_attn_inputs(batch)
    want, _ = reference(p)
    cache = written_cache(p)
    got = fa2_varlen_emulated(p["q"], cache[0], cache[1], t(fa["cu_seqlens_q"]), t(fa["cu_seqlens_k"]),
                              fa["max_seqlen_q"], fa["max_seqlen_k"], softmax_scale=p["scale"], causal=True,
                              block_table=t(fa["block_table"]))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    got, _ = fa4_varlen_emulated(p["q"], cache[0], cache[1], cu_seqlens_q=t(fa["cu_seqlens_q"]),
                                 max_seqlen_q=fa["max_seqlen_q"], max_seqlen_k=fa["max_seqlen_k"],
                                 seqused_k=t(fa["seqused_k"]), page_table=t(fa["block_table"]),
                                 softmax_scale=p["scale"], causal=True)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if batch.is_pure_decode:
        got = fa2_kvcache_emulated(p["q"].unsqueeze(1), cache[0], cache[1], cache_seqlens=t(fa["seqused_k"]),
                                   block_table=t(fa["block_table"]), softmax_scale=p["scale"], causal=True)
        torch.testing.assert_close(got.squeeze(1), want, atol=ATOL, rtol=0)


@given(problems())
def test_flash_attn_mutated_metadata_is_caught(p):
    batch = p["batch"]
    fa = flash_attn_inputs(batch)
    want, _ = reference(p)
    cache = written_cache(p)

    def run(cu_k: np.ndarray, causal: bool = True) -> torch.Tensor:
        return fa2_varlen_emulated(p["q"], cache[0], cache[1], t(fa["cu_seqlens_q"]), t(cu_k), fa["max_seqlen_q"],
                                   fa["max_seqlen_k"] + 1, softmax_scale=p["scale"], causal=causal,
                                   block_table=t(fa["block_table"]))

    for b in range(1, batch.num_seqs + 1):
        for delta in (-1, 1):
            cu_k = fa["cu_seqlens_k"].copy()
            cu_k[b] += delta
            if (np.diff(cu_k) >= 0).all():
                assert differs(lambda: run(cu_k), want), f"cu_seqlens_k[{b}] {delta:+d} went unnoticed"
    # A classic: cumulative *cached* lengths instead of whole lengths.
    cached_only = np.concatenate([[0], np.cumsum(batch.num_cached)]).astype(np.int32)
    assert differs(lambda: run(cached_only), want), "cached-only lengths went unnoticed"
    if batch.max_query_len > 1:
        assert differs(lambda: run(fa["cu_seqlens_k"], causal=False), want), "causal=False went unnoticed"


# ------------------------------------------- the backends' glue, against fake kernel modules

class _FakeWrapper:
    """Shared checks of a FlashInfer wrapper fake: layout, plan-before-run, dtypes, shapes."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs) -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.planned: dict | None = None

    def _check_csr(self, indptr, indices, last_page_len, page_size) -> None:
        for x in (indptr, indices, last_page_len):
            assert x.dtype == torch.int32 and x.dim() == 1
        assert len(indices) == int(indptr[-1]) and len(last_page_len) == len(indptr) - 1
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()

    def _check_run(self, q, paged_kv_cache) -> None:
        assert self.planned is not None, "run() before plan()"
        k_cache, v_cache = paged_kv_cache
        pl = self.planned
        assert q.dtype == pl["q_data_type"] and k_cache.dtype == pl["kv_data_type"]
        assert q.shape[1:] == (pl["num_qo_heads"], pl["head_dim"])
        assert k_cache.shape[1:] == v_cache.shape[1:] == (pl["page_size"], pl["num_kv_heads"], pl["head_dim"])


class FakePrefillWrapper(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, window_left=-1, logits_soft_cap=None, **kwargs) -> None:
        self._check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
        type(self).plans += 1
        self.planned = dict(qo_indptr=qo_indptr, indptr=paged_kv_indptr, indices=paged_kv_indices,
                            last=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim_qk, page_size=page_size, causal=causal, sm_scale=sm_scale,
                            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type,
                            window_left=window_left, logits_soft_cap=logits_soft_cap)

    def run(self, q, paged_kv_cache):
        self._check_run(q, paged_kv_cache)
        pl = self.planned
        return fi_prefill_emulated(q, paged_kv_cache, pl["qo_indptr"], pl["indptr"], pl["indices"], pl["last"],
                                   pl["causal"], pl["sm_scale"], pl["window_left"], pl["logits_soft_cap"])


class FakeDecodeWrapper(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             sm_scale=None, q_data_type="float16", kv_data_type=None, window_left=-1, logits_soft_cap=None,
             **kwargs) -> None:
        self._check_csr(indptr, indices, last_page_len, page_size)
        type(self).plans += 1
        self.planned = dict(indptr=indptr, indices=indices, last=last_page_len, num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, sm_scale=sm_scale,
                            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type,
                            window_left=window_left, logits_soft_cap=logits_soft_cap)

    def run(self, q, paged_kv_cache):
        self._check_run(q, paged_kv_cache)
        assert q.shape[0] == len(self.planned["indptr"]) - 1, "decode run: one query per request"
        pl = self.planned
        return fi_decode_emulated(q, paged_kv_cache, pl["indptr"], pl["indices"], pl["last"], pl["sm_scale"],
                                  pl["window_left"], pl["logits_soft_cap"])


def _fake_module(name: str) -> types.ModuleType:
    # A spec, so that code probing for the package (transformers does) does not trip over it.
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def install_fake_flashinfer(mp: pytest.MonkeyPatch) -> None:
    mod = _fake_module("flashinfer")
    FakePrefillWrapper.plans = FakeDecodeWrapper.plans = 0
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    mp.setitem(sys.modules, "flashinfer", mod)


def install_fake_flash_attn(mp: pytest.MonkeyPatch) -> list[str]:
    """Fake `flash_attn` (2.x API) and `flash_attn.cute` (FA4 API); returns the log of calls."""
    calls: list[str] = []

    def varlen(*args, **kwargs):
        calls.append("varlen")
        assert kwargs.get("causal") is True
        return fa2_varlen_emulated(*args, **kwargs)

    def with_kvcache(*args, **kwargs):
        calls.append("with_kvcache")
        assert kwargs.get("causal") is True
        return fa2_kvcache_emulated(*args, **kwargs)

    def fa4(*args, **kwargs):
        calls.append("fa4")
        assert kwargs.get("causal") is True
        return fa4_varlen_emulated(*args, **kwargs)

    pkg = _fake_module("flash_attn")
    pkg.flash_attn_varlen_func, pkg.flash_attn_with_kvcache = varlen, with_kvcache
    cute = _fake_module("flash_attn.cute")
    cute.flash_attn_varlen_func = fa4
    pkg.cute = cute
    mp.setitem(sys.modules, "flash_attn", pkg)
    mp.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


def bound_flashinfer(mp: pytest.MonkeyPatch, p: dict, layers=()) -> FlashInferBackend:
    """A FlashInferBackend bound to the problem's shapes, here on the CPU: its device and dtype
    check (CUDA, fp16/bf16) is set aside, as the fake kernels run anywhere."""
    mp.setattr(FlashInferBackend, "check", lambda self, device, dtype, block_size: None)
    backend = FlashInferBackend(workspace_bytes=64)
    backend.bind(p["q"].shape[1], p["k"].shape[1], p["q"].shape[2], p["q"].dtype, p["batch"].block_size, "cpu",
                 layers)
    return backend


def _run_layers(backend, p: dict, layers: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """prepare once, then forward through `layers` layers, each with its own cache (as the runner does)."""
    meta = backend.prepare(p["batch"], "cpu")
    results = []
    for layer in range(layers):
        cache = p["cache"].clone()
        out = backend.forward(p["q"] * (layer + 1), p["k"], p["v"], cache, meta, p["scale"])
        results.append((out, cache))
    return results


@given(p=problems())
def test_flashinfer_backend_glue(p):
    with pytest.MonkeyPatch.context() as mp:
        install_fake_flashinfer(mp)
        backend = bound_flashinfer(mp, p)
        ref = TorchRefBackend()
        for layer, (out, cache) in enumerate(_run_layers(backend, p)):
            ref_cache = p["cache"].clone()
            want = ref.forward(p["q"] * (layer + 1), p["k"], p["v"], ref_cache, ref.prepare(p["batch"], "cpu"),
                               p["scale"])
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
            assert torch.equal(cache, ref_cache)
        decode = p["batch"].is_pure_decode
        assert (FakeDecodeWrapper.plans, FakePrefillWrapper.plans) == ((1, 0) if decode else (0, 1)), \
            "plan once per step, with the decode wrapper exactly for pure-decode steps"
        _run_layers(backend, p, layers=1)  # the next step plans again
        assert FakeDecodeWrapper.plans + FakePrefillWrapper.plans == 2


@pytest.mark.parametrize("version", ["2", "4"])
@given(p=problems())
def test_flash_attn_backend_glue(version, p):
    with pytest.MonkeyPatch.context() as mp:
        calls = install_fake_flash_attn(mp)
        backend = FlashAttnBackend(version=version)
        ref = TorchRefBackend()
        for layer, (out, cache) in enumerate(_run_layers(backend, p)):
            ref_cache = p["cache"].clone()
            want = ref.forward(p["q"] * (layer + 1), p["k"], p["v"], ref_cache, ref.prepare(p["batch"], "cpu"),
                               p["scale"])
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
            assert torch.equal(cache, ref_cache)
        expected = "fa4" if version == "4" else ("with_kvcache" if p["batch"].is_pure_decode else "varlen")
        assert calls == [expected] * 3
        assert backend.kernel_version == version


def test_flash_attn_auto_prefers_2_then_4(monkeypatch):
    install_fake_flash_attn(monkeypatch)
    assert FlashAttnBackend().kernel_version == "2"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # FA4 wheels ship no 2.x API
    assert FlashAttnBackend().kernel_version == "4"


# ------------------------------------------- optional features: sliding window, logit soft-cap

windows = st.one_of(st.none(), st.integers(1, 12))
softcaps = st.one_of(st.none(), st.floats(0.5, 4.0))


def test_feature_args_follow_each_librarys_convention():
    # transformers' window W (keys p-W+1..p) is an inclusive left bound of W - 1 in both libraries.
    spec = LayerAttention(0.5, sliding_window=8, softcap=30.0)
    assert flash_attn_feature_args(spec) == {"window_size": (7, 0), "softcap": 30.0}
    assert flash_attn_feature_args(spec, "4") == {"window_size": (7, 0), "softcap": 30.0}
    assert flashinfer_feature_args(spec) == {"window_left": 7, "logits_soft_cap": 30.0}
    plain = LayerAttention(0.5)
    assert flash_attn_feature_args(plain) == flashinfer_feature_args(plain) == flashinfer_feature_args(None) == {}


@given(p=problems(), window=windows, softcap=softcaps)
def test_gpu_backends_glue_with_features(p, window, softcap):
    """Through the fake kernels (the documented semantics), a windowed / soft-capped layer gives
    torch_ref's result; a window one key too wide is caught."""
    spec = LayerAttention(p["scale"], sliding_window=window, softcap=softcap)
    ref = TorchRefBackend()
    ref_cache = p["cache"].clone()
    want = ref.forward(p["q"], p["k"], p["v"], ref_cache, ref.prepare(p["batch"], "cpu"), p["scale"], layer=spec)
    with pytest.MonkeyPatch.context() as mp:
        install_fake_flashinfer(mp)
        install_fake_flash_attn(mp)
        for backend in (bound_flashinfer(mp, p, [spec]), FlashAttnBackend(version="2"),
                        FlashAttnBackend(version="4")):
            cache = p["cache"].clone()
            out = backend.forward(p["q"], p["k"], p["v"], cache, backend.prepare(p["batch"], "cpu"), p["scale"],
                                  layer=spec)
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=lambda m: f"{backend.name}: {m}")
            assert torch.equal(cache, ref_cache)
    if window is not None and int(p["batch"].seq_lens.max()) > window:
        fa = flash_attn_inputs(p["batch"])
        cache = written_cache(p)
        assert differs(lambda: fa2_varlen_emulated(
            p["q"], cache[0], cache[1], t(fa["cu_seqlens_q"]), t(fa["cu_seqlens_k"]), fa["max_seqlen_q"],
            fa["max_seqlen_k"], softmax_scale=p["scale"], causal=True, window_size=(window, 0),
            softcap=softcap or 0.0, block_table=t(fa["block_table"])), want), "window_size=(W, 0) went unnoticed"


@given(p=problems())
def test_flashinfer_plans_once_per_kind_of_layer(p):
    """Alternating windowed and full layers (Gemma 2/3, gpt-oss): one wrapper per kind, each
    planned once per step, each layer's output right."""
    kinds = [LayerAttention(p["scale"], sliding_window=3), LayerAttention(p["scale"])]
    with pytest.MonkeyPatch.context() as mp:
        install_fake_flashinfer(mp)
        backend, ref = bound_flashinfer(mp, p, kinds * 2), TorchRefBackend()
        meta, ref_meta = backend.prepare(p["batch"], "cpu"), ref.prepare(p["batch"], "cpu")
        assert FakeDecodeWrapper.plans + FakePrefillWrapper.plans == 2, "prepare plans each kind of layer"
        for layer in range(4):
            spec = kinds[layer % 2]
            args = (p["q"] * (layer + 1), p["k"], p["v"])
            out = backend.forward(*args, p["cache"].clone(), meta, p["scale"], layer=spec)
            want = ref.forward(*args, p["cache"].clone(), ref_meta, p["scale"], layer=spec)
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
        assert FakeDecodeWrapper.plans + FakePrefillWrapper.plans == 2


@given(batch_pool=mixed_batches(), decode=st.booleans())
def test_flashinfer_plan_arguments(batch_pool, decode):
    """What prepare hands each wrapper's plan(), built on the host without FlashInfer: the page
    table, the shapes bind gave, the layer kind's scale and features, causal=True for prefill."""
    batch, _ = batch_pool
    kinds = {layer_kind(None, 0.25), layer_kind(LayerAttention(0.5, sliding_window=4, softcap=30.0), 0.5)}
    plans = flashinfer_plans(batch, kinds, 8, 2, 16, torch.bfloat16, decode)
    assert set(plans) == kinds
    fi = flashinfer_plan_inputs(batch)
    pages = [fi["paged_kv_indptr"], fi["paged_kv_indices"], fi["paged_kv_last_page_len"]]
    for (features, scale), (args, kwargs) in plans.items():
        host = ([] if decode else [fi["qo_indptr"]]) + pages
        assert all(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args[:len(host)])
        assert [a.numpy().tolist() for a in args[:len(host)]] == [a.tolist() for a in host]
        assert args[len(host):] == (8, 2, 16, batch.block_size)
        want = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale, **dict(features))
        assert kwargs == (want if decode else {"causal": True, **want})
    assert plans[layer_kind(LayerAttention(0.5, sliding_window=4, softcap=30.0), 0.5)][1]["window_left"] == 3


@given(p=problems())
def test_flashinfer_plans_in_prepare_for_the_layers_bind_named(p):
    with pytest.MonkeyPatch.context() as mp:
        install_fake_flashinfer(mp)
        with pytest.raises(RuntimeError, match="bind"):
            FlashInferBackend().prepare(p["batch"], "cpu")
        backend = bound_flashinfer(mp, p, [LayerAttention(p["scale"])] * 3)
        meta = backend.prepare(p["batch"], "cpu")
        assert FakeDecodeWrapper.plans + FakePrefillWrapper.plans == 1  # before any layer runs
        with pytest.raises(ValueError, match="bind.* was not told of"):  # never planned at a layer
            backend.forward(p["q"], p["k"], p["v"], p["cache"].clone(), meta, p["scale"],
                            layer=LayerAttention(p["scale"], softcap=5.0))
        backend.forward(p["q"], p["k"], p["v"], p["cache"].clone(), meta, p["scale"])
        assert FakeDecodeWrapper.plans + FakePrefillWrapper.plans == 1


# ----------------------------------------------------------- settings and availability errors

def test_flash_attn_rejects_block_size_16_on_any_machine():
    with pytest.raises(ValueError, match="multiple of 256"):
        registry.build("backend", "flash_attn").check("cuda", torch.float16, 16)
    with pytest.raises(ValueError, match="float16"):
        registry.build("backend", "flash_attn").check("cuda", torch.float32, 256)
    with pytest.raises(ValueError, match="float16"):
        registry.build("backend", "flashinfer").check("cuda", torch.float32, 16)
    with pytest.raises(ValueError, match="runs on cuda"):
        registry.build("backend", "flashinfer").check("cpu", torch.float16, 16)


INSTALL = {"flash_attn": 'pip install -e ".[flash-attn]"', "flashinfer": 'pip install -e ".[flashinfer]"'}
BLOCK = {"flash_attn": 256, "flashinfer": 3}


def _assert_one_line(err: BackendUnavailable, name: str, *words: str) -> None:
    msg = str(err)
    assert "\n" not in msg and INSTALL[name] in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
def test_no_cuda_says_so_in_one_line(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as info:
        registry.build("backend", name).check("cuda", torch.bfloat16, BLOCK[name])
    _assert_one_line(info.value, name, "GPU")


@pytest.mark.parametrize("name,modules,words", [
    ("flash_attn", ["flash_attn", "flash_attn.cute"], ["flash-attn"]),
    ("flashinfer", ["flashinfer"], ["flashinfer-python"]),
])
def test_missing_package_says_so_in_one_line(name, modules, words, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # makes `import m` raise ImportError
    with pytest.raises(BackendUnavailable) as info:
        registry.build("backend", name).check("cuda", torch.float16, BLOCK[name])
    _assert_one_line(info.value, name, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
def test_this_machine_without_cuda(name):
    with pytest.raises(BackendUnavailable) as info:
        registry.build("backend", name).check("cuda", torch.float16, BLOCK[name])
    _assert_one_line(info.value, name)


def test_importing_backends_does_not_import_kernel_libraries():
    code = ("import sys, backends, backends.flash_attn, backends.flashinfer, backends.triton_paged; "
            "bad = [m for m in ('flash_attn', 'flashinfer', 'triton') if m in sys.modules]; "
            "sys.exit(f'imported at module import: {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)
