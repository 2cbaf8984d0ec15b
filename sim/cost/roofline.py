"""The roofline cost model: FLOPs and bytes of each operator from the model's shape."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from mypy_extensions import mypyc_attr
from numpy.typing import ArrayLike

from sim.cost.base import CostModel, StepFixed, StepSums, settings
from sim.cost.hardware import HardwareSpec, ModelShape, expected_experts_touched, load_model_config


@dataclass(slots=True)
class StepEstimate:
    time_s: float
    flops: float
    bytes: float
    compute_s: float  # sum of FLOPs / achievable FLOP/s
    memory_s: float  # sum of bytes / achievable bandwidth

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@mypyc_attr(allow_interpreted_subclasses=True)
class RooflineCostModel(CostModel):
    """A step is layers x (linear + attention) + LM head + overhead, each operator max(FLOPs / FLOP/s,
    bytes / bandwidth): per operator, so a long prefill's GEMMs cannot hide the decodes' KV reads.
    A mixture of experts' layer does its active experts' FLOPs per token and reads the weights of
    every expert the step's tokens touch (expected_experts_touched: uniform routing)."""

    def __init__(self, model_config: str | os.PathLike | Mapping[str, Any] = "tiny",
                 hardware: str | os.PathLike | Mapping[str, Any] | HardwareSpec = "h100_sxm",
                 dtype_bytes: int | None = None, overhead_s: float | None = None):
        self.shape = ModelShape.from_config(load_model_config(model_config))
        self.hardware = HardwareSpec.coerce(hardware)
        self.dtype_bytes = int(dtype_bytes if dtype_bytes is not None else self.hardware.dtype_bytes)
        # overhead_s given: that constant alone (the old form); else the hardware's base + per request + per prefill.
        hw = self.hardware
        self.overhead_s = float(overhead_s if overhead_s is not None else hw.step_overhead_s)
        self._o1 = 0.0 if overhead_s is not None else float(hw.step_overhead_per_seq_s)
        self._o2 = 0.0 if overhead_s is not None else float(hw.step_overhead_per_prefill_s)
        m, d = self.shape, self.dtype_bytes
        self._flops = self.hardware.flops
        self._bw = self.hardware.bandwidth
        self._linear_params = m.dense_layer_params - 2 * m.hidden
        self._weight_bytes_layer = m.dense_layer_params * d
        # Activation bytes a linear block moves per token (rough; matters for huge prefills only).
        self._act_bytes_token = d * (4 * m.hidden + 2 * m.q_dim + 2 * m.kv_dim + m.mlp_matrices * m.intermediate)
        self._kv_bytes_token_layer = 2 * m.kv_dim * d
        self._attn_flops_pair = 4 * m.q_dim  # QK^T and PV, 2 FLOPs per multiply-add each
        self._head_bytes = m.embedding_params * d
        # A learned position table is read like the token embedding: one row per new token.
        self._embed_rows = 2 if m.position_embeddings else 1
        # Mixture of experts: the layers with the expert block (the rest are dense, as above).
        self._moe_layers = float(m.moe_layers)
        self._dense_layers = float(m.dense_layers)
        self._moe_active_params = m.attention_params + m.moe_active_mlp_params
        self._moe_fixed_bytes = (m.moe_layer_params - m.experts * m.expert_params) * d  # all but the routed experts
        self._expert_bytes = m.expert_params * d
        self._moe_act_bytes_token = d * (4 * m.hidden + 2 * m.q_dim + 2 * m.kv_dim + m.router_outputs
                                         + m.mlp_matrices * (m.experts_per_token * m.expert_intermediate
                                                             + m.shared_intermediate))
        self.notes: list[str] = [
            f"overhead: {self.overhead_s * 1e3:.3g} ms per step + {self._o1 * 1e3:.3g} ms per request + "
            f"{self._o2 * 1e3:.3g} ms per prefill" + (" (given)" if overhead_s is not None else
                                                       f" (hardware {hw.name}: step_overhead_*)")]
        if m.is_moe:
            self.notes.insert(0, f"linear: mixture of experts in {m.moe_layers} of {m.layers} layers: "
                                 f"{m.experts_per_token} of {m.experts} experts' FLOPs per token, the weights of the "
                                 f"experts a step's tokens touch (expected, uniform routing)")

    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """The sharded shape on one GPU, with TP or PP plus the node's collectives (cost.profiles)."""
        from sim.cost.communication import CommunicationCostModel
        from sim.parallel import shard_config  # sim.parallel imports this module

        profiles = settings(options, "roofline", ("profiles",)).get("profiles")
        inner = cls(shard_config(model_config, parallel.tensor), hardware)
        if parallel.gpus == 1:
            return inner
        return CommunicationCostModel(inner, ModelShape.from_config(model_config), hardware, parallel.tensor,
                                      parallel.pipeline, profiles)

    @property
    def weight_bytes(self) -> float:
        return float(self.shape.num_params * self.dtype_bytes)

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit next to the weights in `memory_fraction` of device memory."""
        free = self.hardware.memory_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // self.shape.kv_bytes_per_token(self.dtype_bytes)))

    def linear_work(self, t: float) -> tuple[float, float]:
        """(FLOPs, bytes) of one dense layer's linear block over t tokens."""
        return 2.0 * self._linear_params * t, self._weight_bytes_layer + self._act_bytes_token * t

    def moe_linear_work(self, t: float) -> tuple[float, float]:
        """(FLOPs, bytes) of one expert layer's linear block over t tokens: projections, router, shared
        and top-k experts per token; the weights of the experts the t tokens touch, in expectation."""
        m = self.shape
        touched = expected_experts_touched(t, m.experts, m.experts_per_token) if m.experts else 0.0
        return (2.0 * self._moe_active_params * t,
                self._moe_fixed_bytes + touched * self._expert_bytes + self._moe_act_bytes_token * t)

    def linear_time(self, t: float) -> float:
        """One layer's linear block, averaged over the layers (dense and expert ones differ)."""
        F, B = self._flops, self._bw
        lin_f, lin_b = self.linear_work(t)
        lin = max(lin_f / F, lin_b / B)
        if not self._moe_layers:
            return lin
        moe_f, moe_b = self.moe_linear_work(t)
        return (self._dense_layers * lin + self._moe_layers * max(moe_f / F, moe_b / B)) / self.shape.layers

    def overhead(self, num_seqs: int, num_prefills: int) -> float:
        """The engine's per-step cost: base + per request + per prefill request."""
        return self.overhead_s + self._o1 * num_seqs + self._o2 * num_prefills

    @property
    def overhead_form(self) -> tuple[float, float, float]:
        """(seconds per step, per request, per prefill request), for sim.explain."""
        return self.overhead_s, self._o1, self._o2

    def head_work(self, t: float, rows: int) -> tuple[float, float]:
        """(FLOPs, bytes) of the LM head on `rows` logit rows, with the t tokens' embedding rows."""
        m, d = self.shape, self.dtype_bytes
        rows_read = t * m.hidden * d if self._embed_rows == 1 else self._embed_rows * t * m.hidden * d
        return 2.0 * rows * m.hidden * m.vocab, self._head_bytes + 4.0 * rows * m.vocab + rows_read

    def attention_work(self, pairs: float, cached: float, t: float) -> tuple[float, float]:
        """(FLOPs, bytes) of one layer's attention over `pairs` query-key pairs."""
        return (self._attn_flops_pair * pairs,
                self._kv_bytes_token_layer * (cached + 2.0 * t) + 2.0 * self.shape.q_dim * self.dtype_bytes * t)

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        overhead = self.overhead(num_seqs, num_prefills)
        if not new:
            return StepFixed(0.0, 0.0, overhead, num_seqs=num_seqs, linear_s=0.0, lm_head_s=0.0, overhead_s=overhead)
        F, B, L = self._flops, self._bw, self.shape.layers
        lin = self.linear_time(new)
        head_f, head_b = self.head_work(new, num_logits)
        head = max(head_f / F, head_b / B)
        return StepFixed(L, lin, head + overhead, num_seqs=num_seqs, new=new, linear_s=L * lin, lm_head_s=head,
                         overhead_s=overhead)

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        attn_f, attn_b = self.attention_work(pairs, cached, f.new)
        return max(attn_f / self._flops, attn_b / self._bw)

    def step_total(self, f: StepFixed, attention: float) -> float:
        # per_step added in its two parts: the order that keeps the clock bit for bit.
        return f.layers * (f.per_layer + attention) + f.lm_head_s + f.overhead_s

    def estimate(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                 num_logits: int | None = None) -> StepEstimate:
        """The step's time with its FLOPs, bytes and ideal compute / memory times."""
        s = StepSums.of(new_tokens, cached_tokens, num_logits)
        t = s.new
        if t == 0:
            return StepEstimate(self.overhead(s.num_seqs, s.num_prefills), 0.0, 0.0, 0.0, 0.0)
        lin_f, lin_b = self.linear_work(t)
        moe_f, moe_b = self.moe_linear_work(t) if self._moe_layers else (0.0, 0.0)
        attn_f, attn_b = self.attention_work(s.attention_pairs, s.cached, t)
        head_f, head_b = self.head_work(t, s.num_logits)
        L, F, B = self.shape.layers, self._flops, self._bw
        Ld, Lm = self._dense_layers, self._moe_layers
        if Lm:
            flops = Ld * lin_f + Lm * moe_f + L * attn_f + head_f
            nbytes = Ld * lin_b + Lm * moe_b + L * attn_b + head_b
        else:
            flops = L * (lin_f + attn_f) + head_f
            nbytes = L * (lin_b + attn_b) + head_b
        return StepEstimate(self.step_time_sums(s), flops, nbytes, flops / F, nbytes / B)
