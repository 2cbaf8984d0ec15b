"""The Triton backend's kernels, proved on CPU in Triton's interpreter, against the torch reference.

Triton makes every `@triton.jit` function interpreted or compiled when triton is first imported,
from TRITON_INTERPRET (see backends/triton_paged.py), so on a machine without CUDA this module sets
it before anything imports triton (nothing does at collection: `import backends` never imports
it). On a GPU machine it is left alone, the interpreter tests skip saying so, and
tests/backends/test_gpu_backends.py runs the compiled kernels. Without the triton package they skip with
the install command; anything else that keeps the interpreter from running fails them.

The interpreter runs each program of the grid in Python (~25 ms each here), so shapes are tiny.
The same kernel covers prefills, chunks and decodes; these tests reach each of its paths: GQA
groups 1-4 (3 is not a power of two), head dims that are not powers of two, block size 1 and
sizes that do not divide the lengths, contexts ending exactly on a block boundary, single-token
prefills, and the split-KV path with its log-sum-exp merge (forced on tiny contexts); and the
optional features (sliding windows, logit soft-caps, sinks), alone and together, on mixed steps,
with the window below, at and above the contexts, in one pass and split.
The model-level property tests (every request's logits vs the HF model alone) run this backend
in tests/engine/test_equivalence.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: Triton decides at import

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from varlen import registry  # noqa: E402
from varlen.attention_api import FEATURES, BackendUnavailable, LayerAttention  # noqa: E402
from backends.torch_ref import TorchRefBackend  # noqa: E402
from backends.triton_paged import HOW_TO_RUN, INSTALL_HINT, TritonPagedBackend, plan_launch  # noqa: E402
from varlen.batch import ForwardBatch, SeqSlice, build_batch  # noqa: E402


# Skipped only where they cannot run by design; anything else that keeps the interpreter from
# running (triton imported too early, a broken install) fails them, loudly.
if torch.cuda.is_available():
    REASON = "this machine has CUDA: Triton runs compiled here (tests/backends/test_gpu_backends.py)"
elif importlib.util.find_spec("triton") is None:
    REASON = f"triton is not installed: {INSTALL_HINT}"
else:
    REASON = None
needs_interpreter = pytest.mark.skipif(REASON is not None, reason=REASON or "")
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3}  # fp16: P is rounded to fp16 before P @ V, as on a GPU


# ----------------------------------------------------------------------------- workloads

def make_batch(shapes: list[tuple[int, int]], block_size: int, spare: int = 0, seed: int = 0) -> tuple[ForwardBatch, int]:
    """(cached, new) per request → a step over a shuffled pool; `spare` unused blocks in the pool."""
    need = [-(-(c + n) // block_size) for c, n in shapes]
    pool = sum(need) + spare
    perm = np.random.default_rng(seed).permutation(pool)
    seqs, at = [], 0
    for i, ((cached, new), k) in enumerate(zip(shapes, need)):
        seqs.append(SeqSlice(np.arange(new) + 3, cached, perm[at:at + k], req_id=i))
        at += k
    return build_batch(seqs, block_size, pool), pool


@st.composite
def steps(draw) -> tuple[ForwardBatch, int]:
    """1-5 requests: fresh prefills, later chunks, decodes; sometimes a pure-decode step."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]), label="block_size")
    pure_decode = draw(st.booleans(), label="pure_decode")
    shapes = []
    for _ in range(draw(st.integers(1, 5), label="num_requests")):
        cached = draw(st.integers(0, 40))
        decode = pure_decode or (cached > 0 and draw(st.booleans()))
        shapes.append((cached, 1 if decode else draw(st.integers(1, 24))))
    return make_batch(shapes, block_size, draw(st.integers(0, 4)), draw(st.integers(0, 2**16)))


