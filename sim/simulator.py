"""Discrete-event simulation: request arrivals, replicas behind a router, and on each replica the
unmodified engine loop (`varlen.engine.Engine`) with a cost-model executor and a simulated clock.
A step sees arrivals at its very start: with one replica this is `Engine.run` exactly.

Replicas interact only through the router, so each advances on its own: to an arrival when it
receives it, or when the router reads it (what a router reads: `reads`, sim/routers.py). A replica
that is not looked at runs on, fast-forwarding its decodes in long stretches, whatever the other
replicas' arrivals. The results are those of advancing every replica to every arrival (`lazy=False`,
the reference loop), bit for bit (tests/sim/test_lazy_replicas.py).
"""

from __future__ import annotations

import atexit
import gc
import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterator, Sequence

from sim.executor import CostModelExecutor
from sim.release import Release, arrival_order
from sim.route_check import check_route
from sim.routers import LeastOutstandingRouter, Loads, Router, Unread, make_router, router_reads
from sim.fast_forward import FastForwardEngine
from sim.progress import for_run
from varlen.clock import SimClock
from varlen.engine import Engine, _error_message
from varlen.interrupt import poll
from varlen.metrics import RequestResults
from varlen.request import FinishReason, Request
from varlen.steplog import StepLog


@dataclass(slots=True)
class Replica:
    index: int
    engine: Engine
    clock: SimClock
    executor: CostModelExecutor

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished (waiting or running)."""
        p = self.engine.policy
        return len(p.waiting) + len(p.running)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the block (millions of long-lived objects, no cycles); survivors are
    frozen on the way out so its next pass skips them, and unfrozen at exit: a frozen object is never
    collected, not even at shutdown, so garbage cycles frozen with them would outlive the modules they
    hold (Triton's bindings then print `nanobind: leaked ...` lines after the program's output)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            atexit.unregister(gc.unfreeze)  # registered once, however many simulations run
            atexit.register(gc.unfreeze)
            gc.enable()


@dataclass
class SimResult:
    requests: list[Request] | RequestResults  # RequestResults: simulate(keep_requests=False)
    replicas: list[Replica]
    wall_s: float
    routed: dict[str, int] = field(default_factory=dict)  # req_id -> replica index

    @property
    def results(self) -> RequestResults:
        """Every request's figures as columns (the summary's and requests.csv's input)."""
        r = self.requests
        return r if isinstance(r, RequestResults) else RequestResults.of(r)

    @property
    def steps(self) -> StepLog:
        """Every replica's steps, one log (a sequence of StepRecords; columns() for arrays)."""
        return StepLog.concat(r.engine.steps for r in self.replicas)

    @property
    def num_steps(self) -> int:
        return sum(len(r.engine.steps) for r in self.replicas)

    @property
    def total_slots(self) -> int:
        """One replica's KV pool (usage fractions are per replica)."""
        return self.replicas[0].engine.kv.capacity_tokens


