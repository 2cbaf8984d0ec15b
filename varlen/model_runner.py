"""Runs a stock transformers model on a flat varlen batch, with attention done by a pluggable backend.

The model is the unmodified HF module tree. The attention function "varlen", registered in
transformers' `AttentionInterface`, receives q/k/v after q/k-norm and RoPE and hands them to the
backend with the step's metadata, which travels as an extra forward() keyword. Its mask function
returns None, so no N×N mask is built (`precomputed_masks` skips even that call). The LM head runs
only at `logits_indices`. At load a probe forward reads every layer's attention
(`varlen.model_attention`) and binds the backend to it; each call must ask for what was bound.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from varlen.attention_api import AttentionBackend, LayerAttention
from varlen.batch import ForwardBatch
from varlen.layer_kernels import describe_layers, fuse_layers
from varlen.linear_kernels import MIN_PACKED_ELEMENTS, ONEDNN, describe_linears, make_batch_invariant, pack_linears
from varlen.model_attention import (ACTIVE_PROBE, AttentionProbe, UnsupportedModel, kv_window, read_model_attention,
                                    spec_from_call)

ATTN_NAME = "varlen"


@dataclass
class StepContext:
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    meta: Any
    layers: list[LayerAttention]  # as bound: what each layer's calls must ask for
    layer_kwargs: list[dict[str, Any]]  # extra forward() keywords per layer: {"layer": spec} if it has features


def _varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    ctx: StepContext | AttentionProbe | None = kwargs.get("varlen_ctx")
    if isinstance(ctx, AttentionProbe):
        features = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux)
        return ctx.record(module, query, key, value, {**features, **kwargs}), None
    if ctx is None:
        if ACTIVE_PROBE.get() is not None:
            raise UnsupportedModel(f"{type(module).__name__} does not pass the model's forward keywords to its "
                                   f"attention function, so the step's metadata cannot reach it; supported: "
                                   f"modules that do (the transformers attention interface)")
        raise RuntimeError("the 'varlen' attention was called without a step context; "
                           "run the model through varlen.ModelRunner")
    layer = module.layer_idx
    spec = ctx.layers[layer]
    # What was bound is what runs: anything else is refused, never silently dropped.
    if (sliding_window != spec.sliding_window or softcap != spec.softcap or s_aux is not spec.sinks
            or (scaling is not None and scaling != spec.scale) or kwargs.get("dropout")
            or kwargs.keys() - _QUIET):
        called = spec_from_call(module, query, key, value, dict(
            kwargs, scaling=scaling, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux))
        if called != spec or called.sinks is not spec.sinks:
            raise UnsupportedModel(f"layer {layer} asked for {called} but was bound to {spec} at load; "
                                   f"reload the model through varlen.ModelRunner")
    # HF hands us [1, heads, N, D]; backends speak the flat [N, heads, D].
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = ctx.backend.forward(q, k, v, ctx.kv_caches[layer], ctx.meta, spec.scale, **ctx.layer_kwargs[layer])
    return out.unsqueeze(0), None


# Keywords a normal call carries that need no further check (dropout is checked to be 0 above).
_QUIET = frozenset({"varlen_ctx", "position_ids", "cache_position", "use_cache", "output_router_logits", "dropout"})


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def precomputed_masks(model: torch.nn.Module) -> dict[str, None] | None:
    """The `attention_mask` mapping ({layer type: None}) that spares the model building masks our
    mask function discards, or None when a probe forward with and without it differs."""
    types = set(getattr(model.config, "layer_types", None) or ()) | {"full_attention", "sliding_attention"}
    masks: dict[str, None] = {t: None for t in sorted(types)}
    dev = next(model.parameters()).device
    seen = []
    for extra in ({}, {"attention_mask": masks}):
        probe = AttentionProbe()
        token = ACTIVE_PROBE.set(probe)
        try:
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([[1, 2]], device=dev), position_ids=torch.tensor([[0, 1]], device=dev),
                            logits_to_keep=1, use_cache=False, varlen_ctx=probe, **extra)
        except Exception:  # noqa: BLE001 - a model that does not take the mapping: build masks as before
            return None
        finally:
            ACTIVE_PROBE.reset(token)
        seen.append((probe.calls, probe.shapes, out.logits))
    (calls0, shapes0, logits0), (calls1, shapes1, logits1) = seen
    if calls0 != calls1 or shapes0 != shapes1 or not torch.equal(logits0, logits1):
        return None
    return masks


# model -> (what its answer depends on, the answer): tests build hundreds of runners over one loaded
# model, and these two probe forwards were most of a runner's set-up. Weak: a dropped model goes.
_MASKS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[str, None] | None]] = weakref.WeakKeyDictionary()


def shared_precomputed_masks(model: torch.nn.Module) -> dict[str, None] | None:
    """precomputed_masks(model), probed once per model while its config, module classes, device and
    dtype stay the same; the mapping returned is the caller's own."""
    param = next(model.parameters())
    key = (repr(model.config.to_dict()), model.config._attn_implementation, param.device, param.dtype,
           tuple(type(m) for m in model.modules()))
    hit = _MASKS.get(model)
    if hit is None or hit[0] != key:
        hit = _MASKS[model] = (key, precomputed_masks(model))
    return None if hit[1] is None else dict(hit[1])


