"""Generated traces: `SyntheticTrace` holds the settings, `LengthDist` a length distribution."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from varlen.traces.trace import Columns


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token counts: "fixed" (value), "uniform" (low..high), "lognormal" (mean of the lengths,
    sigma of their log) or "empirical" (a trace's column), clipped to [min, max]. `parse` also
    reads "512", "uniform:128:2048", "lognormal:1000:0.8", "empirical:azure_conv"."""

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1
    mean: float = 0.0
    sigma: float = 1.0
    source: str | None = None
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal", "empirical"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.value < 0:
            raise ValueError(f"fixed length must be >= 0, got {self.value}")
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError(f"uniform needs 0 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs mean > 0 and sigma >= 0, got {self.mean}, {self.sigma}")
        if self.kind == "empirical" and not self.source:
            raise ValueError("empirical length distribution needs a source trace")

    @classmethod
    def parse(cls, spec: int | str | Mapping[str, Any] | LengthDist) -> LengthDist:
        if isinstance(spec, LengthDist):
            return spec
        if isinstance(spec, (int, np.integer)):
            return cls("fixed", value=int(spec))
        if isinstance(spec, Mapping):
            return cls(**dict(spec))
        if isinstance(spec, str):
            s = spec.strip()
            if s.isdigit():
                return cls("fixed", value=int(s))
            kind, _, rest = s.partition(":")
            try:
                if kind == "empirical":
                    return cls("empirical", source=rest)
                args = [a for a in rest.split(":") if a]
                if kind == "fixed":
                    return cls("fixed", value=int(args[0]))
                if kind == "uniform":
                    return cls("uniform", low=int(args[0]), high=int(args[1]))
                if kind == "lognormal":
                    mx = int(args[2]) if len(args) > 2 else None
                    return cls("lognormal", mean=float(args[0]), sigma=float(args[1]), max=mx)
            except (IndexError, ValueError) as e:
                raise ValueError(f"bad length distribution {spec!r}: {e}") from None
        raise ValueError(f"bad length distribution {spec!r}")

    def sample(self, rng: np.random.Generator, n: int, values: np.ndarray | None = None,
               index: np.ndarray | None = None) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.value, np.float64)
        elif self.kind == "uniform":
            x = rng.integers(self.low, self.high + 1, n).astype(np.float64)
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2  # so that the lengths, not their logs, have the mean
            x = np.rint(rng.lognormal(mu, self.sigma, n))
        else:
            if values is None:
                raise ValueError(f"empirical lengths from {self.source!r} need that trace's column")
            if index is None:
                index = rng.integers(0, len(values), n)
            x = values[index].astype(np.float64)
        hi = np.inf if self.max is None else self.max
        return np.clip(x, self.min, hi).astype(np.int64)


@dataclass(frozen=True, slots=True)
class SyntheticTrace:
    """`requests` arrivals at `rate` req/s, Poisson or gamma (`cv`: inter-arrival coefficient of
    variation, > 1 burstier), lengths from `prompt_len` / `output_len` (LengthDist.parse)."""

    requests: int = 1000
    rate: float = 1.0
    arrival: str = "poisson"
    cv: float = 1.0
    prompt_len: int | str | Mapping[str, Any] | LengthDist = 512
    output_len: int | str | Mapping[str, Any] | LengthDist = 128
    seed: int = 0

    def generate(self, empirical: Callable[[str], tuple[np.ndarray, np.ndarray]]) -> Columns:
        """`empirical(source)`: that trace's (prompt, output) lengths."""
        n, rate, cv = self.requests, self.rate, self.cv
        if n < 0:
            raise ValueError(f"requests must be >= 0, got {n}")
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        # Independent streams, so that changing a length distribution leaves arrivals unchanged.
        r_arr, r_prompt, r_out = (np.random.default_rng(s) for s in np.random.SeedSequence(self.seed).spawn(3))
        if self.arrival == "poisson":
            gaps = r_arr.exponential(1.0 / rate, max(n - 1, 0))
        elif self.arrival == "gamma":
            if not cv > 0:
                raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
            shape = 1.0 / cv**2  # inter-arrival CV = cv at mean 1/rate
            gaps = r_arr.gamma(shape, 1.0 / (rate * shape), max(n - 1, 0))
        else:
            raise ValueError(f"arrival must be 'poisson' or 'gamma', got {self.arrival!r}")
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)])[:n]
        pd_, od = LengthDist.parse(self.prompt_len), LengthDist.parse(self.output_len)
        pv = empirical(pd_.source)[0] if pd_.kind == "empirical" else None
        ov = empirical(od.source)[1] if od.kind == "empirical" else None
        joint = None
        if pd_.kind == od.kind == "empirical" and pd_.source == od.source:
            # Same source for both: resample whole rows, keeping the prompt/output correlation.
            joint = r_prompt.integers(0, len(pv), n)
        prompt = pd_.sample(r_prompt, n, pv, joint)
        output = od.sample(r_out, n, ov, joint)
        if n and prompt.min() < 1:
            raise ValueError("synthetic prompt lengths must be >= 1 (set min >= 1)")
        return Columns(arrivals, prompt, output, np.arange(n))
