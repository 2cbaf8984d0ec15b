"""The hardware a step runs on and the shape of the model it runs: every cost model's inputs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping


def hardware_dir() -> Path:
    """conf/hardware/ (found from varlen.registry: compiled, this file is in the build cache)."""
    from varlen.registry import conf_dir

    return conf_dir("hardware")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """Peak figures from datasheets plus the achievable fraction of each (the efficiencies)."""

    name: str
    peak_tflops: float  # dense matmul TFLOP/s at dtype_bytes (no sparsity)
    mem_bandwidth_gbs: float  # GB/s (1e9 bytes)
    memory_gb: float  # device memory, GB (1e9 bytes)
    flops_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.85
    step_overhead_s: float = 0.0  # fixed per-step cost: scheduling, launches, sampling
    dtype_bytes: int = 2
    estimated: bool = False  # estimates, not datasheet values
    profile_gpu: str | None = None  # its name in measured operator tables (cost.model=measured)
    node: str | None = None  # the node it sits in, for collective tables (tensor/pipeline parallelism)
    cost_per_gpu_hour: float | None = None  # USD, an estimate (python -m sim.search); None: no price

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12 * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        return self.mem_bandwidth_gbs * 1e9 * self.bandwidth_efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareSpec:
        names = {f.name for f in fields(cls)}
        unknown = [k for k in d if not str(k).startswith("_") and k not in names]
        if unknown:
            raise ValueError(f"unknown hardware fields {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> HardwareSpec:
        import yaml  # type: ignore[import-untyped]

        p = Path(name_or_path)
        if p.suffix not in (".yaml", ".yml"):
            p = hardware_dir() / f"{name_or_path}.yaml"
        if not p.is_file():
            known = sorted(x.stem for x in hardware_dir().glob("*.yaml"))
            raise FileNotFoundError(f"no hardware spec {name_or_path!r} (known: {', '.join(known)})")
        return cls.from_dict(yaml.safe_load(p.read_text()))

    @classmethod
    def coerce(cls, hw: str | os.PathLike | Mapping[str, Any] | HardwareSpec) -> HardwareSpec:
        if isinstance(hw, HardwareSpec):
            return hw
        if isinstance(hw, Mapping):
            return cls.from_dict(hw)
        return cls.load(hw)



#: model_types whose MLP is two matrices (up, down) rather than Llama's gated three (gate, up, down).
NON_GATED = ("phi", "gpt2", "gpt_neox", "opt", "falcon", "bloom", "gpt_bigcode", "gptj", "starcoder2", "codegen")
#: model_types whose MLP width defaults to 4 x hidden when the config leaves it unset (their HF defaults).
FOUR_X_MLP = ("gpt2", "gptj", "falcon", "gpt_bigcode", "codegen", "bloom")
#: model_types with a learned position-embedding table (no RoPE): weights and an embedding-row read.
LEARNED_POSITIONS = ("opt", "gpt2", "gpt_bigcode")
#: Where HF configs put each number; the first one present wins. Standard names come first so the
#: shard written by sim.parallel.shard_config (which sets the standard names) overrides the aliases.
_FIELDS = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "intermediate": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "positions": ("max_position_embeddings", "n_positions"),
}


def _field(cfg: Mapping[str, Any], what: str) -> Any:
    for k in _FIELDS[what]:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a dense decoder that set its cost: Llama-style gated MLPs (3 matrices) or OPT /
    GPT-2 / GPT-NeoX / Falcon / Phi-2 plain ones (2). Parallel attention/MLP blocks do the same FLOPs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    gated: bool = True
    position_embeddings: int = 0  # rows of a learned position table; 0 for RoPE / ALiBi

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        cfg = dict(cfg)
        if "text_config" in cfg:  # multimodal wrappers
            cfg = dict(cfg["text_config"])
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if experts and experts > 1:
            raise ValueError(f"mixture-of-experts configs ({experts} experts) are not modelled yet; use a dense "
                             f"model's config for sim_model")
        model_type = str(cfg.get("model_type", "llama"))
        hidden, heads, layers = _field(cfg, "hidden"), _field(cfg, "heads"), _field(cfg, "layers")
        for what, value in (("hidden", hidden), ("heads", heads), ("layers", layers)):
            if value is None:
                raise ValueError(f"model config lacks {_FIELDS[what][0]!r} (or {', '.join(map(repr, _FIELDS[what][1:]))}); "
                                 f"add it to sim_model.config")
        if cfg.get("vocab_size") is None:
            raise ValueError("model config lacks 'vocab_size'; add it to sim_model.config")
        hidden, heads = int(hidden), int(heads)
        intermediate = _field(cfg, "intermediate")
        if intermediate is None and model_type in FOUR_X_MLP:
            intermediate = 4 * hidden
        if intermediate is None:
            raise ValueError(f"model config lacks 'intermediate_size' (the MLP's inner width; also read from "
                             f"'ffn_dim', 'n_inner', 'ffn_hidden_size'); add it to sim_model.config")
        kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads")
        if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
            kv_heads = 1 if cfg.get("multi_query", True) else heads  # Falcon's HF default is multi-query
        learned = model_type in LEARNED_POSITIONS
        positions = _field(cfg, "positions") if learned else 0
        return cls(
            hidden=hidden,
            intermediate=int(intermediate),
            layers=int(layers),
            heads=heads,
            kv_heads=int(kv_heads or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", learned)),
            gated=model_type not in NON_GATED,
            position_embeddings=int(positions or 0),
        )

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        mlp = self.mlp_matrices * h * self.intermediate
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params
        positions = self.position_embeddings * self.hidden
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden + positions

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_dim * dtype_bytes


def load_model_config(model_config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """An HF config dict from a mapping, a config.json (or its folder), or "tiny[-arch]"."""
    if isinstance(model_config, Mapping):
        return dict(model_config)
    s = str(model_config)
    if s == "tiny" or s.startswith("tiny-"):
        from varlen.tiny_model import ARCHITECTURES, TINY_SHAPE

        arch = s.partition("-")[2] or "qwen3"
        return {**TINY_SHAPE, **ARCHITECTURES[arch], "vocab_size": 512}
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