def register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _varlen_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def load_model(path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str,
               attn_implementation: str = ATTN_NAME) -> torch.nn.Module:
    """Load a local HF folder (config.json + safetensors), never touching the network."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json); "
                                f"use model=tiny or write one with `python -m varlen.tiny_model DIR`")
    if attn_implementation == ATTN_NAME:
        register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
        use_safetensors=True)
    return model.to(device).eval()


class ModelRunner:
    """Model + attention backend + paged KV cache: `execute(batch)` returns logits [M, vocab]."""

    def __init__(self, model: str | os.PathLike | torch.nn.Module, backend: AttentionBackend, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 linear_kernel: str = "auto"):
        """`model`: a local HF folder, or a model loaded by `load_model` (shared, e.g. by tests).
        A batch-invariant backend also gets the model's GEMMs in fixed shapes here.
        `linear_kernel`: auto, onednn or torch (varlen/linear_kernels.py)."""
        self.device = torch.device(device)
        self.dtype = dtype
        backend.check(self.device, dtype, block_size)
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        if isinstance(model, torch.nn.Module):
            if model.config._attn_implementation != ATTN_NAME:
                raise ValueError("a preloaded model must be loaded with load_model(..., attn_implementation='varlen')")
            self.model = model
        else:
            self.model = load_model(model, dtype, self.device)
        if backend.batch_invariant:
            if linear_kernel == "onednn":
                raise ValueError("linear_kernel=onednn: a batch-invariant backend computes the linear layers in "
                                 "fixed 16-row tiles with F.linear; use linear_kernel=auto or torch")
            make_batch_invariant(self.model)
        elif linear_kernel in ("auto", "onednn"):
            got = pack_linears(self.model, self.device, dtype,
                               min_elements=0 if linear_kernel == "onednn" else MIN_PACKED_ELEMENTS)
            if linear_kernel == "onednn" and got != ONEDNN:
                raise ValueError(f"linear_kernel=onednn: the linear layers run on {got}; "
                                 f"use linear_kernel=auto or torch")
        elif linear_kernel != "torch":
            raise ValueError(f"linear_kernel={linear_kernel!r}: must be auto, onednn or torch")
        # Norms, residual adds and the MLP activation on fused kernels (varlen/layer_kernels.py);
        # before the attention probe below, so that load-time forward runs the fused code too.
        self._layers_fused = fuse_layers(self.model, self.device, dtype)
        model_path = getattr(self.model.config, "_name_or_path", "model")
        cfg = self.model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        attn = read_model_attention(self.model, "varlen_ctx")
        self.layers = attn.layers
        # The shapes the modules really use (GPT-2-style configs carry no KV head count).
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        backend.bind(attn.num_q_heads, self.num_kv_heads, self.head_dim, dtype, block_size, self.device,
                     self.layers, model_name=f"{type(self.model).__name__} ({model_path})")
        self.layer_kwargs = [{"layer": spec} if spec.features else {} for spec in self.layers]
        masks = shared_precomputed_masks(self.model)
        self.forward_kwargs: dict[str, Any] = {"attention_mask": masks} if masks is not None else {}
        self.kv_caches = backend.allocate_kv_cache(self.num_layers, num_blocks, block_size, self.num_kv_heads,
                                                   self.head_dim, dtype, self.device)

    @property
    def linear_kernel(self) -> str:
        """What computes the model's linear layers (read from the model: see describe_linears)."""
        return describe_linears(self.model)

    @property
    def layer_kernels(self) -> str:
        """What runs the norms, residual adds and MLP activation (read from the model: see
        describe_layers), with the reason when nothing is fused."""
        now = describe_layers(self.model)
        return self._layers_fused if now == "none" and self._layers_fused != "none" else now

    @property
    def kv_window(self) -> int | None:
        """Trailing positions every layer may still read (None: the whole context); see kv_window."""
        return kv_window(self.layers)

    def check_kv_allocator(self, kv: Any) -> None:
        """Refuse an allocator that frees K/V this model's layers still read."""
        freed_after = getattr(kv, "sliding_window", None)
        if freed_after is None:
            return
        need = self.kv_window
        if need is None or freed_after < need:
            why = ("some layers attend to the whole context, so nothing may be freed early" if need is None
                   else f"its widest window is {need}")
            fix = "use allocator=paged" if need is None else f"set allocator.sliding_window={need}"
            raise ValueError(f"allocator sliding_window={freed_after} frees K/V that "
                             f"{type(self.model).__name__} still reads ({why}); {fix}")

    @staticmethod
    def kv_bytes_per_block(config: Any, block_size: int, dtype: torch.dtype) -> int:
        """From the config (before loading; a config without a KV head count is multi-head)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * elem

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.block_size != self.block_size:
            raise ValueError(f"batch built for block size {batch.block_size}, cache has {self.block_size}")
        if batch.block_tables.size and int(batch.block_tables.max()) >= self.num_blocks:
            raise ValueError(f"block table refers to block {int(batch.block_tables.max())} but the "
                             f"KV pool has {self.num_blocks} blocks")
        dev = self.device
        ctx = StepContext(self.backend, self.kv_caches, self.backend.prepare(batch, dev), self.layers,
                          self.layer_kwargs)
        input_ids = torch.from_numpy(batch.input_ids).to(dev, non_blocking=True)[None]
        positions = torch.from_numpy(batch.positions).to(dev, non_blocking=True)[None]
        keep = torch.from_numpy(batch.logits_indices).to(dev, non_blocking=True)
        out = self.model(input_ids=input_ids, position_ids=positions, logits_to_keep=keep,
                         use_cache=False, varlen_ctx=ctx, **self.forward_kwargs)
        return out.logits[0]
