"""Attention features (sliding window, logit soft-cap, sinks, query scale) and the refusals.

- torch_ref implements each feature as transformers' own eager functions define it (Gemma 2's
  soft-capped, windowed attention; gpt-oss's sinks), checked here against those functions with
  values that bite; torch_sdpa's windows, and torch_paged's windows, soft-caps and sinks (C kernel
  and SDPA split), equal torch_ref's on random mixed batches; triton's (in Triton's interpreter,
  which must be chosen before triton is imported) are in tests/backends/test_triton_backend.py.
- No silent features: an unknown attention keyword with a value, dropout, non-causal attention,
  a layer that never calls attention, a recurrent mixer, or a call that no longer matches what
  was bound at load are refused in one line; a backend that does not declare a feature a layer
  uses (the default declaration is none) refuses the model at bind, on any machine.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from hypothesis import given, strategies as st

from varlen import registry
from varlen.attention_api import AttentionBackend, LayerAttention
from backends.flash_attn import FlashAttnBackend
from backends.flashinfer import FlashInferBackend
from backends.torch_ref import TorchRefBackend
from varlen.batch import SeqSlice, build_batch
from varlen.model_attention import UnsupportedModel, spec_from_call
from varlen.model_runner import ATTN_NAME, ModelRunner, register_varlen_attention
from varlen.testing.attention import ATOL
from varlen.testing.strategies import problems
from varlen.tiny_model import WINDOW, tiny_model


def _one_prefill(n: int, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    """One request, n new tokens after 3 cached ones (block size 4), and its q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    batch = build_batch([SeqSlice(list(range(n)), 3, list(range(-(-(n + 3) // 4))))], 4, 8)
    cache = torch.zeros(2, 8, 4, hkv, d)
    k_old, v_old = torch.randn(3, hkv, d, generator=gen), torch.randn(3, hkv, d, generator=gen)
    cache[0].view(-1, hkv, d)[:3], cache[1].view(-1, hkv, d)[:3] = k_old, v_old
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    return batch, cache, q, k, v, torch.cat([k_old, k]), torch.cat([v_old, v])


def _hf_eager(fn, module, q, keys, vals, window, **kw):
    """transformers' eager attention of the n queries (the last n positions) over all keys."""
    n, length = q.shape[0], keys.shape[0]
    q_pos, k_pos = torch.arange(length - n, length)[:, None], torch.arange(length)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    mask = torch.zeros(n, length).masked_fill(~visible, float("-inf"))[None, None]
    out, _ = fn(module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], mask, **kw)
    return out[0]


@pytest.mark.parametrize("window", [None, 3])
def test_torch_ref_softcap_and_window_are_gemma2s(window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    batch, cache, q, k, v, keys, vals = _one_prefill(6)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    want = _hf_eager(eager_attention_forward, module, q, keys, vals, window, scaling=0.7, softcap=1.5)
    spec = LayerAttention(0.7, sliding_window=window, softcap=1.5)
    ref = TorchRefBackend()
    got = ref.forward(q, k, v, cache, ref.prepare(batch, "cpu"), 0.7, layer=spec)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    plain = ref.forward(q, k, v, cache.clone(), ref.prepare(batch, "cpu"), 0.7, layer=LayerAttention(0.7, window))
    assert (plain - want).abs().max() > 1e-2  # the soft-cap bites at these values


@pytest.mark.parametrize("window", [None, 2])
def test_torch_ref_sinks_are_gpt_oss(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    batch, cache, q, k, v, keys, vals = _one_prefill(5)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    want = _hf_eager(eager_attention_forward, module, q, keys, vals, window, scaling=0.35)
    ref = TorchRefBackend()
    got = ref.forward(q, k, v, cache, ref.prepare(batch, "cpu"), 0.35,
                      layer=LayerAttention(0.35, sliding_window=window, sinks=module.sinks))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("batch_invariant", [False, True])
@given(p=problems(), window=st.integers(1, 12))
def test_torch_sdpa_windows_match_torch_ref(p, window, batch_invariant):
    spec = LayerAttention(p["scale"], sliding_window=window)
    ref = TorchRefBackend()
    want = ref.forward(p["q"], p["k"], p["v"], p["cache"].clone(), ref.prepare(p["batch"], "cpu"), p["scale"],
                       layer=spec)
    sdpa = registry.build("backend", "torch_sdpa", batch_invariant=batch_invariant)
    hkv, d = p["k"].shape[1:]
    # Two kinds of layer, as alternating models have: the metadata carries a mask for each.
    sdpa.bind(p["q"].shape[1], hkv, d, torch.float32, p["batch"].block_size, "cpu", [spec, LayerAttention(p["scale"])])
    meta = sdpa.prepare(p["batch"], "cpu")
    got = sdpa.forward(p["q"], p["k"], p["v"], p["cache"].clone(), meta, p["scale"], layer=spec)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    full = sdpa.forward(p["q"], p["k"], p["v"], p["cache"].clone(), meta, p["scale"])
    full_ref = ref.forward(p["q"], p["k"], p["v"], p["cache"].clone(), ref.prepare(p["batch"], "cpu"), p["scale"])
    torch.testing.assert_close(full, full_ref, atol=ATOL, rtol=0)
    # Neither reads a block wholly behind the window (the allocator may have given it away):
    # NaN there changes nothing. (Block 0 excepted: torch_sdpa pads decode groups with it, masked.)
    b, poisoned = p["batch"], p["cache"].clone()
    for i, (length, n) in enumerate(zip(b.seq_lens.tolist(), b.query_lens.tolist())):
        behind = max(0, length - n - window + 1) // b.block_size
        for blk in b.block_tables[i, :behind].tolist():
            if blk != 0:
                poisoned[:, blk] = float("nan")
    for backend, m in ((sdpa, meta), (ref, ref.prepare(b, "cpu"))):
        again = backend.forward(p["q"], p["k"], p["v"], poisoned.clone(), m, p["scale"], layer=spec)
        torch.testing.assert_close(again, want, atol=ATOL, rtol=0, msg=lambda e: f"{backend.name} read a freed block: {e}")


@pytest.mark.parametrize("long_min", [64, 3])  # 3: most requests take torch_paged's SDPA split
@given(p=problems(), window=st.one_of(st.none(), st.integers(1, 12)), softcap=st.sampled_from([None, 0.7, 3.0]),
       sinks=st.booleans(), batch_invariant=st.booleans())
def test_torch_paged_features_match_torch_ref(p, window, softcap, sinks, batch_invariant, long_min):
    """Windows, soft-caps and sinks in torch_paged's C kernel (and windows in its SDPA split),
    alone and together, equal torch_ref's; no block wholly behind a window is read."""
    import backends.torch_paged as tp

    hq, hkv, d = p["q"].shape[1], *p["k"].shape[1:]
    sink_logits = torch.linspace(-2.0, 3.0, hq) if sinks else None
    spec = LayerAttention(p["scale"], sliding_window=window, softcap=softcap, sinks=sink_logits)
    ref = TorchRefBackend()
    want = ref.forward(p["q"], p["k"], p["v"], p["cache"].clone(), ref.prepare(p["batch"], "cpu"), p["scale"],
                       layer=spec)
    paged = registry.build("backend", "torch_paged", batch_invariant=batch_invariant)
    assert paged.uses_kernel
    paged.bind(hq, hkv, d, torch.float32, p["batch"].block_size, "cpu", [spec, LayerAttention(p["scale"])])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp, "LONG_SDPA_MIN", long_min)
        meta = paged.prepare(p["batch"], "cpu")
    got = paged.forward(p["q"], p["k"], p["v"], tp.from_nhd(p["cache"]), meta, p["scale"], layer=spec)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    full = paged.forward(p["q"], p["k"], p["v"], tp.from_nhd(p["cache"]), meta, p["scale"])
    full_ref = ref.forward(p["q"], p["k"], p["v"], p["cache"].clone(), ref.prepare(p["batch"], "cpu"), p["scale"])
    torch.testing.assert_close(full, full_ref, atol=ATOL, rtol=0)
    if window is not None:
        b, poisoned = p["batch"], p["cache"].clone()
        for i, (length, n) in enumerate(zip(b.seq_lens.tolist(), b.query_lens.tolist())):
            behind = max(0, length - n - window + 1) // b.block_size
            poisoned[:, b.block_tables[i, :behind].tolist()] = float("nan")
        again = paged.forward(p["q"], p["k"], p["v"], tp.from_nhd(poisoned), meta, p["scale"], layer=spec)
        torch.testing.assert_close(again, want, atol=ATOL, rtol=0, msg=lambda e: f"torch_paged read a freed block: {e}")


# ------------------------------------------------------------------------------- refusals

Q, K, V = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8)


@pytest.mark.parametrize("kwargs,words", [
    (dict(new_feature=3), ["'new_feature'", "implements"]),
    (dict(dropout=0.1), ["dropout=0.1", "supported: dropout=0.0"]),
    (dict(is_causal=False), ["is_causal=False"]),
    (dict(output_attentions=True), ["output_attentions=True"]),
])
def test_unknown_or_changed_keywords_are_refused(kwargs, words):
    with pytest.raises(UnsupportedModel) as info:
        spec_from_call(torch.nn.Module(), Q, K, V, dict(scaling=0.5, **kwargs))
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_known_keywords_become_the_layer_spec():
    sinks = torch.nn.Parameter(torch.ones(4))
    spec = spec_from_call(torch.nn.Module(), Q, K, V, dict(scaling=0.5, sliding_window=8, softcap=30.0, s_aux=sinks,
                                                          dropout=0.0, position_ids=None, new_feature=None))
    assert spec == LayerAttention(0.5, 8, 30.0) and spec.sinks is sinks
    assert spec.features == {"sliding_window", "softcap", "sinks"}
    assert spec_from_call(torch.nn.Module(), Q, K, V, {}) == LayerAttention(8 ** -0.5)
    with pytest.raises(UnsupportedModel, match="value head dim 4"):
        spec_from_call(torch.nn.Module(), Q, K, V[..., :4], {})


def _varlen_model(arch: str, **overrides):
    register_varlen_attention()
    return tiny_model(arch, attn_implementation=ATTN_NAME, **overrides)


def test_a_new_keyword_from_the_model_is_refused_at_load():
    model = _varlen_model("llama")
    attn = model.model.layers[1].self_attn
    attn.forward = partial(attn.forward, new_feature=3)  # as a newer transformers might pass
    with pytest.raises(UnsupportedModel) as info:
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    assert str(info.value).startswith("LlamaForCausalLM: ") and "'new_feature'" in str(info.value)


def test_layers_without_attention_and_recurrent_mixers_are_refused():
    model = _varlen_model("llama")
    model.model.layers[1].self_attn.forward = lambda hidden_states, *a, **kw: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModel, match=r"layer\(s\) \[1\] never call the attention interface"):
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)

    class FakeMambaMixer(torch.nn.Module):
        pass

    model = _varlen_model("llama")
    model.model.layers[0].mixer = FakeMambaMixer()
    with pytest.raises(UnsupportedModel, match="FakeMambaMixer layers"):
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    model = _varlen_model("llama")
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(UnsupportedModel, match="layer 0 is not causal"):
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    model = _varlen_model("llama").train()
    with pytest.raises(UnsupportedModel, match="training mode"):
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)


def test_a_call_that_differs_from_what_was_bound_is_refused():
    model = _varlen_model("mistral")
    runner = ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    batch = build_batch([SeqSlice([5, 6, 7], 0, [0])], 4, 8)
    runner.execute(batch)
    model.config.sliding_window = WINDOW // 2  # Mistral reads its window from the config at every call
    with pytest.raises(UnsupportedModel, match="bound to"):
        runner.execute(batch)


def test_backends_that_do_not_declare_a_feature_refuse_models_that_use_it():
    assert AttentionBackend.features == frozenset()  # the default: none

    class Undeclared(TorchRefBackend):  # e.g. a new backend that declares nothing
        name = "undeclared"
        features = AttentionBackend.features

    model = _varlen_model("mistral")
    with pytest.raises(ValueError) as info:
        ModelRunner(model, Undeclared(), 4, 8)
    msg = str(info.value)
    assert "\n" not in msg and "MistralForCausalLM" in msg and "layer(s) 0-1 use sliding_window" in msg \
        and "none of the optional features" in msg, msg
    ModelRunner(_varlen_model("llama"), Undeclared(), 4, 8)  # plain models still run
    gpt_oss = _varlen_model("gpt_oss")
    for backend in (registry.build("backend", "torch_sdpa"), FlashAttnBackend(), FlashInferBackend()):
        with pytest.raises(ValueError, match=f"use sinks, which backend '{backend.name}' does not implement"):
            ModelRunner(gpt_oss, backend, 4, 8) if backend.name == "torch_sdpa" else \
                backend.bind(4, 2, 16, torch.float16, 256, "cuda", ModelRunner(gpt_oss, TorchRefBackend(), 4, 8).layers)


@pytest.mark.parametrize("arch,window", [("mistral", WINDOW), ("gemma3_text", WINDOW), ("qwen2", None),
                                         ("gpt_oss", None), ("llama", None)])
def test_kv_window_is_the_widest_window_or_none(arch, window):
    assert ModelRunner(_varlen_model(arch), TorchRefBackend(), 4, 8).kv_window == window


# ------------------------------------------------------- on a GPU: the real kernels' features

@pytest.mark.gpu
@pytest.mark.parametrize("name", __import__("test_gpu_backends").BACKENDS)
@given(data=st.data())
def test_gpu_kernels_windows_and_softcaps_match_torch_ref(name, data):
    """flash-attn / FlashInfer with window_size / window_left and softcap / logits_soft_cap, and
    triton's compiled kernel with windows, soft-caps and sinks, on the device, against torch_ref
    (skips with the backend's own reason where it cannot run)."""
    from test_gpu_backends import ATOL as GPU_ATOL, BLOCK_SIZES, HKV, HQ, D, gpu_steps

    dtype, dev = torch.bfloat16, torch.device("cuda")
    batch, pool = data.draw(gpu_steps(BLOCK_SIZES[name]))
    spec = LayerAttention(D ** -0.5, sliding_window=data.draw(st.sampled_from([1, 7, 64, 300]), label="window"),
                          softcap=data.draw(st.sampled_from([None, 5.0, 30.0]), label="softcap"))
    if "sinks" in registry.target("backend", name).features and data.draw(st.booleans(), label="sinks"):
        spec = dataclasses.replace(spec, sinks=torch.linspace(-2.0, 3.0, HQ, device=dev))
    gen = torch.Generator(device=dev).manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    cache = torch.randn(2, pool, batch.block_size, HKV, D, generator=gen, device=dev).to(dtype)
    q, k, v = (torch.randn(batch.num_tokens, h, D, generator=gen, device=dev).to(dtype) for h in (HQ, HKV, HKV))
    backend, ref = registry.build("backend", name), TorchRefBackend()
    backend.bind(HQ, HKV, D, dtype, batch.block_size, dev, [spec])
    got = backend.forward(q, k, v, cache.clone(), backend.prepare(batch, dev), spec.scale, layer=spec)
    want = ref.forward(q, k, v, cache.clone(), ref.prepare(batch, dev), spec.scale, layer=spec)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= GPU_ATOL[dtype], f"{name} {spec}: max abs error {err:.3e}"
