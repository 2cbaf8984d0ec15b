"""Routers: which replica serves an arriving request (`cluster.router=NAME`, conf/router/).

Called at the request's arrival with the replicas and the request; returns the replica's index. It
may keep state between calls. A router declares what it reads of the replicas in `reads`, so the
simulator advances only the replicas whose state it needs (sim/simulator.py):
- "nothing": the request and its own state only (round-robin, a hash): it is given a sequence of
  the right length whose replicas cannot be read, and only the chosen replica is advanced;
- "outstanding": each replica's `outstanding` only, exact at the arrival; the sequence it is given
  also answers `least_outstanding()` at once;
- "all" (a router that declares nothing): every replica, advanced to the arrival.
Reading more than it declares is an error naming the router, never a stale value.
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

READS = ("nothing", "outstanding", "all")


def router_reads(router: Any) -> str:
    """What `router` declares it reads of the replicas: its `reads`, "all" when it declares nothing."""
    reads = getattr(router, "reads", "all")
    if not isinstance(reads, str) or reads not in READS:
        from sim.route_check import router_name

        raise ValueError(f"router {router_name(router)} declares reads={reads!r}; declare one of "
                         f"{', '.join(map(repr, READS))} (or nothing, which means 'all')")
    return reads


def _overread(router: Any, reads: str, what: str) -> AttributeError:
    from sim.route_check import router_name

    return AttributeError(f"router {router_name(router)} declares reads={reads!r} but read {what}; declare "
                          f"what it reads (reads='all', or no `reads`, gives it every replica as it is)")


class Unread(Sequence[Any]):
    """The replicas as a router reading nothing sees them: how many, and no replica to read."""

    def __init__(self, router: Any, n: int) -> None:
        self._router, self._n = router, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        raise _overread(self._router, "nothing", f"replicas[{i!r}]")


class LoadView:
    """One replica as a router reading `outstanding` sees it."""

    __slots__ = ("_loads", "_i")

    def __init__(self, loads: Loads, i: int) -> None:
        self._loads, self._i = loads, i

    @property
    def outstanding(self) -> int:
        return self._loads.counts[self._i]

    def __getattr__(self, name: str) -> Any:
        raise _overread(self._loads.router, "outstanding", f"replica.{name}")


class Loads(Sequence[LoadView]):
    """The replicas as a router reading `outstanding` sees them: `counts` (kept exact at each arrival
    by the simulator) and the least loaded replica, lowest index first, from `least_outstanding()`."""

    def __init__(self, router: Any, counts: list[int], least: Callable[[], int]) -> None:
        self.router, self.counts, self.least_outstanding = router, counts, least
        self._views = [LoadView(self, i) for i in range(len(counts))]

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: Any) -> Any:
        return self._views[i]


class RoundRobinRouter:
    """Replicas in turn, whatever their state."""

    reads = "nothing"

    def __init__(self) -> None:
        self._next = itertools.count()

    def __call__(self, replicas: Sequence[Replica], req: Request) -> int:
        return next(self._next) % len(replicas)


class LeastOutstandingRouter:
    """Fewest unfinished requests; ties to the lowest index (deterministic)."""

    reads = "outstanding"

    def __call__(self, replicas: Sequence[Replica], req: Request) -> int:
        if isinstance(replicas, Loads):  # the simulator's index: O(log replicas), not a scan
            return replicas.least_outstanding()
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


class PrefixAwareRouter:
    """The replica whose KV cache holds the longest prefix of the prompt, asked of each allocator
    (`match_prefix`, never mirrored), unless its load exceeds the least loaded's by more than
    `load_threshold`; else, or with no match, the least loaded."""

    reads = "all"  # the allocators' caches

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
