"""Step cost models: how long one engine step takes, given what each request in it computes.

A step is described the way the engine batches it: request i brings `new_tokens[i]` new tokens
after `cached_tokens[i]` tokens already in its KV cache (prefill: cached 0; chunk: cached = the
prompt done so far; decode: new 1). Logits are computed for one row per request unless the
caller says how many rows (`num_logits`), since a step's batch does not say which chunks end
their prompt.

Models: `RooflineCostModel` (analytic, from an HF config and a hardware spec),
`ProfiledCostModel` (fitted to a real engine's step log), `ReplayCostModel` (plays recorded
durations back, to prove the simulator makes the engine's decisions). All torch-free: the
simulator must start in well under a second and run where torch is not installed.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from mypy_extensions import mypyc_attr
from numpy.typing import ArrayLike


def hardware_dir() -> Path:
    """conf/hardware/, package data (installed or in the source tree). Found from the conf
    package, not this module: compiled (varlen/compiled.py), this module's file is in the build cache."""
    from conf import conf_dir

    return conf_dir("hardware")


# init=False and an explicit __init__: compiled (varlen/compiled.py), a dataclass's generated
# __init__ would still run as interpreted Python, and this is built in the hot loop.
@dataclass(init=False, slots=True)
class StepSums:
    """The sums over a step's requests that the analytic and fitted models depend on.

    A simulator computes them in one pass over the batch, far cheaper than building arrays for
    a batch of a few requests, which dominates a simulation's time otherwise.
    """

    num_seqs: int
    new: float  # sum n_i
    cached: float  # sum c_i
    new_cached: float  # sum n_i * c_i
    new_sq: float  # sum n_i^2
    num_logits: int
    num_prefills: int  # requests with more than one new token (a prompt or a chunk of one)

    def __init__(self, num_seqs: int, new: float, cached: float, new_cached: float, new_sq: float, num_logits: int,
                 num_prefills: int = 0) -> None:
        self.num_seqs, self.new, self.cached, self.new_cached = num_seqs, new, cached, new_cached
        self.new_sq, self.num_logits, self.num_prefills = new_sq, num_logits, num_prefills

    @property
    def attention_pairs(self) -> float:
        return self.new_cached + (self.new_sq + self.new) / 2.0

    @classmethod
    def of(cls, new_tokens: Any, cached_tokens: Any, num_logits: int | None = None) -> StepSums:
        n, c = _as_arrays(new_tokens, cached_tokens)
        return cls(len(n), float(n.sum()), float(c.sum()), float(np.dot(n, c)), float(np.dot(n, n)),
                   len(n) if num_logits is None else int(num_logits), int((n > 1).sum()))


@mypyc_attr(allow_interpreted_subclasses=True)
class CostModel(ABC):
    @abstractmethod
    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        """Seconds for one step; num_logits defaults to one logit row per request."""

    def step_time_sums(self, s: StepSums) -> float:
        """step_time from the batch's sums (equal to step_time up to float rounding).
        Models that need the individual requests keep this default."""
        raise NotImplementedError

    @property
    def uses_sums(self) -> bool:
        return type(self).step_time_sums is not CostModel.step_time_sums

    def decode_step_time(self, num_seqs: int) -> Callable[[int], float]:
        """The time of a pure-decode step of `num_seqs` requests as a function of the tokens in
        their caches in all: step_time_sums of that step, bit for bit, so a fast-forwarded
        simulation keeps the clock of a step-by-step one exactly. The simulator times millions
        of such steps; models override it with a closure over what the batch size fixes."""
        def step(cached: int) -> float:
            return self.step_time_sums(StepSums(num_seqs, num_seqs, cached, cached, num_seqs, num_seqs))
        return step


