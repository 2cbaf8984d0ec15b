"""backend=auto (varlen/backend_choice.py): the rule per device, dtype and model features, the one
line it prints, that the chosen backend is what runs, and that a named backend is never swapped."""

from __future__ import annotations

import pytest
import torch

import backends.torch_paged as tp
from varlen import registry
from varlen.backend_choice import AutoBackend, announcement, choose, declared
from varlen.llm import LLM
from varlen.model_runner import ATTN_NAME, ModelRunner, register_varlen_attention
from varlen.tiny_model import tiny_model

PLAIN, SOFTCAP, WINDOW, SINKS = frozenset(), frozenset({"softcap"}), frozenset({"sliding_window"}), frozenset({"sinks"})


def installed(*present: str):
    """A probe for a machine where only `present` backends have their libraries (features as declared)."""
    def probe(name, device, dtype, block_size, needs):
        return declared(name, device, dtype, block_size, needs) or (None if name in present else "not installed")
    return probe


def test_cpu_rule_on_this_machine():
    assert choose("cpu", torch.float32, 16, PLAIN) == ("torch_paged", [])
    assert choose("cpu", torch.bfloat16, 16, SOFTCAP | SINKS | WINDOW) == ("torch_paged", [])
    name, passed = choose("cpu", torch.float16, 16, WINDOW)  # no fp16 kernel: SDPA does windows
    assert name == "torch_sdpa" and passed == ["torch_paged: no kernel for float16 (it would run torch_sdpa's code)"]
    name, passed = choose("cpu", torch.float16, 16, SOFTCAP)
    assert name == "torch_ref" and passed[1] == "torch_sdpa: lacks softcap"


def test_cpu_rule_without_the_c_kernel(monkeypatch):
    monkeypatch.setattr(tp, "_kernel", False)  # as when no compiler could build it
    assert choose("cpu", torch.float32, 16, PLAIN) == ("torch_sdpa", ["torch_paged: its C kernel is unavailable"])
    assert choose("cpu", torch.float32, 16, SINKS)[0] == "torch_ref"


@pytest.mark.parametrize("present,dtype,needs,want", [
    (("flashinfer", "flash_attn", "triton", "torch_sdpa", "torch_ref"), torch.bfloat16, PLAIN, "flashinfer"),
    (("flash_attn", "triton", "torch_sdpa", "torch_ref"), torch.bfloat16, SOFTCAP, "flash_attn"),
    (("triton", "torch_sdpa", "torch_ref"), torch.float16, PLAIN, "triton"),
    (("flashinfer", "flash_attn", "triton", "torch_sdpa", "torch_ref"), torch.bfloat16, SINKS, "triton"),
    (("flashinfer", "flash_attn", "torch_sdpa", "torch_ref"), torch.bfloat16, SINKS, "torch_ref"),
    (("triton", "torch_sdpa", "torch_ref"), torch.float32, WINDOW | SOFTCAP | SINKS, "triton"),
])
def test_cuda_rule_by_what_is_installed_and_the_dtype(present, dtype, needs, want):
    name, passed = choose("cuda", dtype, 256, needs, installed(*present))
    assert name == want
    assert all(p.split(":")[0] != want for p in passed) and len(passed) == ["flashinfer", "flash_attn", "triton",
                                                                          "torch_sdpa", "torch_ref"].index(want)


def test_cuda_rule_on_a_machine_without_a_gpu_names_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("checks the messages on a machine without a GPU; this one has a CUDA device (test_cuda_rule_by_what_is_installed_and_the_dtype covers it)")
    name, passed = choose("cuda", torch.bfloat16, 256, PLAIN)
    assert name == "torch_sdpa" and [p.split(":")[0] for p in passed] == ["flashinfer", "flash_attn", "triton"]
    assert all("needs an NVIDIA GPU" in p for p in passed), passed


def test_no_backend_fits_is_one_line():
    with pytest.raises(ValueError) as info:
        choose("cpu", torch.float32, 16, PLAIN, lambda *a: "nope")
    assert "\n" not in str(info.value) and "torch_paged: nope" in str(info.value)
    with pytest.raises(ValueError, match="no backends for device 'mps'"):
        registry.build("backend", "auto").check("mps", torch.float32, 16)


def test_announcement():
    assert announcement("torch_paged", [], "cpu", torch.float32) == "backend: auto -> torch_paged (cpu float32)"
    assert announcement("torch_ref", ["torch_paged: x"], "cpu", torch.float16) == \
        "backend: auto -> torch_ref (cpu float16; passed over torch_paged: x)"


def _model(arch: str):
    register_varlen_attention()
    return tiny_model(arch, attn_implementation=ATTN_NAME)


def test_auto_becomes_the_chosen_backend_and_says_so(capsys, monkeypatch):
    monkeypatch.setattr(tp, "_kernel", False)
    auto = registry.build("backend", "auto")
    assert isinstance(auto, AutoBackend) and auto.name == "auto"
    with pytest.raises(RuntimeError, match="bind first"):
        auto.kv_cache_shape(4, 4, 2, 8)
    runner = ModelRunner(_model("gpt_oss"), auto, 4, 8)  # sinks: neither the fallback torch_paged nor torch_sdpa
    assert auto.name == "torch_ref" and type(auto.chosen).__name__ == "TorchRefBackend"
    assert auto.forward == auto.chosen.forward and runner.backend is auto
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("backend: auto -> torch_ref (cpu float32; passed over torch_paged: its C kernel")


def test_batch_invariant_auto_chooses_in_that_mode():
    runner = ModelRunner(_model("llama"), registry.build("backend", "auto", batch_invariant=True), 4, 8)
    assert runner.backend.name == "torch_paged" and runner.backend.chosen.batch_invariant


def test_a_named_backend_that_cannot_serve_is_refused_not_swapped():
    with pytest.raises(ValueError, match="use softcap, which backend 'torch_sdpa' does not implement"):
        ModelRunner(_model("gemma2"), registry.build("backend", "torch_sdpa"), 4, 8)


def test_llm_defaults_to_auto(capsys):
    llm = LLM("tiny", num_blocks=16, max_num_seqs=2)
    assert llm.backend.name == "torch_paged"
    assert "backend: auto -> torch_paged (cpu float32)" in capsys.readouterr().err
