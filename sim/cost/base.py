"""The cost model interface: each model writes its step-time formula once, from the batch's sums.

A step is described the way the engine batches it: request i brings `new_tokens[i]` new tokens
after `cached_tokens[i]` tokens already in its KV cache (prefill: cached 0; chunk: cached = the
prompt done so far; decode: new 1). Logits are computed for one row per request unless the
caller says how many rows (`num_logits`), since a step's batch does not say which chunks end
their prompt.

The formula comes in two halves, because a decode fast-forward times millions of steps whose
sizes are fixed and whose caches alone grow:
- `step_fixed(num_seqs, new, num_logits, num_prefills)`: everything the step's sizes fix
  (a `StepFixed`: the model's own precomputed terms and the explain parts they make);
- `layer_attention(fixed, pairs, cached)`: one layer's attention, from the query-key pairs and
  the cached tokens; `step_total(fixed, attention)`: the step's seconds.
From these the base class derives `step_time_sums`, `step_time` (from arrays), the decode
closure `decode_step_time` and `parts` (sim.explain's breakdown), so they cannot drift apart.
A model that cannot be written this way (replay) overrides `step_time` alone.
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

#: The formula's methods: a class that defines any of them promises step_time_sums (derived from
#: them) is its step_time (varlen/promises.py; sim/executor.py checks it).
FORMULA = ("step_fixed", "layer_attention", "step_total")

#: A StepFixed part the model cannot tell apart from another (explain shows null). NaN rather
#: than None: a float field stays unboxed in the compiled core, and StepFixed is built per step.
NOT_SPLIT = math.nan

PARTS = ("embedding_s", "linear_s", "attention_s", "lm_head_s", "communication_s", "overhead_s")


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


@dataclass(init=False, slots=True)
class StepFixed:
    """What a step's sizes fix: the formula's terms, the sizes attention reads, the explain parts.

    step = per_step + layers x (per_layer + attention), every term in seconds:
    `per_step` once per step (embedding, LM head, overhead), `per_layer` one layer besides its
    attention, `layers` how many layers run in sequence. A model that sums its layers into
    per_step ahead of time (measured's tables) sets per_layer to 0. The parts (seconds for the
    whole step, NOT_SPLIT where the model cannot tell them apart) only feed sim.explain."""

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

    def __init__(self, layers: float, per_layer: float, per_step: float, *, num_seqs: int = 0, new: float = 0.0,
                 embedding_s: float = NOT_SPLIT, linear_s: float = NOT_SPLIT, lm_head_s: float = NOT_SPLIT,
                 communication_s: float = 0.0, overhead_s: float = NOT_SPLIT) -> None:
        self.layers, self.per_layer, self.per_step = layers, per_layer, per_step
        self.num_seqs, self.new = num_seqs, new
        self.embedding_s, self.linear_s, self.lm_head_s = embedding_s, linear_s, lm_head_s
        self.communication_s, self.overhead_s = communication_s, overhead_s


@mypyc_attr(allow_interpreted_subclasses=True)
class CostModel(ABC):
    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """Build from the simulator's config; every cost model is built this way
        (sim/cost/registry.py). `options`: the cost section's settings (conf/cost/<name>.yaml's
        keys, then the user's cost.*; cost.model and unset ones left out); `model_config`: the
        HF config dict; `hardware`: a HardwareSpec; `parallel`: a sim.parallel.Parallelism.
        This default serves a one-GPU model whose constructor takes the options as keyword
        arguments, and model_config / hardware where it names them."""
        built: CostModel = construct(cls, options, model_config, hardware, parallel)
        return built

    # -- the formula (a model writes these three) ------------------------------------------------

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        """What the step's sizes fix (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} has no step formula; it times steps by step_time")

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        """Seconds of one layer's attention over `pairs` causal query-key pairs and `cached` tokens."""
        raise NotImplementedError(f"{type(self).__name__} has no step formula")

    def step_total(self, f: StepFixed, attention: float) -> float:
        """The step's seconds given one layer's attention: the formula (StepFixed)."""
        return f.per_step + f.layers * (f.per_layer + attention)

    # -- derived ----------------------------------------------------------------------------------

    @property
    def uses_sums(self) -> bool:
        """Whether the model times a step from its sums (a formula, or its own step_time_sums)."""
        cls = type(self)
        return cls.step_time_sums is not CostModel.step_time_sums or cls.step_fixed is not CostModel.step_fixed

    def step_time_sums(self, s: StepSums) -> float:
        """Seconds for one step, from the batch's sums: the formula."""
        f = self.step_fixed(s.num_seqs, s.new, s.num_logits, s.num_prefills)
        return self.step_total(f, self.layer_attention(f, s.attention_pairs, s.cached))

    def step_time(self, new_tokens: ArrayLike, cached_tokens: ArrayLike,
                  num_logits: int | None = None) -> float:
        """Seconds for one step; num_logits defaults to one logit row per request. The sums of
        integer token counts are exact, so this is step_time_sums bit for bit."""
        return self.step_time_sums(StepSums.of(new_tokens, cached_tokens, num_logits))

    def decode_step_time(self, num_seqs: int) -> Callable[[int], float]:
        """The time of a pure-decode step of `num_seqs` requests as a function of the tokens in
        their caches in all: step_time_sums of that step, bit for bit, so a fast-forwarded
        simulation keeps the clock of a step-by-step one exactly. The simulator times millions
        of such steps: the sizes' part of the formula is computed once per batch size."""
        if not formula_holds(type(self), ("step_time_sums",)):
            # step_time_sums overridden below the formula: follow the override.
            def generic(cached: int) -> float:
                return self.step_time_sums(StepSums(num_seqs, num_seqs, cached, cached, num_seqs, num_seqs))
            return generic
        f = self.step_fixed(num_seqs, num_seqs, num_seqs, 0)
        half_pairs = (num_seqs + num_seqs) / 2.0  # StepSums.attention_pairs less sum n_i * c_i

        def step(cached: int) -> float:
            return self.step_total(f, self.layer_attention(f, cached + half_pairs, cached))
        return step

    def parts(self, s: StepSums) -> dict[str, float | None]:
        """The step's time part by part (sim.explain): the formula's own terms."""
        f = self.step_fixed(s.num_seqs, s.new, s.num_logits, s.num_prefills)
        attention = f.layers * self.layer_attention(f, s.attention_pairs, s.cached)
        parts = {"embedding_s": f.embedding_s, "linear_s": f.linear_s, "attention_s": attention,
                 "lm_head_s": f.lm_head_s, "communication_s": f.communication_s, "overhead_s": f.overhead_s}
        return {k: None if math.isnan(v) else v for k, v in parts.items()}

    def next_start(self, now: float) -> float:
        """When the next step may start: now, unless the model replays a recorded timeline."""
        return now