def simulate(requests: Sequence[Request], make_engine: Callable[[SimClock], tuple[Engine, CostModelExecutor]],
             num_replicas: int = 1, router: str | Router = "round_robin", fast_forward: bool = True,
             router_options: dict | None = None, keep_requests: bool = True, lazy: bool = True) -> SimResult:
    """Serve `requests` on `num_replicas` engines, make_engine(clock) -> (engine, executor) for each;
    router: a conf/router name or a callable; fast_forward: tell each step the next arrival.
    keep_requests=False: each request is released as it ends (its slot in `requests` given a
    placeholder) and the result holds their figures as columns (SimResult.requests a RequestResults);
    the engines stream token times (Engine.stream_token_times): no request keeps a list of them.
    lazy: advance a replica only when it gets an arrival or the router reads it (False: every
    replica to every arrival, the reference; same results)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    route = make_router(router, router_options)
    reads = router_reads(route)
    replicas = []
    for i in range(num_replicas):
        clock = SimClock()
        engine, executor = make_engine(clock)
        if engine.clock is not clock or executor.clock is not clock:
            raise ValueError("make_engine must put the engine and its executor on the clock it is given")
        if fast_forward and not isinstance(engine, FastForwardEngine):
            raise ValueError(f"simulate(fast_forward=True) needs make_engine to build a sim.fast_forward.FastForwardEngine, "
                             f"got {type(engine).__name__}: build one (it takes Engine's arguments), or pass "
                             f"fast_forward=False")
        replicas.append(Replica(i, engine, clock, executor))
    release: Release | None = None
    pending: Sequence[Request]  # keep_requests=False: a TraceRequests builds each request as it arrives
    if keep_requests:
        pending = sorted(requests, key=lambda r: r.arrival)
    else:
        pending, order = arrival_order(requests)
        release = Release(requests, pending, order)
        for rep in replicas:  # no request keeps its token times: their gaps go straight to the run's table
            rep.engine.stream_token_times(release.results.itl.add_counts)
    routed: dict[str, int] = {}
    progress = for_run(len(pending))
    t0 = time.perf_counter()
    with gc_paused():
        try:
            ticker = progress if release is None else release.ticker(progress)
            if lazy:
                _lazy_loop(pending, replicas, route, reads, routed, fast_forward, ticker)
            else:
                _event_loop(pending, replicas, route, routed, fast_forward, ticker)
        except BaseException as err:
            _end_all(pending, replicas, err)
            raise
    wall = time.perf_counter() - t0
    if progress is not None:
        progress.close(max(r.clock.now() for r in replicas), len(pending))
    if release is not None:
        for rep in replicas:
            rep.engine.flush_token_gaps()
        return SimResult(release.close(), replicas, wall, routed)
    return SimResult(list(requests), replicas, wall, routed)


def _end_all(pending: Sequence[Request], replicas: list[Replica], err: BaseException) -> None:
    """The simulation stopped: every request not ended yet ends `aborted`, saying why (as Engine.run)."""
    for rep in replicas:
        eng = rep.engine
        eng._fail(list(eng.requests.values()), err, "the simulation stopped")
    for r in pending:
        if not r.is_finished:
            r.finish(FinishReason.ABORTED, r.arrival, _error_message("the simulation stopped before this request arrived", err))


class LeastIndex:
    """Replicas' loads in a segment tree: the least loaded, lowest index on ties, in O(log replicas)."""

    def __init__(self, n: int) -> None:
        size = 1
        while size < n:
            size *= 2
        self.size = size
        self.tree = [0] * (2 * size)
        for j in range(size + n, 2 * size):
            self.tree[j] = 1 << 62  # no replica: never the least
        for j in range(size - 1, 0, -1):
            self.tree[j] = min(self.tree[2 * j], self.tree[2 * j + 1])

    def set(self, k: int, load: int) -> None:
        tree = self.tree
        j = self.size + k
        tree[j] = load
        j >>= 1
        while j:
            left, right = tree[2 * j], tree[2 * j + 1]
            tree[j] = left if left <= right else right
            j >>= 1

    def least(self) -> int:
        tree, size = self.tree, self.size
        j = 1
        while j < size:
            j = 2 * j if tree[2 * j] <= tree[2 * j + 1] else 2 * j + 1
        return j - size


def _advance(rep: Replica, t: float, until: float, fast_forward: bool) -> float:
    """Replica `rep`'s step due at `t` (with the decodes it promises before `until`); its next step's
    time, inf when it has nothing left."""
    eng = rep.engine
    rep.clock.sleep_until(t)
    before = len(eng.steps)
    if fast_forward:
        assert isinstance(eng, FastForwardEngine)
        eng.step(t, until)
    else:
        eng.step(t)
    if len(eng.steps) == before and rep.clock.now() == t and eng.policy.running:
        # Engine.run would spin here too; a simulation must not hang silently.
        raise RuntimeError(f"replica {rep.index}: the policy scheduled nothing at t={t} with requests running")
    return rep.executor.ready_time(rep.clock.now()) if eng.has_unfinished() else float("inf")


#: Steps a replica's horizon times at first (_lazy_loop), doubled each time it must look further.
FIRST_REACH: Final = 8
#: Arrivals _lazy_loop reads at once.
ARRIVALS_READ: Final = 256

