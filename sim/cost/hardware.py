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
    # Per-step engine cost (scheduling, input preparation, launches, sampling, output processing):
    # base + per request in the batch + per request with more than one new token (sim.profile's form).
    step_overhead_s: float = 0.0
    step_overhead_per_seq_s: float = 0.0
    step_overhead_per_prefill_s: float = 0.0
    dtype_bytes: int = 2
    estimated: bool = False  # estimates, not datasheet values
    profile_gpu: str | None = None  # its name in measured operator tables (cost.model=measured)
    node: str | None = None  # the node it sits in, for collective tables (tensor/pipeline parallelism)
    cost_per_gpu_hour: float | None = None  # USD, an estimate (python -m sim.search); None: no price

    def step_overhead(self, num_seqs: int, num_prefills: int) -> float:
        """The engine's cost of one step of `num_seqs` requests, `num_prefills` of them prefills."""
        return self.step_overhead_s + self.step_overhead_per_seq_s * num_seqs + self.step_overhead_per_prefill_s * num_prefills

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
        # Checked before construction: a compiled dataclass refuses a wrong type with a bare TypeError.
        for k in ("step_overhead_s", "step_overhead_per_seq_s", "step_overhead_per_prefill_s"):
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"hardware {d.get('name')!r}: {k}={v!r} must be a number of seconds >= 0")
        kw: dict[str, Any] = {k: (float(v) if k.startswith("step_overhead") else v) for k, v in d.items() if k in names}
        return cls(**kw)

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
#: model_types whose attention is multi-query (one KV head) unless the config says otherwise (HF defaults).
MULTI_QUERY = ("gpt_bigcode",)
#: model_types with state-space or recurrent layers: no attention KV cache to cost; refused by name.
RECURRENT = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "rwkv", "recurrent_gemma", "xlstm",
             "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2")
#: Where HF configs put each number; the first one present wins. Standard names come first so the
#: shard written by sim.parallel.shard_config (which sets the standard names) overrides the aliases.
_FIELDS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "n_embed"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "intermediate": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "positions": ("max_position_embeddings", "n_positions"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
}
#: Expert widths sim.parallel.shard_config divides by TP (each expert is split over the TP group,
#: as vLLM does without expert parallelism); intermediate_size is divided anyway.
MOE_WIDTH_FIELDS = ("moe_intermediate_size", "shared_expert_intermediate_size")


