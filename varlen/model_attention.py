"""What a model's attention needs, read from the model itself: one `LayerAttention` per layer.
A two-token probe forward records what each layer really passes (config fields mislead: Gemma 3
has a softcap it never passes); anything varlen does not implement is refused at load."""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from varlen.attention_api import LayerAttention

# Keywords the varlen function implements (they become the layer's LayerAttention).
IMPLEMENTED = frozenset({"scaling", "sliding_window", "softcap", "s_aux"})
# name -> (the allowed value, as errors name it; the check)
REQUIRED = {"dropout": ("0.0", lambda v: not v), "is_causal": ("True", lambda v: v is None or v is True),
            "output_attentions": ("False", lambda v: not v)}
# Arguments of the model's forward that transformers passes along; attention needs none of them.
PASSTHROUGH = frozenset({"varlen_ctx", "position_ids", "cache_position", "use_cache", "output_router_logits",
                         "past_key_values", "past_key_value", "logits_to_keep"})
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_LAYER_KINDS = {"linear_attention": "linear-attention / state-space (Mamba) layers",
                "hybrid": "hybrid attention + state-space (Mamba) layers",
                "chunked_attention": "chunked local attention", "conv": "convolution layers"}
# Mixers that keep a recurrent state instead of a KV cache.
_RECURRENT = re.compile(r"Mamba|SSM|Ssm|GatedDeltaNet|LinearAttention|ShortConv|Rwkv|RWKV|Recurrent")


class UnsupportedModel(ValueError):
    """The model uses an attention feature (or a layer kind) that varlen does not implement."""


def architecture(model: torch.nn.Module) -> str:
    return type(model).__name__


def spec_from_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   kwargs: dict[str, Any]) -> LayerAttention:
    """The LayerAttention one call asks for, or UnsupportedModel with a one-line reason."""
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise UnsupportedModel(
            f"query/key head dim {query.shape[-1]}/{key.shape[-1]} differs from the value head dim "
            f"{value.shape[-1]} (e.g. multi-head latent attention); varlen needs one head dim")
    for name, value_ in kwargs.items():
        if name in IMPLEMENTED or name in PASSTHROUGH:
            continue
        if name in REQUIRED:
            allowed, ok = REQUIRED[name]
            if not ok(value_):
                raise UnsupportedModel(f"attention argument {name}={_short(value_)} is not supported "
                                       f"(supported: {name}={allowed})")
            continue
        if value_ is None or value_ is False:
            continue  # an unknown feature that is off
        raise UnsupportedModel(f"attention argument {name!r} (= {_short(value_)}) is not implemented; "
                               f"varlen implements {', '.join(sorted(IMPLEMENTED))}")
    scaling = kwargs.get("scaling")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return LayerAttention(scale=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
                          sliding_window=int(window) if window is not None else None,
                          softcap=float(softcap) if softcap is not None else None,
                          sinks=kwargs.get("s_aux"))


def _short(v: Any) -> str:
    return f"tensor of shape {tuple(v.shape)}" if torch.is_tensor(v) else repr(v)[:40]


def check_config(model: torch.nn.Module) -> None:
    """Refusals that can be read off the config and the module tree, before any forward."""
    cfg, arch = model.config, architecture(model)
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - ATTENTION_LAYER_TYPES:
        bad = sorted(kinds - ATTENTION_LAYER_TYPES)
        raise UnsupportedModel(
            f"{arch}: {', '.join(_LAYER_KINDS.get(k, k) for k in bad)} (layer_types {bad}) are not supported; "
            f"varlen runs softmax attention layers ({', '.join(sorted(ATTENTION_LAYER_TYPES))})")
    if getattr(cfg, "kv_lora_rank", None):
        raise UnsupportedModel(f"{arch}: multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}) is not "
                               f"supported; varlen caches per-head K/V of standard (GQA/MHA) attention")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{arch}: bidirectional attention (use_bidirectional_attention=True) is not "
                               f"supported; varlen attention is causal")
    for m in model.modules():
        if _RECURRENT.search(type(m).__name__):
            raise UnsupportedModel(f"{arch}: {type(m).__name__} layers (state-space / linear attention, with a "
                                   f"recurrent state) are not supported; varlen runs softmax attention layers")


