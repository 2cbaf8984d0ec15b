"""torch_paged: the in-place C kernel against torch_ref on random mixed batches, its dtypes, its
fallback when the kernel cannot be built, and that importing it builds nothing.

(The model-level properties, mixed batches against HF per request and batch invariance, are
tests/engine/test_equivalence.py and tests/engine/test_batch_invariance.py, parametrised over every backend.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import backends.torch_paged as tp
from varlen import registry
from backends.torch_ref import TorchRefBackend
from varlen.batch import SeqSlice, build_batch
from varlen.testing.attention import ATOL, reference
from varlen.testing.strategies import mixed_batches, problems


def run_paged(p: dict, q: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
    """Forward through torch_paged on p's cache (converted to the backend's layout and back)."""
    backend = registry.build("backend", "torch_paged")
    kernel_layout = backend.uses_kernel and dtype != torch.float16
    cache = tp.from_nhd(p["cache"].to(dtype)) if kernel_layout else p["cache"].to(dtype).clone()
    q = p["q"] if q is None else q
    out = backend.forward(q.to(dtype), p["k"].to(dtype), p["v"].to(dtype), cache,
                          backend.prepare(p["batch"], "cpu"), p["scale"])
    return out, tp.to_nhd(cache) if kernel_layout else cache


def test_layout_round_trip():
    nhd = torch.randn(2, 5, 3, 2, 4)
    paged = tp.from_nhd(nhd)
    assert paged.shape == (2, 5, 2, 3, 4) and paged.is_contiguous()
    assert torch.equal(tp.to_nhd(paged), nhd)
    # K tiles are transposed: block 1, head 0 holds [D, block_size].
    assert torch.equal(paged[0, 1, 0].reshape(4, 3), nhd[0, 1, :, 0].T)


def test_the_kernel_builds_here():
    """CI has a C compiler: the fast path, not the fallback, is what the other tests exercise."""
    assert registry.build("backend", "torch_paged").uses_kernel


@given(problems())
def test_kernel_matches_torch_ref(p):
    want, want_cache = reference(p)
    got, cache = run_paged(p)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(cache, want_cache)


@given(problems())
def test_sdpa_path_for_long_requests_matches_torch_ref(p):
    """With the threshold lowered, most requests of these small batches take the SDPA path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp, "LONG_SDPA_MIN", 3)
        want, want_cache = reference(p)
        got, cache = run_paged(p)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(cache, want_cache)


