"""How a request's tokens are chosen and when it stops. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


# init=False and an explicit __init__: compiled (varlen/compiled.py), a dataclass's generated
# __init__ would run as interpreted Python and could not convert before the typed fields check.
@dataclass(init=False, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float  # 0 means greedy
    top_k: int  # 0 means no top-k cut
    top_p: float
    seed: int | None  # per-request generator: same seed, same tokens, whatever the batch
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    def __init__(self, max_tokens: int = 16, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids: tuple[int, ...] | list[int] = (),
                 ignore_eos: bool = False) -> None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.max_tokens = max_tokens
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.seed = None if seed is None else int(seed)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.ignore_eos = bool(ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