def settings(options: Mapping[str, Any], model: str, known: tuple[str, ...]) -> dict[str, Any]:
    """The options of cost.model=`model`, or a one-line error naming one it does not read (a
    setting must never be silently ignored)."""
    for k, v in options.items():
        if k not in known:
            raise ValueError(f"cost.{k}={v!r} is not a setting of cost.model={model} (its settings: "
                             f"{', '.join('cost.' + n for n in known) or 'none'}); remove it")
    return dict(options)


def load_path(options: Mapping[str, Any], model: str, what: str, load: Callable[[str], CostModel]) -> CostModel:
    """cost.path read by `load`, with one-line errors: unset, not a file, not `what`."""
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
    """Whether `cls` has a formula and no class below the one that wrote it overrides `behaviour`
    (then the formula times its steps; else the override does)."""
    if cls.step_fixed is CostModel.step_fixed:  # type: ignore[attr-defined]
        return False
    return not any(broken_by(cls, name, behaviour, CostModel) for name in FORMULA)


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


def construct(cls: Any, options: Mapping[str, Any], model_config: Any, hardware: Any,
              parallel: Any) -> CostModel:
    """CostModel.from_config's default: one GPU, the options as constructor keywords (an option
    the constructor does not take is an error, never dropped), plus model_config and hardware
    where the constructor names them."""
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
