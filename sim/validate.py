"""Checking the simulator against the real engine: the same batches, and the same metrics."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from sim.cost.base import CostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import SimResult, simulate
from varlen.assembly import build_engine
from varlen.request import Request
from varlen.settings import EngineSizes

Batch = tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]


def batch_sequence(steps: Sequence[Any]) -> list[Batch]:
    """Each step's decision: (request ids, new tokens, cached tokens), in batch order."""
    return [(tuple(s.req_ids), tuple(s.new_tokens), tuple(s.cached_tokens)) for s in steps]


def first_difference(a: Sequence[Batch], b: Sequence[Batch]) -> str | None:
    """None when equal, else where and how the two batch sequences part."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: {x} != {y}"
    if len(a) != len(b):
        return f"{len(a)} steps != {len(b)} steps"
    return None


def fresh_copies(requests: Sequence[Request]) -> list[Request]:
    """New, unserved requests with the same ids, prompts, sampling and arrivals."""
    return [Request(r.req_id, r.prompt_token_ids, r.sampling, arrival=r.arrival, priority=r.priority,
                    expected_output_len=r.expected_output_len) for r in requests]


def simulate_like(requests: Sequence[Request], make_policy: Callable[[], Any], make_kv: Callable[[], Any],
                  max_model_len: int, cost: CostModel | Callable[[], CostModel]) -> SimResult:
    """Simulate `requests` on one replica built like a real engine, timed by `cost` (or its factory)."""

    def make_engine(clock):
        kv = make_kv()
        engine = build_engine(EngineSizes(kv.num_blocks, kv.block_size, max_model_len), make_policy(),
                              lambda **_: kv, lambda _policy, _longest: CostModelExecutor(
                                  cost() if callable(cost) else cost, clock),
                              engine_class=FastForwardEngine, clock=clock)
        return engine, engine.executor

    return simulate(requests, make_engine)