def step_tensors(batch: ForwardBatch, pool: int, hkv: int, group: int, d: int, dtype: torch.dtype = torch.float32,
                 seed: int = 0, transposed_q: bool = False) -> tuple[torch.Tensor, ...]:
    """The KV pool's earlier contents and the step's q, k, v (random, from `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    n = batch.num_tokens
    cache = torch.randn(2, pool, batch.block_size, hkv, d, generator=gen).to(dtype)
    if transposed_q:  # what the model runner hands over: a [N, H, D] view of [H, N, D]
        q = torch.randn(hkv * group, n, d, generator=gen).to(dtype).transpose(0, 1)
    else:
        q = torch.randn(n, hkv * group, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    return cache, q, k, v


def compare(batch: ForwardBatch, pool: int, hkv: int, group: int, d: int, dtype: torch.dtype = torch.float32,
            seed: int = 0, backend: TritonPagedBackend | None = None, transposed_q: bool = False,
            layer: LayerAttention | None = None) -> torch.Tensor:
    """One step through the Triton backend and through torch_ref: same output, same cache. With a
    sliding window, blocks wholly behind each request's first window are NaN in a second run (the
    allocator may have given them away): the output must not change. Returns torch_ref's output."""
    cache, q, k, v = step_tensors(batch, pool, hkv, group, d, dtype, seed, transposed_q)
    backend = backend or TritonPagedBackend()
    backend.check("cpu", dtype, batch.block_size)
    ref = TorchRefBackend()
    scale = layer.scale if layer else d ** -0.5
    extra = {"layer": layer} if layer else {}
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = backend.forward(q, k, v, got_cache, backend.prepare(batch, "cpu"), scale, **extra)
    want = ref.forward(q, k, v, ref_cache, ref.prepare(batch, "cpu"), scale, **extra)
    assert torch.equal(got_cache, ref_cache), "the new K/V were written somewhere else"
    assert got.dtype == dtype and got.shape == want.shape
    where = (f"block size {batch.block_size}, seq_lens {batch.seq_lens.tolist()}, query lens "
             f"{batch.query_lens.tolist()}, {layer}")
    err = (got.float() - want.float()).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err:.2e} > {ATOL[dtype]} ({where})"
    if layer is not None and layer.sliding_window is not None:
        poisoned = cache.clone()
        for i, (length, new) in enumerate(zip(batch.seq_lens.tolist(), batch.query_lens.tolist())):
            behind = max(0, length - new - layer.sliding_window + 1) // batch.block_size
            poisoned[:, batch.block_tables[i, :behind].tolist()] = float("nan")
        if not poisoned.isnan().any():
            return want
        again = backend.forward(q, k, v, poisoned, backend.prepare(batch, "cpu"), scale, **extra)
        assert torch.equal(again, got), f"read a block wholly behind the window ({where})"
    return want


