"""The measured operator cost model (`cost.model=measured`): step times from per-operator timings
taken on real GPUs (sim/profiles/ or a user's folder), predicted (gemm.py) where a table is missing,
the roofline's where the GPU has no tables at all; `notes` say which. The formula is precomputed per
token count when the model is built."""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
from mypy_extensions import mypyc_attr

from sim.cost.base import CostModel, StepFixed, chunk_shape, settings
from sim.cost.hardware import HardwareSpec, ModelShape, load_model_config
from sim.cost.attention import calibrate_attention
from sim.cost.collectives import Collectives
from sim.cost.gemm import _operator_model, layer_op_ms, moe_layer_ms
from sim.cost.roofline import RooflineCostModel
from sim.cost.profiles import (
    GRID_TOKENS, HEAD_ROWS, LAYER_OPS, PER_LAYER, ModelKey, ProfileError, is_gated, load_profiles, table_gpu,
)


@mypyc_attr(allow_interpreted_subclasses=True)
class MeasuredCostModel(CostModel):
    """One GPU of a TP group, a microbatch through all pipeline stages in sequence: embedding +
    layers x (linear + attention + 2 all-reduces) + LM head + (pipeline - 1) send/recv + overhead."""

    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """cost.profiles: a folder of your own tables, over the shipped ones."""
        profiles = settings(options, "measured", ("profiles",)).get("profiles")
        return cls(model_config, hardware, profiles=profiles, tensor=parallel.tensor, pipeline=parallel.pipeline)

    def __init__(self, model_config: str | os.PathLike | Mapping[str, Any] = "tiny",
                 hardware: str | os.PathLike | Mapping[str, Any] | HardwareSpec = "h100_sxm",
                 profiles: str | os.PathLike | None = None, tensor: int = 1, pipeline: int = 1,
                 dtype_bytes: int | None = None, overhead_s: float | None = None,
                 exclude: tuple[Any, ...] = (), engine_overhead: bool = True):
        cfg = load_model_config(model_config)
        self.shape = m = ModelShape.from_config(cfg)
        self.hardware = hw = HardwareSpec.coerce(hardware)
        self.tensor, self.pipeline = int(tensor), int(pipeline)
        self.dtype_bytes = d = int(dtype_bytes if dtype_bytes is not None else hw.dtype_bytes)
        self.overhead_s = float(overhead_s if overhead_s is not None else hw.step_overhead_s)
        self.profiles = load_profiles(profiles)
        gpu = table_gpu(hw, self.profiles)
        self.gpu = gpu or hw.profile_gpu or hw.name
        tp = self.tensor
        tokens = np.arange(GRID_TOKENS + 1, dtype=np.float64)
        if m.is_moe:
            # All-expert models may have no dense width: their attention operators come with the experts'.
            self.key = ModelKey(m.heads, m.kv_heads, m.hidden, m.intermediate or m.expert_intermediate, m.gated,
                                m.head_dim)
        else:
            self.key = ModelKey.of(m, is_gated(cfg))
        # No tables for this GPU: the linear block and the LM head are the roofline's (the one-GPU
        # shard, as cost.model=roofline builds it), labelled as estimated in `notes`.
        self._roof: RooflineCostModel | None = None
        if gpu is None:
            from sim.parallel import shard_config  # sim.parallel imports the roofline module

            self._roof = RooflineCostModel(shard_config(cfg, tp), hw, dtype_bytes=d)
            self.linear_source = (f"estimated (roofline: no operator tables for {hw.name}; tables exist for "
                                  f"{', '.join(self.profiles.gpus) or 'none'}: cost.profiles=DIR adds yours, "
                                  f"python -m sim.profile writes them)")
            layer = np.zeros_like(tokens)
            ops = {"emb": np.zeros_like(tokens)}
        else:
            ops, self.linear_source = layer_op_ms(self.profiles, self.gpu, self.key, m.head_dim, tp, tokens, exclude,
                                                   m.vocab)
            layer = np.sum([PER_LAYER[op] * ops[op] for op in LAYER_OPS], axis=0)
            if m.is_moe:
                router = self._router_ms(tokens)
                dense_source = self.linear_source
                moe, self.linear_source = moe_layer_ms(self.profiles, self.gpu, m, tp, tokens, router, exclude, m.vocab)
                if m.dense_layers:
                    self.linear_source += f"; its {m.dense_layers} dense layers {dense_source}"
                layer = (m.dense_layers * layer + m.moe_layers * moe) / m.layers
        layer[0] = 0.0
        emb = ops["emb"].copy()
        emb[0] = 0.0
        if (self.tensor > 1 or self.pipeline > 1) and hw.node is None:
            raise ProfileError(f"hardware {hw.name!r} names no node (hardware.node) to time tensor/pipeline "
                               f"communication with; set e.g. hardware.node=h100_dgx (nodes: {', '.join(self.profiles.nodes)})")
        self.comm = Collectives(hw.node, self.profiles)
        act: Any = tokens * m.hidden * d  # bytes of one activation all-reduced / sent
        ar = 2.0 * self.comm.all_reduce_ms(act, tp) if tp > 1 else np.zeros_like(tokens)
        pp = (self.pipeline - 1) * self.comm.send_recv_ms(act) if self.pipeline > 1 else np.zeros_like(tokens)
        ar[0] = 0.0
        pp[0] = 0.0
        # Seconds, as typed lists: an index is far cheaper than a numpy call per step.
        self._layer: list[float] = (layer * 1e-3).tolist()
        self._emb: list[float] = (emb * 1e-3).tolist()
        self._ar: list[float] = (ar * 1e-3).tolist()
        self._pp: list[float] = (pp * 1e-3).tolist()
        # Summed once per token count: a step is then three lookups and attention.
        L = m.layers
        self._fixed: list[float] = [e + L * (ly + a) + p for e, ly, a, p in zip(self._emb, self._layer, self._ar, self._pp)]
        # Decode-only steps' operators over the tables' as scaled (sim.profile's decode_ops_scale / ops_scale).
        self._decode_k = 1.0
        if gpu is None:
            self._head: list[float] = [0.0]  # the roofline's, per step (it depends on the tokens too)
        else:
            om = _operator_model(self.profiles, self.gpu, frozenset(exclude))
            rows = np.arange(HEAD_ROWS + 1, dtype=np.float64)
            head = om.gemm_ms(rows, max(m.vocab // tp, 1), m.hidden) * 1e-3
            head[0] = 0.0
            self._head = head.tolist()
        q_dim = (m.heads // tp) * m.head_dim
        kv_dim = max(m.kv_heads // tp, 1) * m.head_dim
        self._pair_flops = 4.0 * q_dim
        self._kv_token = 2.0 * kv_dim * d
        self._q_token = 2.0 * q_dim * d
        self._F, self._B = hw.flops, hw.bandwidth
        self.attention_calibration = cal = calibrate_attention(self.profiles, self.gpu)
        if cal is None:
            attention = "attention: estimated (roofline at the hardware's efficiencies; no attention tables)"
            self._a0 = self._a1 = 0.0
            self._calibrated = False
            self._long_min, self._a_long, self._a_key, self._F_rect, self._F_fresh = 0, 0.0, 0.0, float("inf"), float("inf")
        else:
            attention = (f"attention: calibrated on {cal.cases} measured cases ({cal.source}): "
                         f"{1 / max(cal.per_byte, 1e-30) / 1e9:.3g} GB/s, {1 / max(cal.per_flop, 1e-30) / 1e12:.3g} TFLOP/s, "
                         f"{cal.const * 1e6:.3g} us + {cal.per_seq * 1e6:.3g} us per request per layer")
            self._a0, self._a1 = cal.const, cal.per_seq
            self._F = 1.0 / cal.per_flop if cal.per_flop > 0 else float("inf")
            self._B = 1.0 / cal.per_byte if cal.per_byte > 0 else float("inf")
            self._calibrated = True
            # The backend's long-prompt path (torch_paged's SDPA): its own rate on the chunk's whole rectangle.
            self._long_min, self._a_long, self._a_key = cal.long_query_min, cal.per_long, cal.per_gathered
            self._F_rect = 1.0 / cal.per_rect_flop if cal.per_rect_flop > 0 else float("inf")
            self._F_fresh = 1.0 / cal.per_fresh_flop if cal.per_fresh_flop > 0 else float("inf")
            if cal.long_query_min:
                attention += (f"; prompts of >= {cal.long_query_min} new tokens: "
                              f"{1 / max(cal.per_rect_flop, 1e-30) / 1e12:.3g} TFLOP/s on their n x (cached + n) "
                              f"rectangle after a context, {1 / max(cal.per_fresh_flop, 1e-30) / 1e12:.3g} TFLOP/s "
                              f"on causal pairs when fresh, + {cal.per_long * 1e6:.3g} us per such request and "
                              f"{cal.per_gathered * 1e9:.3g} ns per key it gathers, per layer")
        # sim.profile's fitted engine overhead on this device, else hardware.step_overhead_s.
        prof_ov = self.profiles.engine_overhead(self.gpu) if engine_overhead and overhead_s is None else None
        if prof_ov is None and overhead_s is not None:
            self._o0, self._o1, self._o2 = self.overhead_s, 0.0, 0.0
            overhead = f"overhead: {self.overhead_s * 1e3:.3g} ms per step (given)"
        elif prof_ov is None:
            self._o0, self._o1, self._o2 = self.overhead_s, hw.step_overhead_per_seq_s, hw.step_overhead_per_prefill_s
            overhead = (f"overhead: {self._o0 * 1e3:.3g} ms per step + {self._o1 * 1e3:.3g} ms per request + "
                        f"{self._o2 * 1e3:.3g} ms per prefill (hardware.step_overhead_*: estimates)")
        else:
            c = prof_ov[1]
            self._o0, self._o1, self._o2 = c["const_ms"] * 1e-3, c["per_seq_ms"] * 1e-3, c["per_prefill_ms"] * 1e-3
            self.overhead_s = self._o0
            overhead = (f"overhead: the engine's, profiled ({prof_ov[0]}): {c['const_ms']:.3g} ms per step + "
                        f"{c['per_seq_ms']:.3g} ms per request + {c['per_prefill_ms']:.3g} ms per prefill, "
                        + ("greedy sampling" if c["temperature"] == 0 else f"sampling at temperature {c['temperature']:.3g}"))
            k, k_dec = c["ops_scale"], c["decode_ops_scale"]
            if gpu is not None and k != 1.0:
                self._scale_operators(k)
            if gpu is not None and k_dec != k:
                self._decode_k = k_dec / k
                overhead += (f"; operators x{k:.3g} in steps with a prompt chunk, x{k_dec:.3g} in decode-only steps "
                             "(the engine's steps over the tables' sum, profiled)")
            elif gpu is not None and k != 1.0:
                overhead += f"; operators x{k:.3g} (the engine's steps over the tables' sum, profiled)"
            if c.get("decode_scale_pinned"):
                overhead += "; decode-only steps' scale pinned to the chunk steps' (not identified by the profile)"
            if c.get("spread_pct", float("nan")) == c.get("spread_pct"):  # not NaN: the profile measured it
                overhead += f"; halves of the profile's engine passes {c['spread_pct']:.1f}% apart"
        lm_head = ("lm_head: predicted from its GEMM shape" if gpu else
                   f"lm_head: estimated (roofline, with the embedding; no operator tables for {hw.name})")
        self.notes = [f"linear: {self.linear_source}", lm_head, attention,
                      overhead, *self.comm.notes]

    def _scale_operators(self, k: float) -> None:
        """Every timed operator (linear, LM head, attention) times k: sim.profile fits k with the overhead
        on the same engine steps, so a machine that ran the tables faster or slower than the engine
        (another load, a minute apart) does not leave its difference in the per-step constant."""
        self._layer = [k * x for x in self._layer]
        self._emb = [k * x for x in self._emb]
        self._head = [k * x for x in self._head]
        L = self.shape.layers
        self._fixed = [e + L * (ly + a) + p for e, ly, a, p in zip(self._emb, self._layer, self._ar, self._pp)]
        self._a0, self._a1, self._a_long, self._a_key = k * self._a0, k * self._a1, k * self._a_long, k * self._a_key
        self._F, self._B, self._F_rect, self._F_fresh = self._F / k, self._B / k, self._F_rect / k, self._F_fresh / k

    def _router_ms(self, tokens: Any) -> Any:
        """The router GEMM (hidden x experts, replicated on every GPU of a TP group) by the roofline, ms."""
        m, hw, d = self.shape, self.hardware, self.dtype_bytes
        flops = 2.0 * tokens * m.hidden * m.router_outputs
        nbytes = (m.hidden * m.router_outputs + tokens * (m.hidden + m.router_outputs)) * d
        return np.maximum(flops / hw.flops, nbytes / hw.bandwidth) * 1e3

    @property
    def overhead_form(self) -> tuple[float, float, float]:
        """(seconds per step, per request, per prefill request), for sim.explain."""
        return self._o0, self._o1, self._o2

    # Per-token tables past their end: time per token of the last entry.
    @staticmethod
    def _at(table: list[float], i: int) -> float:
        n = len(table) - 1
        return table[i] if i <= n else table[n] * i / n

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        t = int(new)
        overhead = self._o0 + self._o1 * num_seqs + self._o2 * num_prefills
        if not t:
            return StepFixed(0.0, 0.0, overhead, num_seqs=num_seqs, embedding_s=0.0, linear_s=0.0,
                             lm_head_s=0.0, overhead_s=overhead)
        roof = self._roof
        if roof is not None:  # no tables for this GPU: the roofline's linear block and LM head
            L = self.shape.layers
            lin = roof.linear_time(new)
            head_f, head_b = roof.head_work(new, num_logits)
            head_s = max(head_f / self.hardware.flops, head_b / self.hardware.bandwidth)
            comm = L * self._at(self._ar, t) + self._at(self._pp, t)
            return StepFixed(L, lin, head_s + comm + overhead, num_seqs=num_seqs, new=new, linear_s=L * lin,
                             lm_head_s=head_s, communication_s=comm, overhead_s=overhead, num_prefills=num_prefills)
        fixed, head, at = self._fixed, self._head, self._at
        lm_head = head[num_logits] if num_logits < len(head) else at(head, num_logits)
        base = (fixed[t] if t < len(fixed) else at(fixed, t)) + lm_head + overhead
        L = self.shape.layers
        comm = L * at(self._ar, t) + at(self._pp, t)
        k = self._decode_k if t <= num_seqs else 1.0  # one new token a request: a decode-only step
        if k != 1.0:
            base = k * (base - comm - overhead) + comm + overhead
        # per_layer 0: the tables sum each token count's layers once, when the model is built.
        return StepFixed(L, 0.0, base, num_seqs=num_seqs, new=t, embedding_s=k * at(self._emb, t),
                         linear_s=k * L * at(self._layer, t), lm_head_s=k * lm_head,
                         communication_s=comm, overhead_s=overhead, num_prefills=num_prefills)

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        """The roofline, or its calibrated form (the terms' sum plus per-call and per-request costs; with a
        long-prompt path, its chunks' rectangles at that path's rate, the rest's causal pairs at the kernel's)."""
        t = f.new
        b = (self._kv_token * (cached + 2.0 * t) + self._q_token * t) / self._B
        k = self._decode_k if t <= f.num_seqs else 1.0
        if self._calibrated:
            if self._long_min and t > f.num_seqs:
                return self._two_paths(f, pairs, cached) + self._a0 + self._a1 * f.num_seqs + b
            return k * (self._a0 + self._a1 * f.num_seqs + self._pair_flops * pairs / self._F + b)
        return k * max(self._pair_flops * pairs / self._F, b)

    def _two_paths(self, f: StepFixed, pairs: float, cached: float) -> float:
        """A step with prompt chunks on a backend with a long-prompt path, from the step's sums (chunk_shape: the
        chunks' mean length, which decides their path, and their context; exact with one chunk, the usual step
        of a chunked engine, or chunks of one length). Decodes (n = 1) add c + 1 causal pairs each."""
        mean, chunk_cached = chunk_shape(f.num_seqs, f.num_prefills, f.new, f.new_sq, pairs, cached)
        if not (mean > 0.0 and mean >= self._long_min):  # no chunk, or NaN new_sq (not given): one path
            return self._pair_flops * pairs / self._F
        decodes = f.num_seqs - f.num_prefills
        chunk_new = f.new - decodes
        chunk_sq = f.new_sq - decodes
        kernel = cached - chunk_cached + decodes  # the decodes' causal pairs
        if chunk_cached > 0.5:  # after a context (masked SDPA): sum n (c + n) over the chunks
            chunks = (mean * chunk_cached + chunk_sq) / self._F_rect + self._a_key * (chunk_cached + chunk_new) / self._pair_flops
        else:  # fresh prompts (plain causal SDPA): their causal pairs
            chunks = (chunk_sq + chunk_new) / 2.0 / self._F_fresh
        return self._pair_flops * (kernel / self._F + chunks) + self._a_long * f.num_prefills
