"""Opt-in batch-invariant mode: a request's logits are bitwise identical whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from varlen import registry
from varlen.attention_api import BATCH_INVARIANT
from varlen.batch import SeqSlice, build_batch
from varlen.model_runner import ModelRunner, load_model


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    # Its own copy: batch-invariant mode patches the model's linear layers.
    return load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")


def invariant(name: str):
    """The backend built with its batch-invariant option, the one switch for the mode."""
    return registry.build("backend", name, batch_invariant=True)


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
    runner = ModelRunner(model, invariant(backend), 4, 256)
    blocks, at = [], 0
    for n in lens:
        blocks.append(list(range(at, at + -(-n // 4))))
        at += -(-n // 4)
    pos = data.draw(st.integers(0, n_others))
    mixed = [(toks[i], cached[i], blocks[i]) for i in range(n_others + 1)]
    target_item = mixed.pop(0)
    mixed.insert(pos, target_item)
    together = run(runner, pos, [], mixed)
    alone = run(ModelRunner(model, invariant(backend), 4, 256), 0, [],
                [target_item])
    assert torch.equal(together, alone), f"max diff {(together - alone).abs().max().item():.3e}"


@pytest.mark.parametrize("name", registry.names("backend"))
def test_batch_invariance_is_a_declared_capability(name):
    """A backend offers the mode exactly when its features declare it; asking one that does not
    is refused at construction, naming the backend (no silent fallback to a varying result)."""
    cls = registry.target("backend", name)
    assert cls().batch_invariant is False  # off unless asked
    if BATCH_INVARIANT in cls.features:
        assert registry.build("backend", name, batch_invariant=True).batch_invariant is True
    else:
        with pytest.raises(ValueError, match=f"backend '{cls.name}' has no batch-invariant mode"):
            registry.build("backend", name, batch_invariant=True)
    assert {n for n in registry.names("backend") if BATCH_INVARIANT in registry.target("backend", n).features} \
        == {"torch_ref", "torch_sdpa", "torch_paged", "auto"}  # auto: it then chooses among the other three


def test_the_model_gemms_follow_the_backends_option(tiny_model_dirs):
    """The model runner tiles the GEMMs when, and only when, the backend was built invariant."""
    from varlen.linear_kernels import _tiled_linear

    def tiled(m):
        return any(getattr(lin.forward, "func", None) is _tiled_linear for lin in m.modules()
                   if isinstance(lin, torch.nn.Linear))

    plain = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu")
    ModelRunner(plain, registry.build("backend", "torch_sdpa"), 4, 8)
    assert not tiled(plain)
    ModelRunner(plain, invariant("torch_sdpa"), 4, 8)
    assert tiled(plain)