class CountingKernel:
    """Wraps a kernel to count launches (proves which path ran)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def counted(backend: TritonPagedBackend) -> tuple[CountingKernel, CountingKernel]:
    backend.check("cpu", torch.float32, 1)
    kernels = backend._kernels
    attention, merge = CountingKernel(kernels.attention), CountingKernel(kernels.merge)
    backend._kernels = type(kernels)(attention, merge, kernels.interpreted)
    return attention, merge


# ----------------------------------------------------------------- kernel vs torch_ref

@needs_interpreter
@settings(max_examples=max(4, settings.default.max_examples // 2))
@given(drawn=steps(), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]), d=st.sampled_from([8, 12]),
       splits=st.sampled_from([None, None, 2, 3]), seed=st.integers(0, 2**16))
def test_random_steps_match_torch_ref(drawn, hkv, group, d, splits, seed):
    batch, pool = drawn
    compare(batch, pool, hkv, group, d, seed=seed, backend=TritonPagedBackend(num_splits=splits))


@needs_interpreter
@settings(max_examples=max(2, settings.default.max_examples // 8))
@given(drawn=steps(), splits=st.sampled_from([None, 2]), seed=st.integers(0, 2**16))
def test_random_steps_match_torch_ref_fp16(drawn, splits, seed):
    batch, pool = drawn
    compare(batch, pool, 2, 2, 16, torch.float16, seed=seed, backend=TritonPagedBackend(num_splits=splits))


# ------------------------------------------------------------------------- edge cases

@needs_interpreter
@pytest.mark.parametrize("case,shapes,block_size", [
    ("block size 1", [(0, 5), (6, 1), (3, 4)], 1),
    ("context ends on a block boundary", [(4, 4), (7, 1), (0, 8), (15, 1)], 4),  # lengths 8, 8, 8, 16
    ("next token opens a new block", [(8, 1), (4, 1)], 4),
    ("single-token prefill", [(0, 1)], 3),
    ("single-token prefills beside a chunk", [(0, 1), (9, 7), (0, 1)], 5),
    ("one block holds everything", [(2, 3)], 16),
    ("prefill longer than one query tile", [(0, 70), (5, 1)], 7),
])
def test_edge_cases_match_torch_ref(case, shapes, block_size):
    batch, pool = make_batch(shapes, block_size, spare=2)
    compare(batch, pool, hkv=2, group=2, d=16)


@needs_interpreter
@pytest.mark.parametrize("hkv,group,d", [(1, 8, 16), (2, 4, 16), (1, 3, 24), (4, 1, 8)], ids=["MQA", "GQA4", "GQA3-D24", "MHA"])
def test_head_layouts_match_torch_ref(hkv, group, d):
    batch, pool = make_batch([(0, 6), (9, 1), (4, 3)], 4)
    compare(batch, pool, hkv, group, d, transposed_q=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_contexts_longer_than_one_split_are_merged(dtype):
    """Decodes and a chunk over contexts of several splits, some shorter than a split (their later
    splits see no key and must weigh nothing), through the split-KV kernel and the merge."""
    batch, pool = make_batch([(150, 1), (20, 1), (64, 1), (90, 6)], 8)
    backend = TritonPagedBackend(num_splits=4)
    attention, merge = counted(backend)
    compare(batch, pool, hkv=2, group=2, d=16, dtype=dtype, backend=backend)
    assert (attention.launches, merge.launches) == (1, 1)
    plan = plan_launch(batch.query_lens, batch.max_seq_len, 4, 2, dtype, 1, 4, interpreted=True)
    assert plan.num_splits == 4 and plan.split_len * 3 < 150, "request 0 must span all four splits"


@needs_interpreter
def test_one_launch_per_layer_without_split():
    batch, pool = make_batch([(0, 9), (12, 1), (3, 5)], 4)
    backend = TritonPagedBackend()
    attention, merge = counted(backend)
    compare(batch, pool, hkv=2, group=2, d=16, backend=backend)
    assert (attention.launches, merge.launches) == (1, 0)


# ------------------------------------------ sliding windows, logit soft-caps, sinks (interpreted)

def sink_logits(hq: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, hq)  # some heads' sinks outweigh their keys, some do not


@needs_interpreter
@settings(max_examples=max(4, settings.default.max_examples // 4))
@given(drawn=steps(), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       window=st.one_of(st.none(), st.integers(1, 12)), softcap=st.sampled_from([None, 0.7, 3.0]),
       sinks=st.booleans(), splits=st.sampled_from([None, 2, 3]), seed=st.integers(0, 2**16))
def test_features_on_random_steps_match_torch_ref(drawn, hkv, group, window, softcap, sinks, splits, seed):
    """Windows, soft-caps and sinks, alone and together, on mixed steps (prefills, chunks, decodes),
    split or not: torch_ref's output, and no block wholly behind a window is read."""
    batch, pool = drawn
    spec = LayerAttention(8 ** -0.5, sliding_window=window, softcap=softcap,
                          sinks=sink_logits(hkv * group) if sinks else None)
    compare(batch, pool, hkv, group, 8, seed=seed, backend=TritonPagedBackend(num_splits=splits), layer=spec)


# A prefill, a chunk and two decodes in one step, block size 4: contexts 9, 17, 8 and 17.
MIXED = [(0, 9), (12, 5), (7, 1), (16, 1)]


@needs_interpreter
@pytest.mark.parametrize("window,splits", [(1, None), (5, None), (8, None), (17, None), (18, None), (5, 3), (17, 3)],
                         ids=["W=1", "W<every context", "W=a decode's context", "W=the longest context",
                              "W>every context", "W<every context, 3 splits", "W=the longest context, 3 splits"])
def test_window_edges_with_sinks_and_softcap_together(window, splits):
    """Every feature on at once, the window below, at and above the contexts of a mixed batch."""
    batch, pool = make_batch(MIXED, 4, spare=2)
    spec = LayerAttention(0.4, sliding_window=window, softcap=1.5, sinks=sink_logits(4))
    want = compare(batch, pool, hkv=2, group=2, d=16, backend=TritonPagedBackend(num_splits=splits), layer=spec)
    # Each feature bites at these values (a window only below the longest context): equal to
    # torch_ref's, the output cannot have ignored one of them.
    ref = TorchRefBackend()
    cache, q, k, v = step_tensors(batch, pool, 2, 2, 16)
    for off in ("softcap", "sinks", "sliding_window"):
        without = dataclasses.replace(spec, **{off: None})
        other = ref.forward(q, k, v, cache.clone(), ref.prepare(batch, "cpu"), spec.scale, layer=without)
        bites = (other - want).abs().max().item() > 1e-2
        assert bites == (off != "sliding_window" or window < 17), f"{off}: {bites}"


