"""The cost model interface: each model writes its step-time formula once, from the batch's sums.

Split in `step_fixed` (what the batch sizes fix) and `layer_attention` (what grows with the caches)
so the decode fast-forward can time many steps at once; every other entry point derives from them.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from mypy_extensions import mypyc_attr
from numpy.typing import ArrayLike

from varlen.promises import broken_by

#: Defining any of these promises step_time_sums is the step_time (varlen/promises.py).
FORMULA = ("step_fixed", "layer_attention", "step_total")

#: A part the model cannot tell apart (explain: null); NaN keeps the field an unboxed float.
NOT_SPLIT = math.nan

PARTS = ("embedding_s", "linear_s", "attention_s", "lm_head_s", "communication_s", "overhead_s")


# An explicit __init__: compiled, a dataclass's generated one would run interpreted (hot loop).
@dataclass(init=False, slots=True)
class StepSums:
    """The sums over a step's requests the formulas read, taken in one pass (cheaper than arrays)."""

    num_seqs: int
    new: float
    cached: float
    new_cached: float  # sum n_i * c_i
    new_sq: float
    num_logits: int
    num_prefills: int  # requests with more than one new token

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


def chunk_shape(num_seqs: int, num_prefills: int, new: float, new_sq: float, pairs: float,
                cached: float) -> tuple[float, float]:
    """A step's prompt chunks (its requests of > 1 new token) from its sums: their mean length sum(n^2) / sum(n)
    and the context behind them (sum c over the chunks). Decodes (n = 1) add nothing to sum (n - 1) c =
    sum n c - cached, which over the mean length less one is the chunks' context: exact with one chunk (a
    chunked engine's usual step) or chunks of one length. (0, 0) without a chunk or without new_sq (NaN)."""
    decodes = num_seqs - num_prefills
    chunk_new = new - decodes
    if not chunk_new > 0:
        return 0.0, 0.0
    mean = (new_sq - decodes) / chunk_new
    if not mean > 1.0:  # NaN new_sq: not given
        return 0.0, 0.0
    new_cached = pairs - (new_sq + new) / 2.0
    return mean, min(max((new_cached - cached) / (mean - 1.0), 0.0), cached)


@dataclass(init=False, slots=True)
class StepFixed:
    """What a step's sizes fix: step = per_step + layers x (per_layer + attention), in seconds; the *_s
    parts (NOT_SPLIT if unknown) only feed sim.explain."""

    layers: float
    per_layer: float
    per_step: float
    num_seqs: int
    new: float
    embedding_s: float
    linear_s: float
    lm_head_s: float
    communication_s: float
    overhead_s: float
    num_prefills: int
    # The step's sum of n_i^2, which step_fixed does not take: set by the caller from the step's sums
    # (NaN: not given), for a backend whose attention depends on the chunks' shape (MeasuredCostModel).
    new_sq: float

    def __init__(self, layers: float, per_layer: float, per_step: float, *, num_seqs: int = 0, new: float = 0.0,
                 embedding_s: float = NOT_SPLIT, linear_s: float = NOT_SPLIT, lm_head_s: float = NOT_SPLIT,
                 communication_s: float = 0.0, overhead_s: float = NOT_SPLIT, num_prefills: int = 0) -> None:
        self.layers, self.per_layer, self.per_step = layers, per_layer, per_step
        self.num_seqs, self.new, self.num_prefills, self.new_sq = num_seqs, new, num_prefills, NOT_SPLIT
        self.embedding_s, self.linear_s, self.lm_head_s = embedding_s, linear_s, lm_head_s
        self.communication_s, self.overhead_s = communication_s, overhead_s


@mypyc_attr(allow_interpreted_subclasses=True)
class CostModel(ABC):
    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """Build from the `cost.*` options, the HF config dict, a HardwareSpec and a Parallelism."""
        built: CostModel = construct(cls, options, model_config, hardware, parallel)
        return built

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        raise NotImplementedError(f"{type(self).__name__} has no step formula; it times steps by step_time")

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        raise NotImplementedError(f"{type(self).__name__} has no step formula")

    def step_total(self, f: StepFixed, attention: float) -> float:
        return f.per_step + f.layers * (f.per_layer + attention)

    @property
    def uses_sums(self) -> bool:
        cls = type(self)
        return cls.step_time_sums is not CostModel.step_time_sums or cls.step_fixed is not CostModel.step_fixed

    def step_time_sums(self, s: StepSums) -> float:
        f = self.step_fixed(s.num_seqs, s.new, s.num_logits, s.num_prefills)
        f.new_sq = s.new_sq
        return self.step_total(f, self.layer_attention(f, s.attention_pairs, s.cached))

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        """Seconds for one step; step_time_sums bit for bit (integer sums are exact)."""
        return self.step_time_sums(StepSums.of(new_tokens, cached_tokens, num_logits))

    def decode_step_time(self, num_seqs: int) -> Callable[[int], float]:
        """A pure-decode step's time as a function of its total cached tokens: step_time_sums bit for bit."""
        if not formula_holds(type(self), ("step_time_sums",)):
            def generic(cached: int) -> float:
                return self.step_time_sums(StepSums(num_seqs, num_seqs, cached, cached, num_seqs, num_seqs))
            return generic
        f = self.step_fixed(num_seqs, num_seqs, num_seqs, 0)
        f.new_sq = float(num_seqs)
        half_pairs = (num_seqs + num_seqs) / 2.0  # StepSums.attention_pairs less sum n_i * c_i

        def step(cached: int) -> float:
            return self.step_total(f, self.layer_attention(f, cached + half_pairs, cached))
        return step

    def parts(self, s: StepSums) -> dict[str, float | None]:
        f = self.step_fixed(s.num_seqs, s.new, s.num_logits, s.num_prefills)
        f.new_sq = s.new_sq
        attention = f.layers * self.layer_attention(f, s.attention_pairs, s.cached)
        parts = {"embedding_s": f.embedding_s, "linear_s": f.linear_s, "attention_s": attention,
                 "lm_head_s": f.lm_head_s, "communication_s": f.communication_s, "overhead_s": f.overhead_s}
        return {k: None if math.isnan(v) else v for k, v in parts.items()}

    def next_start(self, now: float) -> float:
        return now



