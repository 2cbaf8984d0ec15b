"""Opt-in batch-invariant mode: a request's logits are bitwise identical whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from varlen import registry
from varlen.batch import SeqSlice, build_batch
from varlen.model_runner import ModelRunner, load_model


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    # Its own copy: batch-invariant mode patches the model's linear layers.
    return load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")


def run(runner, target, others, cached_steps):
    """Prefill everything, then one mixed step; return the target's logits from that step."""
    runner.execute(build_batch([SeqSlice(t[:c], 0, b, False) for t, c, b in cached_steps], 4))
    seqs = [SeqSlice(t[c:], c, b, True) for t, c, b in cached_steps]
    order = list(range(len(seqs)))
    return runner.execute(build_batch([seqs[i] for i in order], 4))[target]


@pytest.mark.parametrize("backend", ["torch_ref", "torch_sdpa", "torch_paged"])
@given(data=st.data())
def test_logits_do_not_depend_on_the_rest_of_the_batch(model, backend, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    n_others = data.draw(st.integers(1, 6))
    lens = [data.draw(st.integers(2, 40)) for _ in range(n_others + 1)]
    cached = [data.draw(st.integers(1, n - 1)) for n in lens]
    toks = [rng.integers(3, 500, n).tolist() for n in lens]
    runner = ModelRunner(model, registry.build("backend", backend), 4, 256, batch_invariant=True)
    blocks, at = [], 0
    for n in lens:
        blocks.append(list(range(at, at + -(-n // 4))))
        at += -(-n // 4)
    pos = data.draw(st.integers(0, n_others))
    mixed = [(toks[i], cached[i], blocks[i]) for i in range(n_others + 1)]
    target_item = mixed.pop(0)
    mixed.insert(pos, target_item)
    together = run(runner, pos, [], mixed)
    alone = run(ModelRunner(model, registry.build("backend", backend), 4, 256, batch_invariant=True), 0, [],
                [target_item])
    assert torch.equal(together, alone), f"max diff {(together - alone).abs().max().item():.3e}"
