"""Routers: which replica serves an arriving request. A router is a class here (or a user's) and
a yaml in conf/router/ naming it (`_target_`) with its settings; `cluster.router=NAME` picks one
through varlen.registry.

A router is called with the replicas (sim.simulator.Replica: `.engine`, `.outstanding`) and the
request, at the request's arrival, when no replica has run past that instant, and returns the
index of the replica to send it to. It may keep state of its own between calls.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Protocol, Sequence

from varlen.request import Request


class Replica(Protocol):
    """What a router reads of a replica (sim.simulator.Replica is one; routers do not import the
    simulator that calls them)."""

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
    """KV-cache-aware routing (the idea of SGLang's cache-aware router and Mooncake's conductor):
    send a request to the replica holding the longest prefix of its prompt in its KV cache,
    unless that replica is overloaded.

    The cache is asked, not mirrored: each replica's own allocator answers `match_prefix(req)`,
    the tokens its prefix cache would give the request were it admitted now (whole blocks, by the
    chained block hashes PagedAllocator keeps). No router-side copy can drift from it.

    Load balance: the best match wins only when its replica's unfinished requests exceed the
    least loaded replica's by at most `load_threshold`; otherwise, and when no replica holds any
    of the prefix, the least loaded replica (lowest index on ties) takes it. Among equal matches
    the less loaded replica wins. An allocator without a prefix cache matches nothing, so this is
    then least_outstanding.
    """

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
    """A router from a conf/router name (or a class's dotted path) with `options` over its yaml's
    settings, or a router callable as it is."""
    if callable(choice):
        return choice
    from varlen import registry

    return registry.build("router", choice, **(options or {}))
