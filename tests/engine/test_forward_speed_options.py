"""Forward-speed measures of ModelRunner: they change how fast a step runs, never what it computes.

The precomputed (empty) mask mapping: a model that accepts it builds no causal mask per step, and
its logits are bitwise those of the path that builds one; a model that does not accept it keeps
building masks (checked at load, never assumed).
"""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils
import transformers.models.qwen3.modeling_qwen3 as qwen3

from varlen import registry
from varlen.batch import SeqSlice, build_batch
from varlen.model_runner import ModelRunner, load_model, precomputed_masks
from varlen.tiny_model import ensure_tiny_model

BS = 16


def _steps() -> list:
    """A prefill of two requests, then a mixed step (a chunk beside a decode), then a decode."""
    return [build_batch([SeqSlice(list(range(3, 40)), 0, [0, 1, 2]), SeqSlice(list(range(5, 14)), 0, [3])], BS, 8),
            build_batch([SeqSlice([7], 37, [0, 1, 2]), SeqSlice(list(range(20, 27)), 9, [3])], BS, 8),
            build_batch([SeqSlice([9], 38, [0, 1, 2]), SeqSlice([11], 16, [3, 4])], BS, 8)]


def _run(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, use_mapping: bool) -> tuple[list, int]:
    calls = []
    real = masking_utils.create_causal_mask

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(qwen3, "create_causal_mask", counting)
    runner = ModelRunner(model, registry.build("backend", "torch_paged"), BS, 8)
    if not use_mapping:
        runner.forward_kwargs = {}
    calls.clear()  # the load-time probes build masks; only the steps count
    logits = [runner.execute(b).clone() for b in _steps()]
    return logits, len(calls)


def test_a_model_taking_the_mask_mapping_builds_no_mask_and_computes_the_same(monkeypatch):
    model = load_model(ensure_tiny_model("qwen3"), torch.float32, "cpu")
    fast, built_fast = _run(model, monkeypatch, use_mapping=True)
    slow, built_slow = _run(model, monkeypatch, use_mapping=False)
    assert built_slow == len(_steps())  # the counter sees the masks the default path builds ...
    assert built_fast == 0  # ... and the mapping path builds none
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_a_model_refusing_the_mapping_keeps_building_masks():
    """Llama's forward in this transformers takes a mask tensor only: the probe sees it fail, and
    the runner passes nothing (the model builds its masks as before)."""
    model = load_model(ensure_tiny_model("llama"), torch.float32, "cpu")
    assert precomputed_masks(model) is None
    assert ModelRunner(model, registry.build("backend", "torch_paged"), BS, 8).forward_kwargs == {}


def test_runners_over_one_model_probe_it_once_and_own_their_mapping(monkeypatch):
    """The probe's answer is shared by the runners of one model (shared_precomputed_masks): a
    changed config probes again, and one runner's mapping changed in place is not another's."""
    import varlen.model_runner as model_runner

    model = load_model(ensure_tiny_model("qwen3"), torch.float32, "cpu")
    probed = []
    real = model_runner.precomputed_masks
    monkeypatch.setattr(model_runner, "precomputed_masks", lambda m: probed.append(m) or real(m))
    a, b = (ModelRunner(model, registry.build("backend", "torch_paged"), BS, 8) for _ in range(2))
    assert probed == [model]
    mapping = a.forward_kwargs["attention_mask"]
    assert mapping and all(v is None for v in mapping.values())
    mapping["full_attention"] = torch.zeros(1)
    assert b.forward_kwargs["attention_mask"]["full_attention"] is None
    assert ModelRunner(model, registry.build("backend", "torch_ref"), BS, 8).forward_kwargs["attention_mask"] == (
        dict.fromkeys(mapping))
    monkeypatch.setattr(model.config, "varlen_test_setting", 1, raising=False)
    ModelRunner(model, registry.build("backend", "torch_paged"), BS, 8)
    assert probed == [model, model]
