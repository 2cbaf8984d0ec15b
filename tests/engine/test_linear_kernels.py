"""The model's linear layers on oneDNN with packed weights (varlen/linear_kernels.py): used where
it serves, exact to rounding, refused or reported where it does not, never silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from varlen import LLM, SamplingParams, registry
from varlen import linear_kernels as lk
from varlen.model_runner import ModelRunner, load_model


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_onednn_packs_every_linear_layer_and_matches_f_linear(tiny_model_dirs):
    assert lk.onednn_unavailable(torch.device("cpu"), torch.float32) is None, "this torch build should have oneDNN"
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    runner = ModelRunner(model, registry.build("backend", "torch_sdpa"), 4, 8, linear_kernel="onednn")
    assert runner.linear_kernel == lk.ONEDNN
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for m in _linears(model):
        if m.in_features == x.shape[1]:
            torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
            assert m(x[:0]).shape == (0, m.out_features)  # an empty step


def test_greedy_tokens_are_the_same_with_either_kernel():
    prompts = [[5, 6, 7, 8, 9] * 9, [3, 4] * 7, [11] * 30]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = {}
    for kernel in ("onednn", "torch"):
        llm = LLM("tiny", linear_kernel=kernel)
        out[kernel] = ([o.token_ids for o in llm.generate(prompts, sp)], llm.runner.linear_kernel)
    assert out["onednn"][1] == lk.ONEDNN and out["torch"][1] == lk.TORCH
    assert out["onednn"][0] == out["torch"][0]


def test_auto_packs_only_layers_large_enough_to_gain():
    """The tiny model's layers (at most 512x64) lose to oneDNN's per-call cost: auto keeps F.linear
    for them; a layer of MIN_PACKED_ELEMENTS weights is packed, and the description counts both."""
    assert LLM("tiny").runner.linear_kernel == lk.TORCH
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(64, 64))
    assert model[0].weight.numel() == lk.MIN_PACKED_ELEMENTS
    got = lk.pack_linears(model, torch.device("cpu"), torch.float32)
    assert got == f"{lk.ONEDNN}: 1 layers, {lk.TORCH}: 1 layers"
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__


def test_a_layer_that_does_not_match_keeps_f_linear(tiny_model_dirs, monkeypatch):
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    monkeypatch.setattr(lk, "_onednn_linear", lambda packed, bias, x: torch.zeros(x.shape[0], packed.size(0)))
    assert lk.pack_linears(model, torch.device("cpu"), torch.float32, min_elements=0) == lk.TORCH
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_unserved_device_or_dtype_is_said():
    assert "dtype" in lk.onednn_unavailable(torch.device("cpu"), torch.bfloat16)
    assert "device" in lk.onednn_unavailable(torch.device("meta"), torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert lk.pack_linears(model, torch.device("cpu"), torch.bfloat16).startswith(f"{lk.TORCH} (dtype")


def test_bad_or_impossible_choice_is_an_error(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"linear_kernel='fast': must be one of auto, onednn, torch"):
        LLM("tiny", linear_kernel="fast")
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    invariant = registry.build("backend", "torch_sdpa", batch_invariant=True)
    with pytest.raises(ValueError, match="linear_kernel=onednn: a batch-invariant backend"):
        ModelRunner(model, invariant, 4, 8, linear_kernel="onednn")
    with pytest.raises(ValueError, match="linear_kernel=onednn: the linear layers run on torch"):
        ModelRunner(load_model(tiny_model_dirs["qwen3"], torch.bfloat16, "cpu"), registry.build("backend", "torch_sdpa"),
                    4, 8, dtype=torch.bfloat16, linear_kernel="onednn")


def test_a_shared_model_reports_what_it_runs_now(tiny_model_dirs):
    """Two runners over one model: the kernel reported is the model's, not what one runner asked for."""
    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    first = ModelRunner(model, registry.build("backend", "torch_sdpa"), 4, 8, linear_kernel="onednn")
    assert first.linear_kernel == lk.ONEDNN
    ModelRunner(model, registry.build("backend", "torch_sdpa", batch_invariant=True), 4, 8)
    assert first.linear_kernel == lk.TILED  # the invariant runner tiled the shared layers