def _as_arrays(new_tokens: Any, cached_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    # float64: the attention work sum_i n_i * c_i reaches 1e12 for long-context batches, and
    # float keeps every later product exact enough without overflow worries.
    n = np.asarray(new_tokens, dtype=np.float64).reshape(-1)
    c = np.asarray(cached_tokens, dtype=np.float64).reshape(-1)
    if n.shape != c.shape:
        raise ValueError(f"new_tokens {n.shape} and cached_tokens {c.shape} differ in length")
    return n, c


def attention_pairs(n: np.ndarray, c: np.ndarray) -> float:
    """Query-key pairs of causal, bottom-right aligned attention: new token j of a request
    (0-based) sees its c cached tokens and the j + 1 new ones up to itself."""
    return float(np.dot(n, c) + np.dot(n, n + 1.0) / 2.0)


# ---------------------------------------------------------------------------------------------
# Hardware


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
    dtype_bytes: int = 2  # the dtype peak_tflops refers to
    estimated: bool = False  # True when the figures are estimates rather than datasheet values
    profile_gpu: str | None = None  # its name in measured operator tables (cost.model=measured)
    node: str | None = None  # the node it sits in, for collective tables (tensor/pipeline parallelism)

    @property
    def flops(self) -> float:
        """Achievable FLOP/s."""
        return self.peak_tflops * 1e12 * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        """Achievable bytes/s."""
        return self.mem_bandwidth_gbs * 1e9 * self.bandwidth_efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareSpec:
        # Keys starting with "_" (Hydra's _target_) are not fields.
        names = {f.name for f in fields(cls)}
        unknown = [k for k in d if not str(k).startswith("_") and k not in names]
        if unknown:
            raise ValueError(f"unknown hardware fields {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> HardwareSpec:
        """From conf/hardware/<name>.yaml, or from a yaml path."""
        import yaml  # type: ignore[import-untyped]  # only here: the simulator need not pay for it when given a spec

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


# ---------------------------------------------------------------------------------------------
# Model shape


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a dense decoder (Llama / Qwen2 / Qwen3 / Mistral) that set its cost."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        cfg = dict(cfg)
        if "text_config" in cfg:  # multimodal wrappers keep the decoder's numbers here
            cfg = dict(cfg["text_config"])
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if experts and experts > 1:
            raise ValueError("mixture-of-experts configs are not modelled yet")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(
                hidden=hidden,
                intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),  # absent = MHA
                head_dim=int(cfg.get("head_dim") or hidden // heads),  # Qwen3 sets it apart
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ValueError(f"model config lacks {e.args[0]!r}") from None

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
        mlp = 3 * h * self.intermediate  # gated MLP: gate, up, down
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_dim * dtype_bytes


def load_model_config(model_config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """An HF config dict from a mapping, a config.json (or its folder), or "tiny[-arch]"."""
    if isinstance(model_config, Mapping):
        return dict(model_config)
    s = str(model_config)
    if s == "tiny" or s.startswith("tiny-"):
        # The embedded default model's shape; tiny_model imports torch only when writing weights.
        from varlen.tiny_model import ARCHITECTURES, TINY_SHAPE

        arch = s.partition("-")[2] or "qwen3"
        return {**TINY_SHAPE, **ARCHITECTURES[arch], "vocab_size": 512}
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


# ---------------------------------------------------------------------------------------------
# Roofline


@dataclass(slots=True)
class StepEstimate:
    time_s: float
    flops: float
    bytes: float
    compute_s: float  # sum over operators of FLOPs / achievable FLOP/s
    memory_s: float  # sum over operators of bytes / achievable bandwidth

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@mypyc_attr(allow_interpreted_subclasses=True)
class RooflineCostModel(CostModel):
    """FLOPs and bytes of each step from the model's shape, exact per request.

    Each layer is two operators that run one after the other: the linear layers (QKV, O, gated
    MLP: 2 * params * tokens FLOPs, weights read once per step) and attention (QK^T and PV over
    the exact causal query-key pairs; each request's cached + new K/V read, new K/V written).
    An operator takes max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth); a step is
    layers * (linear + attention) + LM head on the logit rows + the hardware's fixed overhead.
    Modelling operators rather than whole layers matters for mixed batches: a long prefill's
    GEMMs cannot hide the decodes' KV reads, since the attention kernel runs after them.
    """

    def __init__(self, model_config: str | os.PathLike | Mapping[str, Any] = "tiny",
                 hardware: str | os.PathLike | Mapping[str, Any] | HardwareSpec = "h100_sxm",
                 dtype_bytes: int | None = None, overhead_s: float | None = None):
        self.shape = ModelShape.from_config(load_model_config(model_config))
        self.hardware = HardwareSpec.coerce(hardware)
        self.dtype_bytes = int(dtype_bytes if dtype_bytes is not None else self.hardware.dtype_bytes)
        self.overhead_s = float(overhead_s if overhead_s is not None else self.hardware.step_overhead_s)
        m, d = self.shape, self.dtype_bytes
        self._flops = self.hardware.flops
        self._bw = self.hardware.bandwidth
        self._linear_params = m.layer_params - 2 * m.hidden
        self._weight_bytes_layer = m.layer_params * d
        # Activations each linear block reads and writes per token: hidden in/out around the
        # attention projections and the MLP, q/k/v out, attention output in, MLP gate/up out,
        # activated product in. A rough count; it matters only for huge prefills on small models.
        self._act_bytes_token = d * (4 * m.hidden + 2 * m.q_dim + 2 * m.kv_dim + 3 * m.intermediate)
        self._kv_bytes_token_layer = 2 * m.kv_dim * d
        self._attn_flops_pair = 4 * m.q_dim  # QK^T and PV, 2 FLOPs per multiply-add each
        self._head_bytes = m.embedding_params * d

    @property
    def weight_bytes(self) -> float:
        return float(self.shape.num_params * self.dtype_bytes)

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit next to the weights in `memory_fraction` of device memory."""
        free = self.hardware.memory_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // self.shape.kv_bytes_per_token(self.dtype_bytes)))

    def _terms(self, new_tokens: Any, cached_tokens: Any, num_logits: int | None) -> tuple[float, ...]:
        """(FLOPs, bytes) of one layer's linear block, one layer's attention, and the LM head."""
        n, c = _as_arrays(new_tokens, cached_tokens)
        m, d = self.shape, self.dtype_bytes
        t = float(n.sum())
        rows = len(n) if num_logits is None else int(num_logits)
        lin_f = 2.0 * self._linear_params * t
        lin_b = self._weight_bytes_layer + self._act_bytes_token * t
        attn_f = self._attn_flops_pair * attention_pairs(n, c)
        kv_rw = self._kv_bytes_token_layer * (float(c.sum()) + 2.0 * t)  # read cached + new, write new
        attn_b = kv_rw + 2.0 * m.q_dim * d * t  # q in, output out
        head_f = 2.0 * rows * m.hidden * m.vocab
        # Head weights, fp32 logits out, and the embedding rows gathered for the new tokens.
        head_b = self._head_bytes + 4.0 * rows * m.vocab + t * m.hidden * d
        return t, lin_f, lin_b, attn_f, attn_b, head_f, head_b

    def estimate(self, new_tokens: np.ndarray, cached_tokens: np.ndarray,
                 num_logits: int | None = None) -> StepEstimate:
        """The step's time with its FLOPs, bytes and ideal compute / memory times."""
        t, lin_f, lin_b, attn_f, attn_b, head_f, head_b = self._terms(new_tokens, cached_tokens, num_logits)
        if t == 0:
            return StepEstimate(self.overhead_s, 0.0, 0.0, 0.0, 0.0)
        L, F, B = self.shape.layers, self._flops, self._bw
        flops = L * (lin_f + attn_f) + head_f
        nbytes = L * (lin_b + attn_b) + head_b
        return StepEstimate(self._combine(lin_f, lin_b, attn_f, attn_b, head_f, head_b),
                            flops, nbytes, flops / F, nbytes / B)

    def _combine(self, lin_f: float, lin_b: float, attn_f: float, attn_b: float,
                 head_f: float, head_b: float) -> float:
        F, B = self._flops, self._bw
        return (self.shape.layers * (max(lin_f / F, lin_b / B) + max(attn_f / F, attn_b / B))
                + max(head_f / F, head_b / B) + self.overhead_s)

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        t, *terms = self._terms(new_tokens, cached_tokens, num_logits)
        return self._combine(*terms) if t else self.overhead_s

    def step_time_sums(self, s: StepSums) -> float:
        # The same terms as _terms, from the sums.
        t = s.new
        if not t:
            return self.overhead_s
        m, d = self.shape, self.dtype_bytes
        rows = s.num_logits
        lin_f = 2.0 * self._linear_params * t
        lin_b = self._weight_bytes_layer + self._act_bytes_token * t
        attn_f = self._attn_flops_pair * s.attention_pairs
        attn_b = self._kv_bytes_token_layer * (s.cached + 2.0 * t) + 2.0 * m.q_dim * d * t
        head_f = 2.0 * rows * m.hidden * m.vocab
        head_b = self._head_bytes + 4.0 * rows * m.vocab + t * m.hidden * d
        return self._combine(lin_f, lin_b, attn_f, attn_b, head_f, head_b)

    def decode_step_time(self, num_seqs: int) -> Callable[[int], float]:
        # step_time_sums with the terms a decode batch fixes computed once, the rest in the
        # same order of operations (the same floats).
        t = rows = num_seqs
        m, d, F, B, L = self.shape, self.dtype_bytes, self._flops, self._bw, self.shape.layers
        lin = max(2.0 * self._linear_params * t / F, (self._weight_bytes_layer + self._act_bytes_token * t) / B)
        head = max(2.0 * rows * m.hidden * m.vocab / F,
                   (self._head_bytes + 4.0 * rows * m.vocab + t * m.hidden * d) / B)
        pair_flops, kv_bytes, q_bytes = self._attn_flops_pair, self._kv_bytes_token_layer, 2.0 * m.q_dim * d * t
        half_pairs, overhead = (t + t) / 2.0, self.overhead_s

        def step(cached: int) -> float:
            attn = max(pair_flops * (cached + half_pairs) / F, (kv_bytes * (cached + 2.0 * t) + q_bytes) / B)
            return L * (lin + attn) + head + overhead
        return step


# ---------------------------------------------------------------------------------------------
# Profiled


def _feat_const(n, c, rows):
    return 1.0


def _feat_new(n, c, rows):
    return float(n.sum())


def _feat_seqs(n, c, rows):
    return float(len(n))


def _feat_attn(n, c, rows):
    return attention_pairs(n, c)


def _feat_cached(n, c, rows):
    return float(c.sum())


def _feat_logits(n, c, rows):
    return float(rows)


def _feat_prefills(n, c, rows):
    return float((n > 1).sum())


# Each feature is a quantity some part of the step scales with. "logit_rows" is left out of
# the default because with one logit row per request it equals "num_seqs" (collinear).
FEATURES = {
    "const": _feat_const,  # launch, scheduling, sampling overhead
    "new_tokens": _feat_new,  # linear layers (GEMM rows)
    "num_seqs": _feat_seqs,  # per-request work: metadata, LM head row, sampling
    "attn_work": _feat_attn,  # causal query-key pairs
    "cached_tokens": _feat_cached,  # KV read
    "logit_rows": _feat_logits,
    "prefill_seqs": _feat_prefills,  # per-prompt work: attention call, mask, gathers
}
# prefill_seqs: measured on the CPU engine, a prompt (or a chunk of one) costs ~2 ms beyond its
# tokens (its own attention call, mask and K/V gathers per layer); without it the fit spreads
# that cost over tokens and TTFT comes out ~10% off (benchmarks/sim_fidelity.py).
DEFAULT_FEATURES = ("const", "new_tokens", "num_seqs", "attn_work", "cached_tokens", "prefill_seqs")

# The same features from a step's sums (StepSums), for the simulator's fast path.
FEATURES_FROM_SUMS = {
    "const": lambda s: 1.0,
    "new_tokens": lambda s: s.new,
    "num_seqs": lambda s: float(s.num_seqs),
    "attn_work": lambda s: s.attention_pairs,
    "cached_tokens": lambda s: s.cached,
    "logit_rows": lambda s: float(s.num_logits),
    "prefill_seqs": lambda s: float(s.num_prefills),
}


@dataclass(slots=True)
class FitReport:
    n_steps: int
    r2: float
    mape: float  # mean absolute percentage error, in percent
    max_ape: float  # worst step, in percent

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls  # not a declared dependency; numpy fallback below
    except ImportError:
        return _nnls_numpy(A, b)
    return nnls(A, b)[0]


def _nnls_numpy(A: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Active-set non-negative least squares (Lawson & Hanson's algorithm), numpy only."""
    m, k = A.shape
    x = np.zeros(k)
    passive = np.zeros(k, bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(A, 1) * max(m, k)
    for _ in range(max_iter or 3 * k + 10):
        w = A.T @ (b - A @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x towards z until the first passive coefficient reaches zero.
            neg = passive & (z <= 0)
            alpha: Any = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


# One logged step: (new_tokens, cached_tokens, duration_s) or (..., duration_s, num_logits).
Step = tuple[Any, ...]


@mypyc_attr(allow_interpreted_subclasses=True)
class ProfiledCostModel(CostModel):
    """A linear model of step time in a few physical features, fitted by non-negative least squares.

    Non-negative because each coefficient is the cost of a unit of real work; a negative one
    would be the fit trading features against each other, and it extrapolates badly.
    Plain least squares by default; "relative" weighting (see `fit`) favours the short, many
    decode steps in percent.
    Pure-decode logs alone make num_seqs, new_tokens and attn_work collinear; profile a mix of
    prefills, chunks and decodes for coefficients that mean something.
    """

    def __init__(self, path: str | os.PathLike | None = None, *,
                 coef: Sequence[float] | Mapping[str, float] | None = None,
                 features: Sequence[str] = DEFAULT_FEATURES):
        self.report: FitReport | None = None
        self.meta: dict[str, Any] = {}
        if path is not None:
            d = json.loads(Path(path).read_text())
            if d.get("format") != "varlen.profiled_cost_model":
                raise ValueError(f"{path}: not a profiled cost model file")
            features, coef = d["features"], d["coef"]
            self.report = FitReport(**d["report"]) if d.get("report") else None
            self.meta = d.get("meta", {})
        if isinstance(coef, Mapping):
            features = list(coef)
            coef = [coef[f] for f in features]
        unknown = [f for f in features if f not in FEATURES]
        if unknown:
            raise ValueError(f"unknown features {unknown} (known: {', '.join(FEATURES)})")
        self.features = tuple(features)
        self._fns = [FEATURES[f] for f in self.features]
        self.coef = np.zeros(len(self.features)) if coef is None else np.asarray(coef, np.float64)
        if self.coef.shape != (len(self.features),):
            raise ValueError(f"{len(self.coef)} coefficients for {len(self.features)} features")

    def feature_row(self, new_tokens: np.ndarray, cached_tokens: np.ndarray,
                    num_logits: int | None = None) -> np.ndarray:
        n, c = _as_arrays(new_tokens, cached_tokens)
        rows = len(n) if num_logits is None else num_logits
        return np.array([f(n, c, rows) for f in self._fns])

    def _design(self, steps: Iterable[Step]) -> tuple[np.ndarray, np.ndarray]:
        X, y = [], []
        for s in steps:
            X.append(self.feature_row(s[0], s[1], s[3] if len(s) > 3 else None))
            y.append(float(s[2]))
        if not y:
            raise ValueError("no steps")
        return np.array(X), np.array(y)

    @classmethod
    def fit(cls, steps: Iterable[Step], features: Sequence[str] = DEFAULT_FEATURES,
            weighting: str = "absolute", outlier_factor: float | None = 3.0,
            iterations: int = 4) -> ProfiledCostModel:
        """Fit to (new_tokens, cached_tokens, duration_s[, num_logits]) per step.

        weighting "relative": each step's squared error is weighted by 1 / its predicted time
        squared (iteratively reweighted, starting from the absolute fit), so a short decode step
        counts as much as a long prefill in percent. The weights come from the model, not from
        the measured durations: weighting by 1 / measured time favours the steps that happened to
        run fast and biases every prediction low (by ~4% of a CPU decode step's time, measured),
        while the simulator needs each step's mean time, since TPOT, e2e latency and throughput
        are sums of step times. "absolute" (the default): plain least squares, which weighs the
        long prefill steps that TTFT's tail depends on by their seconds; in the fidelity benchmark
        (fit on one real run, predict another, both directions) its worst error over TTFT p50/p90,
        TPOT p50 and throughput was 8.9% against 16.0% for "relative" at 100 requests per slice,
        10.1% against 13.8% at 60.

        outlier_factor: steps that took more than this many times the model's prediction
        (a garbage collection, the process preempted by another) are dropped from the next
        iteration's fit; they are not a function of the batch. None keeps every step.
        The report scores all the steps, outliers included.
        """
        if weighting not in ("relative", "absolute"):
            raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
        model = cls(features=features)
        X, y = model._design(steps)
        keep: Any = np.ones(len(y), bool)
        coef = np.zeros(X.shape[1])
        for it in range(max(1, iterations)):
            if it == 0 or weighting == "absolute":
                w = np.ones_like(y)
            else:
                w = 1.0 / np.maximum(X @ coef, 1e-3 * float(np.median(y)))
            A, b = X[keep] * w[keep, None], y[keep] * w[keep]
            # Features span ten orders of magnitude (const vs attention pairs); scale columns to
            # unit norm so the solver's tolerances mean the same thing for every coefficient.
            norms = np.linalg.norm(A, axis=0)
            norms[norms == 0] = 1.0
            coef = _nnls(A / norms, b) / norms
            if outlier_factor is not None:
                pred = X @ coef
                keep = ~(y > outlier_factor * np.maximum(pred, 1e-12))
                if keep.sum() < X.shape[1]:
                    keep[:] = True
        model.coef = coef
        model.report = model._score(X, y)
        model.meta = {"weighting": weighting, "outliers_dropped": int((~keep).sum())}
        return model

    def _score(self, X: np.ndarray, y: np.ndarray) -> FitReport:
        pred = X @ self.coef
        ss_res = float(np.sum((y - pred) ** 2))
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        ape = np.abs(pred - y) / np.maximum(np.abs(y), 1e-12) * 100
        return FitReport(len(y), 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0),
                         float(ape.mean()), float(ape.max()))

    def score(self, steps: Iterable[Step]) -> FitReport:
        """R², mean and max absolute percentage error on these steps (e.g. held-out ones)."""
        return self._score(*self._design(steps))

    def coefficients(self) -> dict[str, float]:
        return dict(zip(self.features, self.coef.tolist()))

    def save(self, path: str | os.PathLike) -> None:
        d = {"format": "varlen.profiled_cost_model", "version": 1, "features": list(self.features),
             "coef": self.coef.tolist(), "report": self.report.as_dict() if self.report else None,
             "meta": self.meta}
        Path(path).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfiledCostModel:
        return cls(path)

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        return float(self.feature_row(new_tokens, cached_tokens, num_logits) @ self.coef)

    def step_time_sums(self, s: StepSums) -> float:
        return sum(c * FEATURES_FROM_SUMS[f](s) for f, c in zip(self.features, self.coef.tolist()))


# ---------------------------------------------------------------------------------------------
# Replay


@mypyc_attr(allow_interpreted_subclasses=True)
class ReplayCostModel(CostModel):
    """Returns recorded step durations in order, whatever the batch.

    Given the engine's own step times, a simulator that schedules exactly as the engine did sees
    exactly the engine's clock, so any divergence in the batches is a scheduling difference.
    With `starts` (the recorded step start times) the simulator also waits, as the real engine
    did, between one step's end and the next one's start (bookkeeping outside the step, idle
    time), so arrivals land between the same two steps as they did for real.
    """

    def __init__(self, durations: Sequence[float] | str | os.PathLike,
                 starts: Sequence[float] | None = None):
        if isinstance(durations, (str, os.PathLike)):
            # A JSON list, or one number per line.
            text = Path(durations).read_text()
            values: Sequence[Any] = json.loads(text) if text.lstrip().startswith("[") else text.split()
        else:
            values = durations
        self.durations = [float(d) for d in values]
        self.starts = None if starts is None else [float(t) for t in starts]
        if self.starts is not None and len(self.starts) != len(self.durations):
            raise ValueError(f"{len(self.starts)} start times for {len(self.durations)} durations")
        self.position = 0

    @classmethod
    def from_steps(cls, steps: Sequence[Any], timeline: bool = True) -> ReplayCostModel:
        """From an engine's step log (StepRecord-like: .start, .duration); timeline=True also
        replays the start times."""
        return cls([s.duration for s in steps], [s.start for s in steps] if timeline else None)

    @property
    def remaining(self) -> int:
        return len(self.durations) - self.position

    def reset(self) -> None:
        self.position = 0

    def next_start(self, now: float) -> float:
        """The recorded start of the next step (never before `now`); `now` without a timeline."""
        if self.starts is None or self.position >= len(self.starts):
            return now
        return max(now, self.starts[self.position])

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        if self.position >= len(self.durations):
            raise RuntimeError(f"replay exhausted: the simulator asked for step {self.position + 1} "
                               f"but only {len(self.durations)} were recorded")
        d = self.durations[self.position]
        self.position += 1
        return d


# ---------------------------------------------------------------------------------------------
# From an engine's step log


def profile_rows(steps: Sequence[Any], busy_period: bool = True,
                 max_gap_factor: float = 5.0) -> list[Step]:
    """(new_tokens, cached_tokens, seconds, num_logits) per recorded step, for ProfiledCostModel.fit.

    busy_period=True charges each step the time until the next step starts when the engine
    stayed busy: the engine's bookkeeping after the forward (appending tokens, stop checks,
    freeing blocks) is real per-step time that a simulator must spend too, but it falls outside
    StepRecord.duration. A gap is idle time, not bookkeeping, when the engine went idle
    (num_running == 0 and nothing waiting) or, for logs that lack that, when the gap is over
    max_gap_factor times the median gap.
    """
    steps = list(steps)  # a StepLog reads as a sequence, but slices only as a list
    rows: list[Step] = []
    gaps = [b.start - (a.start + a.duration) for a, b in zip(steps, steps[1:])]
    typical = float(np.median(gaps)) if gaps else 0.0
    for i, s in enumerate(steps):
        t = s.duration
        if busy_period and i < len(gaps):
            running = getattr(s, "num_running", -1)
            idle = (running == 0 and s.num_waiting == 0) if running >= 0 else gaps[i] > max_gap_factor * typical
            if not idle:
                t += max(gaps[i], 0.0)
        sampled = getattr(s, "num_sampled", -1)
        rows.append((list(s.new_tokens), list(s.cached_tokens), t, None if sampled < 0 else sampled))
    return rows


COST_MODELS: dict[str, type[CostModel]] = {
    "roofline": RooflineCostModel,
    "profiled": ProfiledCostModel,
    "replay": ReplayCostModel,
}


def make_cost_model(name: str, **kwargs: Any) -> CostModel:
    """Build a cost model by name: roofline, profiled, replay (kwargs go to its constructor)."""
    try:
        cls = COST_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r} (known: {', '.join(COST_MODELS)})") from None
    return cls(**kwargs)
