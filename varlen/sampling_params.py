"""How a request's tokens are chosen and when it stops. Plain data, no torch."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Final

import numpy as np

#: Below this temperature logits / temperature may overflow (NaN after softmax): decode greedily.
GREEDY_BELOW = 1e-5
SEED_LIMIT = 2**64  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # top-k logprobs per token, at most (vLLM's default cap, OpenAI chat's top_logprobs)
_INF: Final = math.inf


def _integer(v: object) -> int | None:
    """v as an int when it is an integer (Python or numpy, never a bool), else None."""
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        return None
    return int(v)


def _real(v: object) -> float | None:
    """v as a float when it is a finite real number (never a bool), else None."""
    if type(v) is float:
        return v if -_INF < v < _INF else None  # compiled: a native comparison, not a call (nan fails it)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


Normalized = tuple[int, float, int, float, "int | None", tuple[int, ...], bool, int, tuple[str, ...], "int | None"]


def check_sampling(max_tokens: object, temperature: object, top_k: object, top_p: object, seed: object,
                   stop_token_ids: object, ignore_eos: object, n: object = 1, stop: object = (),
                   logprobs: object = None) -> Normalized | str:
    """The settings as their field types, or one line naming the wrong field, its value and the fix."""
    mt = _integer(max_tokens)
    if mt is None or mt < 1:
        return f"max_tokens={max_tokens!r}: must be an integer >= 1"
    t = _real(temperature)
    if t is None or t < 0:
        return f"temperature={temperature!r}: must be a finite number >= 0 (0 = greedy)"
    k = _integer(top_k)
    if k is None or k < 0:
        return f"top_k={top_k!r}: must be an integer >= 0 (0 = no top-k cut)"
    p = _real(top_p)
    if p is None or not 0 < p <= 1:
        return f"top_p={top_p!r}: must be a number in (0, 1] (1 = no nucleus cut)"
    sd = None
    if seed is not None:
        sd = _integer(seed)
        if sd is None or not 0 <= sd < SEED_LIMIT:
            return f"seed={seed!r}: must be None or an integer in [0, 2**64)"
    # Every request checks these (Engine.add_request): the builtin types first, numpy's only if need be.
    if not isinstance(stop_token_ids, (list, tuple)) and not isinstance(stop_token_ids, np.ndarray):
        return f"stop_token_ids={stop_token_ids!r}: must be a list of token ids"
    stops = []
    for tok in stop_token_ids:
        i = _integer(tok)
        if i is None or i < 0:
            return f"stop_token_ids={stop_token_ids!r}: {tok!r} is not a token id (an integer >= 0)"
        stops.append(i)
    if type(ignore_eos) is not bool and not isinstance(ignore_eos, np.bool_):
        return f"ignore_eos={ignore_eos!r}: must be True or False"
    copies = _integer(n)
    if copies is None or copies < 1:
        return f"n={n!r}: must be an integer >= 1 (completions per prompt)"
    items: list[object] = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else [None]
    texts: list[str] = []
    for text in items:
        if not isinstance(text, str) or not text:
            return f"stop={stop!r}: must be a non-empty string or a list of them (text that ends the output)"
        texts.append(text)
    top = None
    if logprobs is not None:
        top = _integer(logprobs)
        if top is None or not 0 <= top <= MAX_LOGPROBS:
            return (f"logprobs={logprobs!r}: must be None or an integer in [0, {MAX_LOGPROBS}] (the top-k "
                    f"alternatives per token; 0 = the chosen token's only)")
    return mt, t, k, p, sd, tuple(stops), bool(ignore_eos), copies, tuple(texts), top


@dataclass(init=False, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float  # 0 means greedy
    top_k: int  # 0 means no top-k cut
    top_p: float
    seed: int | None  # per-request generator: same seed, same tokens, whatever the batch
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int  # completions of the prompt, each its own request (seeded: seed, seed + 1, ...)
    stop: tuple[str, ...]  # text that ends the output, cut from it (finish reason "stop")
    logprobs: int | None  # per output token: the chosen token's logprob and the top-k's; None: none

    def __init__(self, max_tokens: object = 16, temperature: object = 1.0, top_k: object = 0, top_p: object = 1.0,
                 seed: object = None, stop_token_ids: object = (), ignore_eos: object = False, n: object = 1,
                 stop: object = (), logprobs: object = None) -> None:
        """`stop`: a string or a list of them; `logprobs`: k in [0, 20] (0: the chosen token's only)."""
        ok = check_sampling(max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos, n, stop,
                            logprobs)
        if isinstance(ok, str):
            raise ValueError(f"SamplingParams {ok}")
        (self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed, self.stop_token_ids,
         self.ignore_eos, self.n, self.stop, self.logprobs) = ok

    def problem(self) -> str:
        """What is wrong with these settings now ("" if nothing): fields may be set after construction."""
        ok = check_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed,
                            self.stop_token_ids, self.ignore_eos, self.n, self.stop, self.logprobs)
        return ok if isinstance(ok, str) else ""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