@given(problems())
def test_kernel_reads_strided_queries(p):
    """The model hands q as a transposed view of [1, H, N, D]; no copy is made for it."""
    n, h, d = p["q"].shape
    q = torch.empty(h, n, d).transpose(0, 1).copy_(p["q"])
    assert q.stride() == (d, n * d, 1)
    got, _ = run_paged(p, q)
    torch.testing.assert_close(got, reference(p)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("head_dim,group,block_size", [(64, 2, 16), (128, 4, 16), (64, 1, 32), (80, 8, 5)])
def test_model_sized_heads_and_long_contexts(head_dim, group, block_size):
    """Real head sizes, contexts of hundreds of keys, chunks spanning several query tiles."""
    rng = np.random.default_rng(head_dim + group)
    # (cached, new): long ones go to SDPA (fresh, and a chunk gathering its context), the rest to the kernel
    shapes = [(0, 70), (300, 1), (513, 1), (200, 37), (0, 1), (40, 17), (150, 90)]
    seqs, at = [], 0
    for i, (cached, new) in enumerate(shapes):
        nblk = -(-(cached + new) // block_size)
        seqs.append(SeqSlice(list(range(3, 3 + new)), cached, list(range(at, at + nblk)), req_id=i))
        at += nblk
    perm = rng.permutation(at)
    for s in seqs:
        s.block_table = [int(perm[b]) for b in s.block_table]
    batch = build_batch(seqs, block_size, at)
    gen = torch.Generator().manual_seed(0)
    hkv, n = 2, batch.num_tokens
    p = dict(batch=batch, cache=torch.randn(2, at, block_size, hkv, head_dim, generator=gen),
             q=torch.randn(n, hkv * group, head_dim, generator=gen) * 3, k=torch.randn(n, hkv, head_dim, generator=gen),
             v=torch.randn(n, hkv, head_dim, generator=gen), scale=head_dim ** -0.5)
    torch.testing.assert_close(run_paged(p)[0], reference(p)[0], atol=ATOL, rtol=0)


@given(problems())
def test_bf16_matches_torch_ref_on_the_same_rounded_inputs(p):
    rounded = {k: (v.to(torch.bfloat16).float() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    want, _ = reference(rounded)
    got, _ = run_paged(p, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@given(problems())
def test_fp16_runs_the_fallback_correctly(p):
    rounded = {k: (v.half().float() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    got, _ = run_paged(p, dtype=torch.float16)
    torch.testing.assert_close(got.float(), reference(rounded)[0], atol=2e-3, rtol=2e-3)


@given(mixed_batches())
def test_work_units_tile_every_query_row_once(drawn):
    batch, _ = drawn
    units = tp.work_units(batch, tile=4)
    rows = np.zeros(batch.num_tokens, dtype=int)
    for seq, first, end in units:
        assert 0 <= first < end <= first + 4
        rows[batch.query_start_loc[seq] + first: batch.query_start_loc[seq] + end] += 1
    assert (rows == 1).all()


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_decode_units_are_work_units_of_a_decode_step(seq_lens):
    """prepare's pure-decode shortcut gives the kernel the units work_units would, in the same order
    (ties included), whatever the tile."""
    from varlen.batch import build_batch, SeqSlice

    batch = build_batch([SeqSlice([1], n - 1, list(range(n))) for n in seq_lens], 1)
    for tile in (1, 4):
        assert tp.decode_units(batch.seq_lens).tolist() == tp.work_units(batch, tile).tolist()


@pytest.fixture
def no_kernel(monkeypatch):
    """A machine whose C compiler fails: the module's cached state is reset around the test."""
    monkeypatch.setattr(tp, "_kernel", None)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("VARLEN_CACHE_DIR", str(os.environ.get("TMPDIR", "/tmp")) + "/varlen-no-kernel-test")
    yield
    monkeypatch.setattr(tp, "_kernel", None)


# One example: the warning is said once per process, and the fixture resets it per test, not per example.
@settings(max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_build_failure_warns_once_and_falls_back_correctly(no_kernel, p):
    with pytest.warns(RuntimeWarning, match="C kernel is unavailable.*torch_sdpa's .*torch_ref's for soft-capping"):
        got, cache = run_paged(p)
    want, want_cache = reference(p)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(cache, want_cache)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        run_paged(p)  # no second warning
    assert not registry.build("backend", "torch_paged").uses_kernel


@settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(), window=st.one_of(st.none(), st.integers(1, 6)), sinks=st.booleans())
def test_without_the_kernel_soft_caps_and_sinks_run_torch_refs_code(no_kernel, p, window, sinks):
    """The fallback is bound to the model: torch_sdpa's code for windows, torch_ref's where SDPA
    has no soft-cap or sinks (never a silently plain softmax)."""
    from varlen.attention_api import LayerAttention

    hq, hkv, d = p["q"].shape[1], *p["k"].shape[1:]
    spec = LayerAttention(p["scale"], sliding_window=window, softcap=2.0,
                          sinks=torch.linspace(-1.0, 1.0, hq) if sinks else None)
    backend = registry.build("backend", "torch_paged")
    backend.bind(hq, hkv, d, torch.float32, p["batch"].block_size, "cpu", [spec])
    with __import__("warnings").catch_warnings():  # said once per process (the test above checks it)
        __import__("warnings").simplefilter("ignore", RuntimeWarning)
        cache = backend.allocate_kv_cache(1, p["cache"].shape[1], p["batch"].block_size, hkv, d, torch.float32, "cpu")[0]
    assert not backend.uses_kernel
    cache.copy_(p["cache"])
    got = backend.forward(p["q"], p["k"], p["v"], cache, backend.prepare(p["batch"], "cpu"), p["scale"], layer=spec)
    ref = TorchRefBackend()
    want = ref.forward(p["q"], p["k"], p["v"], p["cache"].clone(), ref.prepare(p["batch"], "cpu"), p["scale"], layer=spec)
    assert type(backend._fallback()).__name__ == "TorchRefBackend"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_build_error_names_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no working C compiler.*no-such-cc"):
        tp.build()


def test_build_is_cached(monkeypatch, tmp_path, unoptimised_cc):
    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", unoptimised_cc)  # what is kept and found again, not how fast it runs
    first = tp.build()
    stamp = first.stat().st_mtime_ns
    assert tp.build() == first and first.stat().st_mtime_ns == stamp
    assert first.parent.name.startswith("paged-attn-") and first.parent.parent == tmp_path


def test_importing_and_checking_builds_nothing(tmp_path):
    code = ("import backends, backends.torch_paged as tp, torch; from varlen import registry; "
            "b = registry.build('backend', 'torch_paged'); "
            "b.check('cpu', torch.float32, 16); backends.usable_backends('cpu', torch.float32); "
            "import sys; sys.exit('built at import' if tp._kernel is not None else 0)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "VARLEN_CACHE_DIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


def test_refuses_cuda():
    with pytest.raises(ValueError, match="runs on cpu"):
        registry.build("backend", "torch_paged").check("cuda", torch.float32, 16)


def test_same_rows_bitwise_whatever_else_is_in_the_batch():
    """The kernel alone (the model's GEMMs aside) is batch-invariant: a request's rows are bitwise
    the same with and without other requests around it, in any order."""
    gen = torch.Generator().manual_seed(1)
    hkv, group, d, bs = 2, 3, 64, 16
    cache = torch.randn(2, 64, bs, hkv, d, generator=gen)
    target = SeqSlice(list(range(20)), 45, list(range(0, 5)))
    others = [SeqSlice([1], 200, list(range(5, 18))), SeqSlice(list(range(33)), 0, list(range(18, 21)))]
    q_t = torch.randn(20, hkv * group, d, generator=gen)
    kv_t = torch.randn(2, 20, hkv, d, generator=gen)
    backend = registry.build("backend", "torch_paged")

    def rows(seqs, where):
        batch = build_batch(seqs, bs, 64)
        n = batch.num_tokens
        q, k, v = torch.randn(n, hkv * group, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        lo = int(batch.query_start_loc[where])
        q[lo:lo + 20], k[lo:lo + 20], v[lo:lo + 20] = q_t, kv_t[0], kv_t[1]
        paged = tp.from_nhd(cache)
        return backend.forward(q, k, v, paged, backend.prepare(batch, "cpu"), d ** -0.5)[lo:lo + 20]

    alone = rows([target], 0)
    assert torch.equal(rows([others[0], target, others[1]], 1), alone)
    assert torch.equal(rows([*others, target], 2), alone)
    ref = TorchRefBackend()
    b = build_batch([target], bs, 64)
    c = cache.clone()
    torch.testing.assert_close(alone, ref.forward(q_t, kv_t[0], kv_t[1], c, ref.prepare(b, "cpu"), d ** -0.5),
                               atol=ATOL, rtol=0)


@given(problems())
def test_threads_change_nothing(p):
    """OpenMP splits the units over threads; each row is still one thread's fixed-order work."""
    one, _ = run_paged(p)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # more threads than units, sometimes: idle threads must not matter
    try:
        three, _ = run_paged(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_heads_sharing_a_kv_head_get_the_same_bits_as_heads_that_do_not(head_dim):
    """The kernel processes the query heads of one KV head together (each K/V load serves both):
    every head's output is bitwise what it is when its KV head serves it alone (the same K/V
    duplicated per query head), on decodes, a prefill tile and partial blocks."""
    gen = torch.Generator().manual_seed(head_dim)
    hkv, group, bs = 2, 2, 16
    seqs = [SeqSlice([1], 36, [0, 1, 2]), SeqSlice(list(range(5)), 55, [3, 4, 5, 6]), SeqSlice([2], 15, [7])]
    batch = build_batch(seqs, bs, 8)
    n, d = batch.num_tokens, head_dim
    cache = torch.randn(2, 8, bs, hkv, d, generator=gen)
    q, k, v = torch.randn(n, hkv * group, d, generator=gen), torch.randn(n, hkv, d, generator=gen), \
        torch.randn(n, hkv, d, generator=gen)
    backend = registry.build("backend", "torch_paged")

    def forward(cache, k, v):
        return backend.forward(q, k, v, tp.from_nhd(cache), backend.prepare(batch, "cpu"), d ** -0.5)

    shared = forward(cache, k, v)
    alone = forward(cache.repeat_interleave(group, dim=3), k.repeat_interleave(group, dim=1),
                    v.repeat_interleave(group, dim=1))
    assert torch.equal(shared, alone)
    p = dict(batch=batch, cache=cache, q=q, k=k, v=v, scale=d ** -0.5)
    torch.testing.assert_close(shared, reference(p)[0], atol=ATOL, rtol=0)