def _lazy_loop(pending: Sequence[Request], replicas: list[Replica], route: Router, reads: str, routed: dict[str, int],
               fast_forward: bool, progress: Callable[[float, int, list[Replica]], None] | None = None) -> None:
    """Arrivals in order; before each, the replicas the router reads (reads="nothing": none; "all":
    every replica with a step due before the arrival; "outstanding": those whose count may have
    changed before it), advanced to it; then the chosen one, advanced to it."""
    num_replicas = len(replicas)
    pick: Callable[[Any, Request], object] = route  # compiled: no int cast before check_route
    inf = float("inf")
    due = [inf] * num_replicas  # each replica's next step, inf when it has nothing to do
    # (horizon, replica) for the replicas the router reads: a replica is advanced to an arrival after
    # its horizon, its next step for "all", the first step that may change its count for "outstanding"
    # (until then its count is exact however far behind it is). Stale entries are skipped.
    busy: list[tuple[float, int]] = []
    horizon = [inf] * num_replicas  # each replica's live entry in `busy`
    # Each replica's steps to time next when its horizon is a lower bound (count_horizon), else 0: an
    # arrival usually cuts a stretch long before its end, so it is timed in doubling pieces as needed.
    reach = [0] * num_replicas
    shared = reads != "nothing" and num_replicas > 1
    counts = [0] * num_replicas
    index = LeastIndex(num_replicas) if reads == "outstanding" else None
    ahead = index is not None and fast_forward  # horizons past the next step
    view: Any = replicas
    if reads == "nothing":
        view = Unread(route, num_replicas)
    elif index is not None:
        view = Loads(route, counts, index.least)
    # least_outstanding itself (not a subclass): its answer is the index's, asked without the call.
    least = index is not None and type(route) is LeastOutstandingRouter
    i, n = 0, len(pending)
    events = 0
    # The arrivals read a slice at a time: a TraceRequests builds a slice's requests in one pass.
    chunk: list[Request] = []
    at = 0  # the next arrival's index in chunk
    while i < n:
        if at == len(chunk):
            got = pending[i:i + ARRIVALS_READ]
            chunk = got if isinstance(got, list) else list(got)
            at = 0
        req = chunk[at]
        at += 1
        a = req.arrival
        i += 1
        if shared:
            while busy and busy[0][0] < a:
                h, k = heapq.heappop(busy)
                if h != horizon[k]:
                    continue
                if reach[k]:  # a lower bound: the stretch timed further, the replica left where it is
                    h = horizon[k] = _horizon(replicas[k], due[k], ahead, reach)
                    if h >= a:
                        heapq.heappush(busy, (h, k))
                        continue
                    if reach[k]:
                        heapq.heappush(busy, (h, k))  # popped again at once, timed further still
                        continue
                events += _catch_up(replicas[k], due, a, fast_forward)
                reach[k] = FIRST_REACH
                h = horizon[k] = _horizon(replicas[k], due[k], ahead, reach)
                if h < inf:
                    heapq.heappush(busy, (h, k))
                if index is not None:
                    c = replicas[k].outstanding
                    if c != counts[k]:
                        counts[k] = c
                        index.set(k, c)
        events += 1
        if events & 1023 == 0:
            poll()  # Ctrl-C: compiled, this loop would not see it otherwise (varlen/interrupt.py)
            if progress is not None:
                progress(a, i - 1, replicas)
        k = 0
        if least:
            assert index is not None
            k = index.least()
        elif num_replicas > 1:
            try:
                v = pick(view, req)
                if type(v) is int and 0 <= v < num_replicas:  # check_route's common case, inline
                    k = v
                else:
                    k = check_route(route, v, num_replicas)
            except BaseException:
                # Stop where the reference loop stops: every replica at the arrival.
                for j in range(num_replicas):
                    _catch_up(replicas[j], due, a, fast_forward)
                raise
        rep = replicas[k]
        routed[req.req_id] = k
        events += _catch_up(rep, due, a, fast_forward)
        idle = due[k] == inf
        if idle:
            rep.clock.sleep_until(a)
        rep.engine.add_request(req)
        if idle and rep.engine.has_unfinished():
            due[k] = rep.executor.ready_time(rep.clock.now())
        if shared:
            reach[k] = FIRST_REACH
            h = _horizon(rep, due[k], ahead, reach)
            if h != horizon[k]:
                horizon[k] = h
                if h < inf:
                    heapq.heappush(busy, (h, k))
        if index is not None:
            c = rep.outstanding
            if c != counts[k]:
                counts[k] = c
                index.set(k, c)
    # Every arrival served: each replica runs to its end, on its own.
    for k in range(num_replicas):
        _catch_up(replicas[k], due, inf, fast_forward)