def _field(cfg: Mapping[str, Any], what: str) -> Any:
    for k in _FIELDS[what]:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def expected_experts_touched(tokens: Any, experts: int, top_k: int) -> Any:
    """Distinct experts `tokens` tokens route to, in expectation, when each picks `top_k` of `experts`
    uniformly at random (independent tokens): an expert is missed by one token with probability
    1 - k/E, so E x (1 - (1 - k/E)^t). 0 tokens touch none, 1 touches k, many touch all E."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _moe_layers(cfg: Mapping[str, Any], layers: int) -> int:
    """How many of the layers hold the expert block: DeepSeek's first_k_dense_replace and moe_layer_freq,
    Qwen-MoE's decoder_sparse_step and mlp_only_layers; every layer otherwise (Mixtral, OLMoE, ...)."""
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return sum(1 for i in range(layers) if i >= dense_first and i % freq == 0 and (i + 1) % step == 0
               and i not in only_mlp)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a decoder that set its cost: Llama-style gated MLPs (3 matrices) or OPT /
    GPT-2 / GPT-NeoX / Falcon / Phi-2 plain ones (2); parallel attention/MLP blocks do the same FLOPs.
    Mixture of experts (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...): `moe_layers` of the layers hold a
    router, `experts` gated experts of width `expert_intermediate` of which `experts_per_token` run
    per token, and shared experts of total width `shared_intermediate`; the others a dense MLP of
    width `intermediate`."""

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
    experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # summed width of the shared experts (always run)
    moe_layers: int = 0
    router_outputs: int = 0  # the router's logits (experts, plus Qwen2-MoE's shared-expert gate)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        cfg = dict(cfg)
        if "text_config" in cfg:  # multimodal wrappers
            cfg = dict(cfg["text_config"])
        model_type = str(cfg.get("model_type", "llama"))
        if model_type in RECURRENT:
            raise ValueError(f"model_type {model_type!r} has state-space or recurrent layers, which the cost models do "
                             f"not time (they cost attention decoders with a KV cache); give a transformer decoder's "
                             f"config as sim_model.config")
        hidden, heads, layers = _field(cfg, "hidden"), _field(cfg, "heads"), _field(cfg, "layers")
        for what, value in (("hidden", hidden), ("heads", heads), ("layers", layers)):
            if value is None:
                raise ValueError(f"model config lacks {_FIELDS[what][0]!r} (or {', '.join(map(repr, _FIELDS[what][1:]))}); "
                                 f"add it to sim_model.config")
        if cfg.get("vocab_size") is None:
            raise ValueError("model config lacks 'vocab_size'; add it to sim_model.config")
        if cfg.get("kv_lora_rank") is not None:
            raise ValueError(f"model config sets 'kv_lora_rank'={cfg['kv_lora_rank']} (DeepSeek's multi-head latent "
                             f"attention), which is not modelled; set sim_model.config.kv_lora_rank=null to cost it as "
                             f"standard attention with num_key_value_heads (an approximation: its KV cache is smaller)")
        hidden, heads, layers = int(hidden), int(heads), int(layers)
        experts = int(_field(cfg, "experts") or 0)
        moe = experts > 1 and _moe_layers(cfg, layers) > 0
        intermediate = _field(cfg, "intermediate")
        if intermediate is None and model_type in FOUR_X_MLP:
            intermediate = 4 * hidden
        if intermediate is None and not (moe and cfg.get("moe_intermediate_size") and _moe_layers(cfg, layers) == layers):
            raise ValueError(f"model config lacks 'intermediate_size' (the MLP's inner width; also read from "
                             f"'ffn_dim', 'n_inner', 'ffn_hidden_size'); add it to sim_model.config")
        kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads")
        if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
            kv_heads = 1 if cfg.get("multi_query", True) else heads  # Falcon's HF default is multi-query
        if model_type in MULTI_QUERY and cfg.get("multi_query", True):
            kv_heads = 1
        learned = model_type in LEARNED_POSITIONS
        positions = _field(cfg, "positions") if learned else 0
        gated = model_type not in NON_GATED
        moe_fields: dict[str, int] = {}
        if moe:
            moe_fields = cls._moe_fields(cfg, model_type, layers, experts, intermediate, gated)
        return cls(
            hidden=hidden,
            intermediate=int(intermediate or 0),
            layers=layers,
            heads=heads,
            kv_heads=int(kv_heads or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", learned)),
            gated=gated,
            position_embeddings=int(positions or 0),
            **moe_fields,
        )

    @staticmethod
    def _moe_fields(cfg: Mapping[str, Any], model_type: str, layers: int, experts: int, intermediate: Any,
                    gated: bool) -> dict[str, int]:
        k = cfg.get("num_experts_per_tok")
        if k is None:
            raise ValueError(f"model config has {experts} experts but lacks 'num_experts_per_tok' (the experts each "
                             f"token is routed to); add it to sim_model.config")
        if not 1 <= int(k) <= experts:
            raise ValueError(f"model config: num_experts_per_tok={k} must be between 1 and the {experts} experts")
        if not gated:
            raise ValueError(f"model_type {model_type!r} with {experts} experts: experts with plain (2-matrix) MLPs "
                             f"are not modelled; give the config a gated model_type (e.g. mixtral) if its experts are gated")
        width = cfg.get("moe_intermediate_size") or intermediate
        if not width:
            raise ValueError("model config has experts but lacks 'moe_intermediate_size' (or 'intermediate_size'): "
                             "each expert's inner width; add it to sim_model.config")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared += int(cfg.get("n_shared_experts") or 0) * int(width)  # DeepSeek: n shared experts of the same width
        gate = 1 if shared and model_type == "qwen2_moe" else 0  # Qwen2-MoE gates its shared expert
        return dict(experts=experts, experts_per_token=int(k), expert_intermediate=int(width),
                    shared_intermediate=shared, moe_layers=_moe_layers(cfg, layers), router_outputs=experts + gate)

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

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
    def attention_params(self) -> int:
        h = self.hidden
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h

    @property
    def dense_layer_params(self) -> int:
        """A layer with a dense MLP: projections, MLP and two norms."""
        return self.attention_params + self.mlp_matrices * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def moe_active_mlp_params(self) -> int:
        """The expert block's weights one token runs through: router, shared experts and top-k experts."""
        h, m = self.hidden, self.mlp_matrices
        return h * self.router_outputs + m * h * self.shared_intermediate + self.experts_per_token * m * h * self.expert_intermediate

    @property
    def expert_params(self) -> int:
        """One routed expert's weights."""
        return self.mlp_matrices * self.hidden * self.expert_intermediate

    @property
    def moe_layer_params(self) -> int:
        """A layer with the expert block, every expert counted (all are in memory)."""
        h, m = self.hidden, self.mlp_matrices
        return (self.attention_params + h * self.router_outputs + m * h * self.shared_intermediate
                + self.experts * self.expert_params + 2 * h)

    @property
    def layer_params(self) -> int:
        """One layer's weights: the largest layer's in a mixture of experts (sim.parallel sizes pipeline
        stages by it: an upper bound there)."""
        return self.moe_layer_params if self.is_moe else self.dense_layer_params

    @property
    def all_layer_params(self) -> int:
        return self.dense_layers * self.dense_layer_params + self.moe_layers * self.moe_layer_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params
        positions = self.position_embeddings * self.hidden
        return self.all_layer_params + self.embedding_params + head + self.hidden + positions

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