@needs_interpreter
def test_features_in_fp16_and_on_long_windowed_contexts():
    """fp16 with every feature; a window much shorter than the contexts, split: the splits cover
    the window's span only, each request's from its own window's start (from key 0, request 0
    would see none of its window)."""
    batch, pool = make_batch([(150, 1), (40, 1), (90, 6)], 8)
    spec = LayerAttention(0.25, sliding_window=20, softcap=2.0, sinks=sink_logits(4))
    compare(batch, pool, hkv=2, group=2, d=16, dtype=torch.float16, backend=TritonPagedBackend(num_splits=2),
            layer=spec)
    backend = TritonPagedBackend(num_splits=3)
    attention, merge = counted(backend)
    compare(batch, pool, hkv=2, group=2, d=16, backend=backend, layer=LayerAttention(0.25, sliding_window=20))
    plan = plan_launch(batch.query_lens, batch.max_seq_len, 4, 2, torch.float32, 1, 3, interpreted=True, window=20)
    assert (attention.launches, merge.launches) == (2, 2)  # the second: the poisoned run
    assert plan.num_splits * plan.split_len < 140, plan


def test_declares_every_feature_but_batch_invariance():
    assert TritonPagedBackend.features == frozenset(FEATURES)
    with pytest.raises(ValueError, match="no batch-invariant mode"):
        TritonPagedBackend(batch_invariant=True)


# -------------------------------------------------------------- host-side planning (no kernel)

def test_split_plan_fills_the_gpu_for_few_long_decodes():
    decode = np.ones(1, dtype=np.int32)
    plan = plan_launch(decode, 8192, 32, 8, torch.bfloat16, num_sms=132)
    # 8 programs (one per KV head) on 132 SMs: split, bounded by max_splits and by 256 keys a split.
    assert plan.num_splits == 32 and plan.split_len * plan.num_splits >= 8192
    assert plan.split_len % 16 == 0
    assert plan_launch(decode, 1024, 32, 8, torch.bfloat16, 132).num_splits == 4  # 1024 / 256 keys
    assert plan_launch(np.ones(16, np.int32), 1024, 32, 8, torch.bfloat16, 132).num_splits == 3  # 128 programs
    assert plan_launch(np.ones(256, np.int32), 8192, 32, 8, torch.bfloat16, 132).num_splits == 1  # 2048 programs
    assert plan_launch(decode, 200, 32, 8, torch.bfloat16, 132).num_splits == 1  # short: nothing to split
    prefill = plan_launch(np.array([2048] * 4), 2048, 32, 8, torch.bfloat16, 132)
    assert prefill.num_splits == 1 and prefill.block_m == 64
    assert plan_launch(decode, 8192, 32, 8, torch.bfloat16, 132, max_splits=8).num_splits == 8
    # A sliding window splits its span, not the context: a tile of 4 tokens reads 1024 + 3 keys.
    assert plan_launch(decode, 32768, 32, 8, torch.bfloat16, 132, window=1024).num_splits == 5


@given(q_lens=st.lists(st.integers(1, 300), min_size=1, max_size=40), extra=st.integers(0, 5000),
       hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 3, 4, 8]), sms=st.sampled_from([1, 132]),
       forced=st.sampled_from([None, 1, 2, 7]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       window=st.one_of(st.none(), st.integers(1, 4096)))
def test_split_plan_covers_every_key(q_lens, extra, hkv, group, sms, forced, dtype, window):
    q = np.array(q_lens)
    max_seq = int(q.max()) + extra
    plan = plan_launch(q, max_seq, hkv * group, hkv, dtype, sms, forced, window=window)
    # A tile reads from its first row's window start to its last row: at most W + tokens - 1 keys.
    tokens = plan.block_m // group
    span = max_seq if window is None else min(max_seq, window + tokens - 1)
    assert plan.num_splits * plan.split_len >= span and plan.split_len % 16 == 0
    assert plan.block_m >= 16 and tokens >= 1 and plan.block_m & (plan.block_m - 1) == 0
    if forced:
        assert plan.num_splits == forced
    else:  # automatic splits hold at least kv_split_size keys: none starts past the longest span
        assert plan.num_splits == 1 or (plan.num_splits - 1) * plan.split_len < span


# --------------------------------------------------------------- availability and settings

@needs_interpreter
def test_bf16_on_cpu_is_refused_in_one_line():
    with pytest.raises(ValueError, match="not bfloat16.*engine.dtype=float32"):
        TritonPagedBackend().check("cpu", torch.bfloat16, 16)


