"""GPU backends against the torch reference, on the GPU, in fp16 and bf16.

Every test here is marked `gpu` and skips, giving the one-line reason from the backend's own
`check()` (what is missing and the install command), on machines without CUDA or without the
kernel library. Run them with `pytest -m gpu` (or `bash scripts/gpu_check.sh` on a lent GPU).

The oracle is `TorchRefBackend` on the same device, dtype and inputs. It computes in fp32 and
rounds once, so differences come from the kernels' reduced-precision internals (P rounded to
fp16/bf16 before P@V, online-softmax rescaling). With q/k/v ~ N(0, 1) attention outputs are
convex mixtures of V rows, |out| <~ 3, and we allow:

    fp16: atol 1e-2     bf16: atol 2e-2     (rtol 0)

for single attention calls, and a relative bound on logits for the whole tiny model (below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from varlen import registry
from varlen.attention_api import BackendUnavailable
from backends.torch_ref import TorchRefBackend
from varlen.batch import ForwardBatch, SeqSlice, build_batch
from varlen.testing.equivalence import GPU_BLOCK_SIZES

pytestmark = pytest.mark.gpu

ATOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
BLOCK_SIZES = GPU_BLOCK_SIZES
GPU_BACKENDS = list(BLOCK_SIZES)
# One head layout (GQA 4, head dim 128: what Llama-3-8B uses) keeps the number of kernel
# variants that FlashInfer's and CuTe DSL's JIT compilers build on a fresh machine small.
HQ, HKV, D = 8, 2, 128


def _unavailable(name: str) -> str | None:
    try:
        registry.build("backend", name).check("cuda", torch.bfloat16, BLOCK_SIZES[name][0])
    except BackendUnavailable as err:
        return str(err)
    return None


_REASONS = {name: _unavailable(name) for name in GPU_BACKENDS}
BACKENDS = [pytest.param(name, id=name, marks=pytest.mark.skipif(_REASONS[name] is not None,
                                                                  reason=_REASONS[name] or ""))
            for name in GPU_BACKENDS]


@st.composite
def gpu_steps(draw, block_sizes: list[int]) -> tuple[ForwardBatch, int]:
    """One step over 1-12 requests: fresh prefills, later chunks and decodes, long enough to span
    several 256-token pages; sometimes a pure-decode step (all requests bring one token)."""
    block_size = draw(st.sampled_from(block_sizes), label="block_size")
    n = draw(st.integers(1, 12), label="num_requests")
    pure_decode = draw(st.booleans(), label="pure_decode")
    shapes = []
    for _ in range(n):
        kind = "decode" if pure_decode else draw(st.sampled_from(["prefill", "chunk", "decode"]))
        cached = 0 if kind == "prefill" else draw(st.integers(1, 900))
        new = 1 if kind == "decode" else draw(st.integers(1, 400))
        shapes.append((cached, new, -(-(cached + new) // block_size) + draw(st.integers(0, 1))))
    pool = sum(s[2] for s in shapes) + draw(st.integers(0, 4))
    # Shuffled with numpy from a drawn seed: pools reach ~15k blocks at block size 1, too many
    # for hypothesis to draw element by element.
    perm = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="perm_seed")).permutation(pool)
    seqs, at = [], 0
    for i, (cached, new, nblk) in enumerate(shapes):
        seqs.append(SeqSlice(np.arange(new) + 3, cached, perm[at:at + nblk], req_id=i))
        at += nblk
    return build_batch(seqs, block_size, pool), pool


def _compare_one_step(name: str, dtype: torch.dtype, batch: ForwardBatch, pool: int, seed: int) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    n = batch.num_tokens
    cache = torch.randn(2, pool, batch.block_size, HKV, D, generator=gen, device=dev).to(dtype)
    q = torch.randn(n, HQ, D, generator=gen, device=dev).to(dtype)
    k = torch.randn(n, HKV, D, generator=gen, device=dev).to(dtype)
    v = torch.randn(n, HKV, D, generator=gen, device=dev).to(dtype)
    backend, ref = registry.build("backend", name), TorchRefBackend()
    backend.bind(HQ, HKV, D, dtype, batch.block_size, dev)  # checks, and FlashInfer learns what to plan
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = backend.forward(q, k, v, got_cache, backend.prepare(batch, dev), D ** -0.5)
    want = ref.forward(q, k, v, ref_cache, ref.prepare(batch, dev), D ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(got_cache, ref_cache), "the backend wrote the new K/V somewhere else"
    err = (got.float() - want.float()).abs().max().item()
    kinds = "pure decode" if batch.is_pure_decode else f"max query len {batch.max_query_len}"
    assert err <= ATOL[dtype], (f"{name} {dtype}: max abs error {err:.3e} > {ATOL[dtype]} "
                                f"(block size {batch.block_size}, {batch.num_seqs} requests, {kinds})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
@given(data=st.data())
def test_one_step_matches_torch_ref(name, dtype, data):
    batch, pool = data.draw(gpu_steps(BLOCK_SIZES[name]))
    _compare_one_step(name, dtype, batch, pool, data.draw(st.integers(0, 2**31 - 1), label="seed"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_request_lifecycles_match_torch_ref(name, dtype):
    """Requests live through several steps on the backend's own cache: a chunked prefill beside a
    whole one, decodes joining mid-way, a pure-decode step, then a late prefill with decodes."""
    dev = torch.device("cuda")
    bs = BLOCK_SIZES[name][0]
    gen = torch.Generator(device=dev).manual_seed(0)
    lengths = [700, 300, 40, 5]
    blocks_needed = [-(-(n + 8) // bs) for n in lengths]
    pool = sum(blocks_needed) + 3
    perm = np.random.default_rng(0).permutation(pool)
    tables, at = [], 0
    for need in blocks_needed:
        tables.append(perm[at:at + need].tolist())
        at += need
    # (request, new tokens) per step; a request's steps run in order.
    steps = [
        [(0, 256), (1, 300)],
        [(0, 300), (1, 1), (2, 40)],
        [(0, 144), (1, 1), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],  # pure decode
        [(3, 5), (0, 1), (1, 1), (2, 1)],
        [(3, 1), (0, 1), (1, 1), (2, 1)],  # pure decode again, with the late request
    ]
    backend, ref = registry.build("backend", name), TorchRefBackend()
    backend.bind(HQ, HKV, D, dtype, bs, dev)
    cache = torch.zeros(2, pool, bs, HKV, D, dtype=dtype, device=dev)
    got_cache, ref_cache = cache.clone(), cache.clone()
    done = [0] * len(lengths)
    for s, step in enumerate(steps):
        seqs = [SeqSlice(np.arange(n) + 3, done[r], tables[r], req_id=r) for r, n in step]
        batch = build_batch(seqs, bs, pool)
        n = batch.num_tokens
        q = torch.randn(n, HQ, D, generator=gen, device=dev).to(dtype)
        k = torch.randn(n, HKV, D, generator=gen, device=dev).to(dtype)
        v = torch.randn(n, HKV, D, generator=gen, device=dev).to(dtype)
        got = backend.forward(q, k, v, got_cache, backend.prepare(batch, dev), D ** -0.5)
        want = ref.forward(q, k, v, ref_cache, ref.prepare(batch, dev), D ** -0.5)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= ATOL[dtype], f"step {s}: max abs error {err:.3e} > {ATOL[dtype]}"
        for r, k_new in step:
            done[r] += k_new
    assert torch.equal(got_cache, ref_cache)


# Logits after two layers carry the attention error through norms and MLPs; compare relative to
# the logits' scale. bf16 has 8 mantissa bits, so a few percent is its honest resolution.
LOGIT_RTOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3 with head dim 128 and GQA 4: shapes every GPU kernel library instantiates, and
    the same head layout as the tests above, so no extra JIT compiles."""
    from varlen.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("gpu_model") / "qwen3", "qwen3", head_dim=128,
                                num_key_value_heads=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_model_logits_match_torch_ref(name, dtype, gpu_model_dir):
    """The whole path: HF model → registered varlen attention → backend, against torch_ref."""
    from varlen.model_runner import ModelRunner

    bs = BLOCK_SIZES[name][0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (300, 20, 1)]
    tables = [[0, 1], [2], [3]]
    pool = 4 if bs >= 256 else sum(-(-(len(p) + 4) // bs) for p in prompts)
    if bs < 256:
        perm = rng.permutation(pool).tolist()
        tables, at = [], 0
        for p in prompts:
            need = -(-(len(p) + 4) // bs)
            tables.append(perm[at:at + need])
            at += need
    runners = {b: ModelRunner(gpu_model_dir, registry.build("backend", b), bs, pool, dtype=dtype, device="cuda")
               for b in (name, "torch_ref")}
    # Step 1: request 0 as a chunk of 200, requests 1-2 whole; step 2: the rest of request 0 with
    # decodes; step 3: a pure-decode step.
    plan = [
        [(0, 0, 200), (1, 0, 20), (2, 0, 1)],
        [(0, 200, 100), (1, 20, 1), (2, 1, 1)],
        [(0, 300, 1), (1, 21, 1), (2, 2, 1)],
    ]
    extra = rng.integers(3, 250, size=(3, 4)).tolist()
    tokens = [p + e for p, e in zip(prompts, extra)]
    for step in plan:
        seqs = [SeqSlice(tokens[r][lo:lo + n], lo, tables[r], req_id=r) for r, lo, n in step]
        batch = build_batch(seqs, bs, pool)
        got = runners[name].execute(batch).float()
        want = runners["torch_ref"].execute(batch).float()
        scale = want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= LOGIT_RTOL[dtype] * max(scale, 1.0), \
            f"{name} {dtype}: logits differ by {err:.3e} (scale {scale:.2f})"