def _horizon(rep: Replica, t: float, ahead: bool, reach: list[int]) -> float:
    """Replica `rep`'s horizon (sim/simulator.py's _lazy_loop) given its next step's time `t`, timing
    at most reach[k] steps ahead (0: all); reach[k] becomes the steps to time next if it is a lower bound."""
    k = rep.index
    if not ahead or t != rep.clock.now():  # not at its step (a replayed timeline): no promise
        reach[k] = 0
        return t
    eng = rep.engine
    assert isinstance(eng, FastForwardEngine)
    h = eng.count_horizon(reach[k])
    reach[k] = eng.horizon_bound
    return h


def _catch_up(rep: Replica, due: list[float], until: float, fast_forward: bool) -> int:
    """Replica `rep`'s steps due before `until`; how many calls that took."""
    k = rep.index
    t = due[k]
    calls = 0
    while t < until:
        calls += 1
        if calls & 1023 == 0:
            poll()
        t = _advance(rep, t, until, fast_forward)
    due[k] = t
    return calls


def _event_loop(pending: Sequence[Request], replicas: list[Replica], route: Router, routed: dict[str, int],
                fast_forward: bool, progress: Callable[[float, int, list[Replica]], None] | None = None) -> None:
    """The reference loop: every replica advanced to every arrival (simulate(lazy=False))."""
    num_replicas = len(replicas)
    pick: Callable[[list[Replica], Request], object] = route  # compiled: no int cast before check_route
    busy: list[tuple[float, int]] = []  # (time of the replica's next step, replica index)
    is_busy = [False] * num_replicas
    inf = float("inf")
    i, n = 0, len(pending)
    events = 0
    while i < n or busy:
        events += 1
        t_step = busy[0][0] if busy else inf
        if events & 1023 == 0:
            poll()  # Ctrl-C: compiled, this loop would not see it otherwise (varlen/interrupt.py)
            if progress is not None:
                progress(min(t_step, pending[i].arrival) if i < n else t_step, i, replicas)
        if i < n and pending[i].arrival <= t_step:
            req = pending[i]
            i += 1
            k = check_route(route, pick(replicas, req), num_replicas) if num_replicas > 1 else 0
            rep = replicas[k]
            routed[req.req_id] = k
            if not is_busy[k]:
                rep.clock.sleep_until(req.arrival)
            rep.engine.add_request(req)
            if not is_busy[k] and rep.engine.has_unfinished():
                is_busy[k] = True
                heapq.heappush(busy, (rep.executor.ready_time(rep.clock.now()), k))
            continue
        t, k = heapq.heappop(busy)
        rep = replicas[k]
        eng = rep.engine
        rep.clock.sleep_until(t)
        before = len(eng.steps)
        # Replicas interact only through the router: one may run ahead until the next arrival.
        if fast_forward:
            assert isinstance(eng, FastForwardEngine)
            eng.step(t, pending[i].arrival if i < n else inf)
        else:
            eng.step(t)
        if len(eng.steps) == before and rep.clock.now() == t and eng.policy.running:
            # Engine.run would spin here too; a simulation must not hang silently.
            raise RuntimeError(f"replica {k}: the policy scheduled nothing at t={t} with requests running")
        if eng.has_unfinished():
            heapq.heappush(busy, (rep.executor.ready_time(rep.clock.now()), k))
        else:
            is_busy[k] = False