@dataclass(frozen=True)
class ModelAttention:
    """What the probe read: each layer's spec and the head shape, from the tensors themselves."""

    layers: list[LayerAttention]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class AttentionProbe:
    """Passed as the step context of a probe forward: the attention function records, not computes."""

    specs: dict[int, LayerAttention] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (q heads, kv heads, head dim)

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict[str, Any]) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise UnsupportedModel(f"attention module {type(module).__name__} has no layer_idx, so its KV "
                                   f"cache cannot be named")
        if getattr(module, "is_causal", True) is False:  # what SDPA-style functions read off the module
            raise UnsupportedModel(f"attention module {type(module).__name__} of layer {layer} is not causal "
                                   f"(is_causal=False); varlen attention is causal")
        self.specs[layer] = spec_from_call(module, query, key, value, kwargs)
        self.calls[layer] = self.calls.get(layer, 0) + 1
        self.shapes.add((query.shape[1], key.shape[1], key.shape[-1]))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


# The probe running here: an attention call that lost the forward's keywords is then refused.
ACTIVE_PROBE: ContextVar[AttentionProbe | None] = ContextVar("varlen_active_probe", default=None)


def read_model_attention(model: torch.nn.Module, forward_kwarg: str) -> ModelAttention:
    """Every layer's LayerAttention and the attention shape, or UnsupportedModel (one line).
    `forward_kwarg` is the model-forward keyword that carries the attention function's context."""
    check_config(model)
    arch, n_layers = architecture(model), model.config.num_hidden_layers
    if model.training:
        raise UnsupportedModel(f"{arch}: the model is in training mode (attention dropout); call model.eval()")
    probe = AttentionProbe()
    dev = next(model.parameters()).device
    token = ACTIVE_PROBE.set(probe)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2]], device=dev), position_ids=torch.tensor([[0, 1]], device=dev),
                  logits_to_keep=1, use_cache=False, **{forward_kwarg: probe})
    except UnsupportedModel as err:
        raise UnsupportedModel(f"{arch}: {err}") from None
    except Exception as err:  # noqa: BLE001 - e.g. a model that needs an attention mask or bias we never build
        first = f"{type(err).__name__}: {err}".splitlines()[0]
        raise UnsupportedModel(f"{arch}: the probe forward through the varlen attention failed ({first}); "
                               f"supported: attention through transformers' attention interface alone") from None
    finally:
        ACTIVE_PROBE.reset(token)
    missing = [i for i in range(n_layers) if i not in probe.calls]
    if missing:
        raise UnsupportedModel(f"{arch}: layer(s) {missing} never call the attention interface (attention built "
                               f"into the model, e.g. ALiBi, or state-space/linear layers); supported: softmax "
                               f"attention through transformers' attention interface")
    repeated = [i for i, c in probe.calls.items() if c != 1 or not 0 <= i < n_layers]
    if repeated:
        raise UnsupportedModel(f"{arch}: attention layer index(es) {sorted(repeated)} are called more than once "
                               f"per forward or lie outside 0..{n_layers - 1}; varlen keeps one KV cache per layer")
    if len(probe.shapes) != 1:
        raise UnsupportedModel(f"{arch}: layers differ in head counts or head dim {sorted(probe.shapes)} (q heads, "
                               f"kv heads, head dim); varlen keeps one KV cache layout for all layers")
    (num_q_heads, num_kv_heads, head_dim), = probe.shapes
    return ModelAttention([probe.specs[i] for i in range(n_layers)], num_q_heads, num_kv_heads, head_dim)


def kv_window(layers: list[LayerAttention]) -> int | None:
    """Trailing positions every layer may still read: the largest window, or None (whole context)."""
    windows = [spec.sliding_window for spec in layers]
    return None if not windows or None in windows else max(w for w in windows if w is not None)
