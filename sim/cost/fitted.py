"""The fitted (`profiled`) cost model: a linear model of step time in a few physical features of
the batch, plus optional per-size offsets (a decode-only step of exactly K requests, a step with a
prompt chunk sampling exactly K rows), fitted to a real engine's step log; and the rows to fit it
on (`profile_rows`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from mypy_extensions import mypyc_attr

from sim.cost.base import NOT_SPLIT, CostModel, StepFixed, StepSums, chunk_shape, load_path, one_gpu

# Features a step's time scales with, from its exact sums (logit_rows equals num_seqs by default).
FEATURES: dict[str, Callable[[StepSums], float]] = {
    "const": lambda s: 1.0,  # launch, scheduling, sampling overhead
    "new_tokens": lambda s: s.new,  # linear layers (GEMM rows)
    "num_seqs": lambda s: float(s.num_seqs),  # per-request work: metadata, LM head row, sampling
    "attn_work": lambda s: s.attention_pairs,  # causal query-key pairs
    "cached_tokens": lambda s: s.cached,  # KV read
    "logit_rows": lambda s: float(s.num_logits),
    "prefill_seqs": lambda s: float(s.num_prefills),  # per-prompt work: attention call, mask, gathers
}
# logit_rows: the LM head and sampling run on sampled rows only, and a prompt chunk that does not end
# the prompt samples nothing; on step logs that do not tell the two apart it is fitted at 0.


def _chunk_path(s: StepSums, long_query_min: int) -> tuple[bool, float]:
    """Whether the step's prompt chunks take the backend's long-prompt path (their mean length >= long_query_min;
    every chunk where the backend has none, long_query_min 0) and their causal query-key pairs (chunk_shape)."""
    mean, context = chunk_shape(s.num_seqs, s.num_prefills, s.new, s.new_sq, s.attention_pairs, s.cached)
    if mean == 0.0:
        return False, 0.0
    decodes = s.num_seqs - s.num_prefills
    return mean >= long_query_min, s.attention_pairs - (s.cached - context + decodes)


# Features that depend on the backend's long-prompt threshold (the model's long_query_min): torch_paged sends a
# request of >= 64 new tokens to SDPA (a per-request plan and context gather, its pairs at a matrix product's
# rate) and a shorter one through its paged kernel with the decodes (each query token reads the context as a
# decode does). long_chunks: prompt chunks on the long path (per-request); short_chunk_pairs: the causal pairs
# of chunks under it. The held-out residuals that led here are in README's fidelity section.
PATH_FEATURES: dict[str, Callable[[StepSums, int], float]] = {
    "long_chunks": lambda s, m: float(s.num_prefills) if _chunk_path(s, m)[0] else 0.0,
    "short_chunk_pairs": lambda s, m: 0.0 if _chunk_path(s, m)[0] else _chunk_path(s, m)[1],
}
LINEAR_FEATURES = ("const", "new_tokens", "num_seqs", "attn_work", "cached_tokens", "long_chunks", "short_chunk_pairs",
                   "logit_rows")
#: The form before long_chunks and short_chunk_pairs (every prompt chunk one per-request cost, all pairs one rate).
PLAIN_FEATURES = ("const", "new_tokens", "num_seqs", "attn_work", "cached_tokens", "prefill_seqs", "logit_rows")
# Per-size offsets, NAME + K: a signed step-time offset from the linear form for one exact size, as
# small GEMMs change kernel path by row count. decode_batch_K: a decode-only step of K requests;
# chunk_sampled_K: a step with a prompt chunk that samples K rows (the LM head's rows).
SIZE_FAMILIES = ("decode_batch_", "chunk_sampled_")
MAX_SIZE = 64
# A size offset is fitted only on this many training steps of its size; below, the linear form holds.
MIN_SIZE_STEPS = 50
# The offsets are opt-in: on the fidelity benchmark they did not beat the linear form reliably, and a
# size with too few training steps is left to linear terms the offsets no longer anchor.
DEFAULT_FEATURES = LINEAR_FEATURES


def size_feature(name: str) -> tuple[int, int] | None:
    """(family index, K) for a per-size feature name, else None."""
    for i, prefix in enumerate(SIZE_FAMILIES):
        if name.startswith(prefix):
            k = name[len(prefix):]
            if k.isdigit() and 1 <= int(k) <= MAX_SIZE and str(int(k)) == k:
                return i, int(k)
    return None


def check_features(features: Sequence[str]) -> None:
    """One line naming the unknown features and the known ones."""
    unknown = [f for f in features if f not in FEATURES and f not in PATH_FEATURES and size_feature(f) is None]
    if unknown:
        raise ValueError(f"unknown features {unknown} (known: {', '.join((*FEATURES, *PATH_FEATURES))}, "
                         f"{', '.join(p + 'K' for p in SIZE_FAMILIES)} for K in 1..{MAX_SIZE})")
    if len(set(features)) != len(features):
        raise ValueError(f"features {list(features)}: each at most once")


def size_features(k: int) -> tuple[str, ...]:
    """Both families' offsets for sizes 1..k."""
    return tuple(f"{p}{i}" for p in SIZE_FAMILIES for i in range(1, k + 1))


