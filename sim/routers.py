"""Routers: which replica serves an arriving request (`cluster.router=NAME`, conf/router/).

Called at the request's arrival, when no replica has run past that instant, with the replicas and
the request; returns the replica's index. It may keep state between calls.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Protocol, Sequence

from varlen.request import Request


class Replica(Protocol):
    """What a router reads of a replica (sim.simulator.Replica is one)."""

    @property
    def engine(self) -> Any: ...  # the replica's varlen.engine.Engine: its policy, its allocator

    @property
    def outstanding(self) -> int: ...  # requests routed there and not finished


Router = Callable[[Sequence[Replica], Request], int]


class RoundRobinRouter:
    """Replicas in turn, whatever their state."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def __call__(self, replicas: Sequence[Replica], req: Request) -> int:
        return next(self._next) % len(replicas)


class LeastOutstandingRouter:
    """Fewest unfinished requests; ties to the lowest index (deterministic)."""

    def __call__(self, replicas: Sequence[Replica], req: Request) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


class PrefixAwareRouter:
    """The replica whose KV cache holds the longest prefix of the prompt, asked of each allocator
    (`match_prefix`, never mirrored), unless its load exceeds the least loaded's by more than
    `load_threshold`; else, or with no match, the least loaded."""

    def __init__(self, load_threshold: int = 4) -> None:
        if load_threshold < 0:
            raise ValueError(f"load_threshold={load_threshold}: must be >= 0 (requests more than the least loaded replica)")
        self.load_threshold = load_threshold

    def __call__(self, replicas: Sequence[Replica], req: Request) -> int:
        loads = [r.outstanding for r in replicas]
        least = min(range(len(replicas)), key=loads.__getitem__)
        best, best_hit = least, 0
        for i, rep in enumerate(replicas):
            if loads[i] - loads[least] > self.load_threshold:
                continue
            hit = rep.engine.kv.match_prefix(req)
            if hit > best_hit or (hit == best_hit and hit and loads[i] < loads[best]):
                best, best_hit = i, hit
        return best


def make_router(choice: str | Router, options: dict | None = None) -> Router:
    """A router from a conf/router name or dotted path (with `options`), or a callable as it is."""
    if callable(choice):
        return choice
    from varlen import registry

    return registry.build("router", choice, **(options or {}))