def test_missing_triton_says_how_to_install(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in ("triton", "triton.language", "triton.runtime.interpreter", "backends.triton_paged_kernels"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import mod` raises ImportError
    with pytest.raises(BackendUnavailable) as info:
        registry.build("backend", "triton").check("cpu", torch.float32, 16)
    assert "\n" not in str(info.value) and INSTALL_HINT in str(info.value), info.value


def test_no_cuda_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as info:
        registry.build("backend", "triton").check("cuda", torch.float16, 16)
    assert "\n" not in str(info.value) and "GPU" in str(info.value) and INSTALL_HINT in str(info.value)


# One child process for the interpreter's start-up rules (Triton's mode is fixed per process).
_STARTUP = """
import os, sys, torch
os.environ.pop("TRITON_INTERPRET", None)
from varlen.attention_api import BackendUnavailable
from backends.triton_paged import TritonPagedBackend
def msg(device="cpu"):
    try:
        TritonPagedBackend().check(device, torch.float32, 16)
    except BackendUnavailable as e:
        return str(e)
    return "ok"
print(msg(), "triton" in sys.modules, sep="|")   # refused before importing triton
import triton                                      # now imported without the interpreter...
os.environ["TRITON_INTERPRET"] = "1"               # ...which is too late to ask for
print(msg(), sep="|")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: triton runs compiled")
def test_cpu_without_interpreter_says_how_to_run_it():
    res = subprocess.run([sys.executable, "-c", _STARTUP], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.strip().splitlines()
    assert first == f"{HOW_TO_RUN}|False", first
    if "triton package" in second:
        pytest.skip("triton is not installed")
    assert second == f"{HOW_TO_RUN} (triton was imported without it)", second
    assert "engine.device=cuda" in HOW_TO_RUN and "TRITON_INTERPRET=1" in HOW_TO_RUN


def test_cli_on_cpu_fails_at_start_up_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["VARLEN_HOME"] = str(tmp_path / "home")
    res = subprocess.run([sys.executable, "-m", "varlen.run", f"hydra.run.dir={tmp_path}", "backend=triton",
                          "progress=false"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "TRITON_INTERPRET=1" in res.stderr, res.stderr


def test_config_instantiates_the_backend():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    backend = instantiate(OmegaConf.load("conf/backend/triton.yaml"))
    assert isinstance(backend, TritonPagedBackend) and backend.num_splits is None
    assert registry.build("backend", "triton").name == "triton"


# ------------------------------------------------- the GPU path compiles (no GPU needed)

# Run in a child process: compiling needs Triton imported without the interpreter.
_COMPILE = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from backends import triton_paged_kernels as kernels

def signature(kernel, pointers, constexprs):
    floats = ("score_scale", "softcap_log2")
    return {name: pointers.get(name, "constexpr" if name in constexprs else "fp32" if name in floats else "i32")
            for name in kernel.arg_names}

attention = dict(NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, SPLIT=True,
                 DOT_PRECISION="tf32", HAS_WINDOW=False, SOFTCAP=False, HAS_SINKS=False)
pointers = {name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
pointers |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
pointers |= {"out_ptr": "*fp32", "lse_ptr": "*fp32", "sinks_ptr": "*fp32"}
featured = attention | dict(HAS_WINDOW=True, SOFTCAP=True, HAS_SINKS=True)
merge = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=8, BLOCK_H=8)
for name, kernel, pointers, constexprs in [
        ("attention", kernels.paged_attention_kernel, pointers, attention),
        ("attention+features", kernels.paged_attention_kernel, pointers, featured),
        ("merge", kernels.merge_splits_kernel, {"out_ptr": "*bf16", "parts_ptr": "*fp32", "lse_ptr": "*fp32"}, merge)]:
    try:
        source = ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs)
    except TypeError as err:  # the ahead-of-time API changes between Triton versions
        sys.exit(f"SKIP this Triton's ASTSource API differs: {err}")
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    print(name, len(compiled.asm["cubin"]), compiled.metadata.shared)
"""


def test_kernels_compile_for_hopper():
    """Triton's compiler (with its bundled ptxas) lowers the kernels to sm_90 machine code here,
    which the interpreter never does, so the GPU path's compile errors show up on CPU: the
    attention kernel in bf16 with the largest tile and the split epilogue, plain and with every
    feature (window, soft-cap, sinks) on, and the merge."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip(f"triton is not installed: {INSTALL_HINT}")
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    if res.returncode != 0 and "SKIP" in res.stderr:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    compiled = dict((name, (int(size), int(shared))) for name, size, shared in map(str.split, res.stdout.splitlines()))
    assert set(compiled) == {"attention", "attention+features", "merge"}
    assert all(size > 0 and shared <= 228 * 1024 for size, shared in compiled.values()), compiled