def settings(options: Mapping[str, Any], model: str, known: tuple[str, ...]) -> dict[str, Any]:
    """The options of cost.model=`model`; one it does not read is an error, never ignored."""
    for k, v in options.items():
        if k not in known:
            raise ValueError(f"cost.{k}={v!r} is not a setting of cost.model={model} (its settings: "
                             f"{', '.join('cost.' + n for n in known) or 'none'}); remove it")
    return dict(options)


def load_path(options: Mapping[str, Any], model: str, what: str, load: Callable[[str], CostModel]) -> CostModel:
    path = settings(options, model, ("path",)).get("path")
    if path is None:
        raise ValueError(f"cost.model={model} needs cost.path: {what}")
    if not Path(str(path)).is_file():
        raise ValueError(f"cost.path={str(path)!r} is not a file; give {what}")
    try:
        return load(str(path))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())[:160]
        raise ValueError(f"cost.path={str(path)!r} is not {what} for cost.model={model} ({reason})") from None


def one_gpu(model: str, parallel: Any, why: str) -> None:
    """Refuse tensor / pipeline parallelism for a model that times one GPU."""
    if parallel.gpus > 1:
        raise ValueError(f"cost.model={model} {why}; parallel.tensor={parallel.tensor} parallel.pipeline="
                         f"{parallel.pipeline} needs cost.model=roofline or measured")


def formula_holds(cls: type, behaviour: tuple[str, ...] = ("step_time_sums", "step_time")) -> bool:
    """Whether `cls` has a formula that no subclass overrides `behaviour` below (decided once per class,
    as keeps_promise decides: every replica's executor asks it of each batch size's decode_step_time)."""
    key = (cls, behaviour)
    held = _FORMULA_HOLDS.get(key)
    if held is None:
        own = cls.step_fixed is not CostModel.step_fixed  # type: ignore[attr-defined]
        held = _FORMULA_HOLDS[key] = own and not any(broken_by(cls, name, behaviour, CostModel) for name in FORMULA)
    return held


#: formula_holds' answers by (class, behaviour).
_FORMULA_HOLDS: dict[tuple[type, tuple[str, ...]], bool] = {}


def _as_arrays(new_tokens: Any, cached_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    # float64: sum n_i * c_i reaches 1e12 on long contexts.
    n = np.asarray(new_tokens, dtype=np.float64).reshape(-1)
    c = np.asarray(cached_tokens, dtype=np.float64).reshape(-1)
    if n.shape != c.shape:
        raise ValueError(f"new_tokens {n.shape} and cached_tokens {c.shape} differ in length")
    return n, c


def attention_pairs(n: np.ndarray, c: np.ndarray) -> float:
    """Causal query-key pairs: new token j (0-based) sees c cached and j + 1 new tokens."""
    return float(np.dot(n, c) + np.dot(n, n + 1.0) / 2.0)


def construct(cls: Any, options: Mapping[str, Any], model_config: Any, hardware: Any,
              parallel: Any) -> CostModel:
    """CostModel.from_config's default: one GPU, the options as constructor keywords."""
    label = f"{cls.__module__}.{cls.__qualname__}"
    if parallel.gpus > 1:
        raise ValueError(f"cost.model={label} times one GPU; parallel.tensor={parallel.tensor} parallel.pipeline="
                         f"{parallel.pipeline} needs a cost model with a from_config that models parallelism "
                         f"(roofline, measured)")
    try:
        params = dict(inspect.signature(cls).parameters)
    except (TypeError, ValueError):  # a compiled constructor without a signature
        params = {}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for k, v in options.items():
            if k not in params:
                known = [n for n in params if n not in ("model_config", "hardware")]
                raise ValueError(f"cost.{k}={v!r} is not a setting of cost.model={label} (its settings: "
                                 f"{', '.join('cost.' + n for n in known) or 'none'}); remove it")
    kw = dict(options)
    for k, v in (("model_config", model_config), ("hardware", hardware)):
        if k in params:
            kw.setdefault(k, v)
    return cls(**kw)
