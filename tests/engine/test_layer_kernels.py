"""The fused per-layer kernels (varlen/layer_kernels.py): each C kernel equals its torch reference,
the default engine runs them (the property tests in test_equivalence.py go through the same
ModelRunner), a module whose probe does not match keeps its own code, and every other outcome is said."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from varlen import LLM, SamplingParams, registry
from varlen import layer_kernels as lk
from varlen.model_runner import ModelRunner, load_model
from varlen.testing.equivalence import load_pair


@pytest.fixture(scope="module")
def c_ops() -> lk.COps:
    lib, why = lk.load_library()
    assert lib is not None, f"the layer kernels' C library should build here: {why}"
    return lk.COps(lib)


def _rows(data, rows: int, width: int, strided: bool) -> torch.Tensor:
    """[rows, width] fp32 of a drawn scale; `strided`: a column slice of a wider tensor (row stride > width)."""
    scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    x = torch.randn(rows, width + (5 if strided else 0), generator=gen) * scale
    return x[:, 2:2 + width] if strided else x


SHAPES = dict(rows=st.sampled_from([0, 1, 3, 64, 130]), width=st.sampled_from([1, 7, 16, 64, 100, 1536]),
              strided=st.booleans(), threads=st.sampled_from([1, 2]))


@settings(max_examples=10, deadline=None)
@given(data=st.data(), **SHAPES)
def test_each_kernel_matches_its_torch_reference(c_ops, data, rows, width, strided, threads):
    """Shapes span the empty step, widths below and across the vector length with a tail, strided
    rows, and sizes above the threshold where rows are split over threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, w = _rows(data, rows, width, strided), _rows(data, rows, width, strided), _rows(data, 1, width, False)[0]
        eps = 1e-6
        torch.testing.assert_close(c_ops.rmsnorm(a, w, eps), lk.Ops.rmsnorm(a, w, eps), rtol=2e-5, atol=1e-6)
        got, want = c_ops.add_rmsnorm(a, b, w, eps), lk.Ops().add_rmsnorm(a, b, w, eps)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the sum is one rounding either way
        torch.testing.assert_close(got[1], want[1], rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(c_ops.silu_mul(a, b), lk.Ops.silu_mul(a, b), rtol=2e-5, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_kernels_handle_leading_dims_and_hand_other_dtypes_to_torch(c_ops):
    x = torch.randn(1, 5, 8, 64)  # HF's [batch, tokens, heads, head dim] for q/k norms
    w = torch.randn(64)
    torch.testing.assert_close(c_ops.rmsnorm(x, w, 1e-6), lk.Ops.rmsnorm(x, w, 1e-6), rtol=2e-5, atol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(c_ops.rmsnorm(xb, wb, 1e-6), lk.Ops.rmsnorm(xb, wb, 1e-6))


def _fused(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in model.modules():
        f = m.__dict__.get("forward")
        kind = lk.KINDS.get(getattr(f, "func", None))
        if kind is not None:
            assert f.args[1].name == lk.C
            counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_default_engine_runs_every_layer_fused(tiny_model_dirs, arch):
    """Fails if the swap silently does not happen: the property tests' model under test (load_pair +
    ModelRunner, as in varlen/testing/equivalence.py) has every decoder layer, MLP and RMSNorm on the
    C kernels, and the oracle has none."""
    model, oracle = load_pair(tiny_model_dirs[arch])
    runner = ModelRunner(model, registry.build("backend", "torch_paged"), 4, 8)
    n = model.config.num_hidden_layers
    norms = sum(lk._is_rmsnorm(m) for m in model.modules())
    assert _fused(model) == {"decoder layers (add+RMSNorm)": n, "MLPs (SiLU·mul)": n, "RMSNorms": norms}
    assert runner.layer_kernels.startswith(f"{lk.C}: {n} decoder layers") and "kept" not in runner.layer_kernels
    assert _fused(oracle) == {}
    assert LLM("tiny").runner.layer_kernels.startswith(f"{lk.C}: ")


def test_greedy_tokens_are_the_same_fused_or_not(monkeypatch):
    prompts = [[5, 6, 7, 8, 9] * 9, [3, 4] * 7, [11] * 30]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused = LLM("tiny")
    monkeypatch.setenv(lk.ENV, "0")
    plain = LLM("tiny")
    assert plain.runner.layer_kernels == f"{lk.OFF} ({lk.ENV}=0)" and _fused(plain.runner.model) == {}
    assert [o.token_ids for o in fused.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_a_kernel_that_does_not_match_keeps_the_modules_own_code(tiny_model_dirs, monkeypatch):
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    monkeypatch.setattr(lk.COps, "silu_mul", lambda self, g, u: g * u)
    got = lk.fuse_layers(model, torch.device("cpu"), torch.float32)
    assert got.endswith("; kept on their own code (probe mismatch): 2 Qwen3MLP")
    assert all("forward" not in m.__dict__ for m in model.modules() if lk._is_gated_mlp(m))
    # The decoder layers' probe ran with the wrong kernel too (it calls the MLP), so they are kept.
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    monkeypatch.setattr(lk.COps, "add_rmsnorm", lambda self, a, b, w, eps: (a + b, a + b))
    got = lk.fuse_layers(model, torch.device("cpu"), torch.float32)
    assert "2 Qwen3DecoderLayer" in got.split("kept")[1] and "decoder layers" not in got.split("kept")[0]


def test_without_the_c_library_torch_ops_run_and_it_is_said(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(lk, "_lib", "no working C compiler (cc: not found)")
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    with pytest.warns(RuntimeWarning, match=r"layer kernels: the C library is unavailable \(no working C compiler"):
        got = lk.fuse_layers(model, torch.device("cpu"), torch.float32)
    assert got.startswith(f"{lk.TORCH}: 2 decoder layers")


def test_other_dtypes_and_devices_are_left_alone_and_said(tiny_model_dirs):
    model = load_model(tiny_model_dirs["qwen3"], torch.bfloat16, "cpu")
    assert lk.fuse_layers(model, torch.device("cpu"), torch.bfloat16) == f"{lk.OFF} (CPU float32 only; this model runs on cpu bfloat16)"
    assert _fused(model) == {}


def test_the_switch_takes_its_three_values_and_refuses_others(tiny_model_dirs, monkeypatch):
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    monkeypatch.setenv(lk.ENV, "fast")
    with pytest.raises(ValueError, match=r"VARLEN_LAYER_KERNELS='fast': must be 1 \(the C kernels"):
        lk.fuse_layers(model, torch.device("cpu"), torch.float32)
    monkeypatch.setenv(lk.ENV, "off")
    assert lk.fuse_layers(model, torch.device("cpu"), torch.float32) == f"{lk.OFF} ({lk.ENV}=off)"
    monkeypatch.setenv(lk.ENV, "torch")
    assert lk.fuse_layers(model, torch.device("cpu"), torch.float32).startswith(f"{lk.TORCH}: 2 decoder layers")