def _feature_value(name: str, s: StepSums, long_query_min: int = 0) -> float:
    fn = FEATURES.get(name)
    if fn is not None:
        return fn(s)
    path = PATH_FEATURES.get(name)
    if path is not None:
        return path(s, long_query_min)
    fam = size_feature(name)
    assert fam is not None
    if fam[0] == 0:
        return float(s.num_prefills == 0 and s.num_seqs == fam[1])
    return float(s.num_prefills > 0 and s.num_logits == fam[1])


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
    """A linear model of step time in a few physical features, fitted by non-negative least squares,
    plus signed per-size offsets (decode_batch_K, chunk_sampled_K) where the log has enough steps.
    Profile a mix of prefills and decodes: decodes alone make the features collinear."""

    def __init__(self, path: str | os.PathLike | None = None, *,
                 coef: Sequence[float] | Mapping[str, float] | None = None,
                 features: Sequence[str] = DEFAULT_FEATURES, long_query_min: int = 0):
        self.report: FitReport | None = None
        self.meta: dict[str, Any] = {}
        # The profiled backend's long-prompt threshold in new tokens (PATH_FEATURES; 0: one path for every chunk).
        self.long_query_min = int(long_query_min)
        if path is not None:
            d = json.loads(Path(path).read_text())
            if d.get("format") != "varlen.profiled_cost_model":
                raise ValueError(f"{path}: not a profiled cost model file")
            features, coef = d["features"], d["coef"]
            self.long_query_min = int(d.get("long_query_min", 0))
            self.report = FitReport(**d["report"]) if d.get("report") else None
            self.meta = d.get("meta", {})
        if isinstance(coef, Mapping):
            features = list(coef)
            coef = [coef[f] for f in features]
        check_features(features)
        self.features = tuple(features)
        self.coef = np.zeros(len(self.features)) if coef is None else np.asarray(coef, np.float64)
        if self.coef.shape != (len(self.features),):
            raise ValueError(f"{len(self.coef)} coefficients for {len(self.features)} features")
        self._set_terms()

    def _set_terms(self) -> None:
        c = dict.fromkeys((*FEATURES, *PATH_FEATURES), 0.0)
        c.update(zip(self.features, self.coef.tolist()))
        self._c_const, self._c_new, self._c_seqs = c["const"], c["new_tokens"], c["num_seqs"]
        self._c_attn, self._c_cached = c["attn_work"], c["cached_tokens"]
        self._c_long, self._c_short = c["long_chunks"], c["short_chunk_pairs"]
        self._c_logits, self._c_prefills = c["logit_rows"], c["prefill_seqs"]
        self._has_logits = "logit_rows" in self.features
        sizes = [size_feature(f) for f in self.features]
        top = max([fam[1] for fam in sizes if fam is not None], default=0)
        self._decode_off = [0.0] * (top + 1)
        self._chunk_off = [0.0] * (top + 1)
        for fam, v in zip(sizes, self.coef.tolist()):
            if fam is not None:
                (self._decode_off if fam[0] == 0 else self._chunk_off)[fam[1]] = v

    def feature_row(self, new_tokens: Any, cached_tokens: Any, num_logits: int | None = None) -> np.ndarray:
        s = StepSums.of(new_tokens, cached_tokens, num_logits)
        return np.array([_feature_value(f, s, self.long_query_min) for f in self.features])

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
            iterations: int = 4, min_size_steps: int = MIN_SIZE_STEPS, long_query_min: int = 0) -> ProfiledCostModel:
        """Fit to (new_tokens, cached_tokens, duration_s[, num_logits]) per step. weighting "relative":
        by 1 / predicted time squared (the measured one would bias low); outlier_factor: steps slower
        than this many predictions (a GC pause) leave the next iteration's fit; a per-size offset
        seen on fewer than min_size_steps steps stays 0 (the linear form) and is named in meta; long_query_min:
        the engine's attention backend's long-prompt threshold (its long_query_min; PATH_FEATURES)."""
        if weighting not in ("relative", "absolute"):
            raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
        model = cls(features=features, long_query_min=long_query_min)
        X_all, y = model._design(steps)
        # A column equal to an earlier one on every step (logit_rows when every request sampled)
        # cannot be told apart from it: fitted at 0 rather than splitting the cost at random.
        used = [j for j in range(X_all.shape[1]) if not any(np.array_equal(X_all[:, j], X_all[:, i]) for i in range(j))]
        sized = [size_feature(f) is not None for f in model.features]
        sparse = [model.features[j] for j in range(len(sized)) if sized[j] and (X_all[:, j] != 0).sum() < min_size_steps]
        used = [j for j in used if model.features[j] not in sparse]
        X = X_all[:, used]
        # Size offsets are signed (a size can run faster than the linear form): a mirrored column each.
        signed = [i for i, j in enumerate(used) if sized[j]]
        keep: Any = np.ones(len(y), bool)
        coef = np.zeros(X.shape[1])
        for it in range(max(1, iterations)):
            if it == 0 or weighting == "absolute":
                w = np.ones_like(y)
            else:
                w = 1.0 / np.maximum(X @ coef, 1e-3 * float(np.median(y)))
            A, b = X[keep] * w[keep, None], y[keep] * w[keep]
            # Unit-norm columns: the features span ten orders of magnitude.
            norms = np.linalg.norm(A, axis=0)
            norms[norms == 0] = 1.0
            A = np.hstack([A, -A[:, signed]]) / np.concatenate([norms, norms[signed]])
            x = _nnls(A, b) / np.concatenate([norms, norms[signed]])
            coef = x[:len(used)]
            coef[signed] -= x[len(used):]
            if outlier_factor is not None:
                pred = X @ coef
                keep = ~(y > outlier_factor * np.maximum(pred, 1e-12))
                if keep.sum() < X.shape[1]:
                    keep[:] = True
        model.coef = np.zeros(X_all.shape[1])
        model.coef[used] = coef
        model._set_terms()
        model.report = model._score(X_all, y)
        model.meta = {"weighting": weighting, "outliers_dropped": int((~keep).sum())}
        if sparse:
            model.meta["size_offsets_unfitted"] = sparse  # too few steps of that size: linear form
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
             "meta": self.meta, "long_query_min": self.long_query_min}
        Path(path).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfiledCostModel:
        return cls(path)

    @classmethod
    def from_config(cls, options: dict[str, Any], model_config: dict[str, Any], hardware: Any,
                    parallel: Any) -> CostModel:
        """cost.path: a fitted model's JSON (ProfiledCostModel.save); one GPU."""
        one_gpu("profiled", parallel, "replays or fits one measured engine as it ran")
        return load_path(options, "profiled", "a fitted model JSON (ProfiledCostModel.save)", cls.load)

    @property
    def overhead_form(self) -> tuple[float, float, float]:
        """(seconds per step, per request, per prefill request): the fit's const, num_seqs and prefill_seqs."""
        return self._c_const, self._c_seqs, self._c_prefills

    def size_offset(self, num_seqs: int, num_logits: int, num_prefills: int) -> float:
        """The fitted offset for this exact step size (decode_batch_K or chunk_sampled_K), else 0."""
        if num_prefills == 0:
            return self._decode_off[num_seqs] if num_seqs < len(self._decode_off) else 0.0
        return self._chunk_off[num_logits] if 0 <= num_logits < len(self._chunk_off) else 0.0

    def size_offset_name(self, num_seqs: int, num_logits: int, num_prefills: int) -> str | None:
        """The feature whose offset this step size takes (sim.explain), or None (the linear form)."""
        name = f"decode_batch_{num_seqs}" if num_prefills == 0 else f"chunk_sampled_{num_logits}"
        return name if name in self.features else None

    def step_fixed(self, num_seqs: int, new: float, num_logits: int, num_prefills: int) -> StepFixed:
        linear = self._c_new * new
        head = self._c_logits * num_logits
        overhead = self._c_const + self._c_seqs * num_seqs + self._c_prefills * num_prefills
        overhead += self.size_offset(num_seqs, num_logits, num_prefills)
        # The fit knows no layers: one "layer" of the new tokens' linear work.
        return StepFixed(1.0, linear, overhead + head, num_seqs=num_seqs, new=new, linear_s=linear,
                         lm_head_s=head if self._has_logits else NOT_SPLIT, overhead_s=overhead,
                         num_prefills=num_prefills)

    def layer_attention(self, f: StepFixed, pairs: float, cached: float) -> float:
        t = self._c_attn * pairs + self._c_cached * cached
        if self._c_long or self._c_short:  # PATH_FEATURES: _chunk_path's arithmetic on the step's sums
            mean, context = chunk_shape(f.num_seqs, f.num_prefills, f.new, f.new_sq, pairs, cached)
            if mean >= self.long_query_min and mean > 0.0:
                t += self._c_long * f.num_prefills
            elif mean > 0.0:
                t += self._c_short * (pairs - (cached - context + (f.num_seqs - f.num_prefills)))
        return t
def profile_rows(steps: Sequence[Any], busy_period: bool = True,
                 max_gap_factor: float = 5.0) -> list[Step]:
    """(new_tokens, cached_tokens, seconds, num_logits) per recorded step, for ProfiledCostModel.fit;
    busy_period=True charges each step the gap to the next one unless the engine went idle."""
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

