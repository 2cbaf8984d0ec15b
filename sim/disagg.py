"""Disaggregated prefill/decode (DistServe, Splitwise, Mooncake): prefill instances compute each
prompt and its first token, the KV moves over a link to a decode instance, which generates the rest.
Every instance is the engine's own objects on its own simulated clock.

A request's path:
1. Arrival: the router picks a prefill instance, which serves a *prefill copy* (max_tokens=1).
2. Prefill done: the copy's first token is the request's (TTFT); the prefill engine keeps the
   copy's KV blocks (`DisaggEngine.held`). Nothing left to generate: it finishes here.
3. Decode admission (pull): the least loaded decode instance takes requests in order of prefill
   completion when its allocator has room for the prompt and first token (all or nothing).
4. Transfer: prompt tokens x KV bytes per token: latency + bytes / bandwidth over
   min(prefill TP, decode TP) streams; one transfer at a time per port (FIFO).
5. Transfer end: prefill frees the blocks; decode queues the request with its prompt marked cached
   (`ReceivingAllocator.match_prefix`), so it never recomputes the prefill unless preempted.

Received requests hold blocks while waiting, unlike a colocated engine's; so a decode instance
with a waiting request that needs memory starts no transfer, and an idle one whose policy
schedules nothing evicts received requests (last first) to be recomputed (`num_evicted`).
Decode fast-forwards only up to the next event that could reach it.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sim.executor import CostModelExecutor
from sim.route_check import check_route
from sim.routers import Router, make_router
from sim.progress import for_run
from sim.simulator import Replica, gc_paused
from varlen.clock import SimClock
from sim.fast_forward import FastForwardEngine
from varlen.interrupt import poll
from varlen.kv.base import KVAllocator
from varlen.request import FinishReason, Request
from varlen.steplog import StepLog


@dataclass(frozen=True)
class Link:
    """One KV-transfer path between a prefill and a decode GPU (conf/sim/sim.yaml, cluster.links)."""

    name: str
    bandwidth_gbs: float  # GB/s, one direction, per GPU
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0 or not self.latency_s >= 0:
            raise ValueError(f"link {self.name}: bandwidth_gbs={self.bandwidth_gbs} must be > 0 and "
                             f"latency_s={self.latency_s} >= 0")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.bandwidth_gbs * 1e9)


class DisaggEngine(FastForwardEngine):
    """The engine of one instance of a disaggregated pool: prefill keeps finished requests' blocks
    (`held`) until sent; decode `receive`s requests whose KV arrived and waits while transfers hold blocks."""

    def __init__(self, *args: Any, keep_finished_kv: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.keep_finished_kv = keep_finished_kv
        self.held: dict[str, Request] = {}
        self.incoming = 0  # transfers under way here, their blocks reserved
        self.num_evicted = 0  # received requests whose blocks an idle engine took back
        self._retry = False

    def _finish(self, req: Request, reason: FinishReason, message: str = "", failed: bool = False) -> None:
        if not self.keep_finished_kv or failed or reason not in (FinishReason.LENGTH, FinishReason.STOP):
            super()._finish(req, reason, message, failed)
            return
        # Engine._finish less kv.free: the prompt's KV is computed and must still be sent.
        req.finish(reason, self.clock.now(), message)
        self.requests.pop(req.req_id, None)
        self.policy.remove(req)
        self.executor.release(req)
        self.held[req.req_id] = req

    def release_held(self, req_id: str) -> None:
        self.kv.free(self.held.pop(req_id))

    def receive(self, req: Request) -> None:
        """Queue `req`, its KV already reserved here, as the policy queues any arrival."""
        kv = self.kv
        if not isinstance(kv, ReceivingAllocator) or req.req_id not in kv.received:
            raise AssertionError(f"request {req.req_id!r} received without blocks reserved for its KV")
        self.requests[req.req_id] = req
        self.policy.add(req)

    def needs_memory_waiting(self) -> bool:
        """Whether a waiting request here needs blocks (preempted or evicted here, not holding its KV)."""
        kv = self.kv
        if not isinstance(kv, ReceivingAllocator):
            return bool(self.policy.waiting)
        return any(not kv.holds_received(r) for r in self.policy.waiting)

    def _step(self, start: float) -> list[Request]:
        while True:
            self._retry = False
            finished = super()._step(start)
            if not self._retry:
                return finished

    def _unstick(self) -> list[Request]:
        if self.policy.running or not self.policy.waiting:
            return []
        kv = self.kv
        if isinstance(kv, ReceivingAllocator):
            # Take back the blocks held by received requests waiting behind the head, the last admitted first.
            for req in reversed(list(self.policy.waiting)):
                if kv.holds_received(req):
                    kv.free(req)
                    del kv.received[req.req_id]
                    req.reset_for_recompute()
                    self.num_preemptions += 1
                    self.num_evicted += 1
                    self._retry = True
                    return []
        if self.held or self.incoming:
            return []
        return super()._unstick()


class ReceivingAllocator:
    """Mixin over a decode allocator class: `match_prefix` answers a received prompt as cached until freed."""

    received: dict[str, int]

    def reserve(self, req: Request, num_received: int) -> bool:
        """Slots for all of `req`'s tokens (the prompt and the first token); False if no room."""
        if not self.allocate(req, req.num_tokens):  # type: ignore[attr-defined]
            return False
        self.received[req.req_id] = num_received
        return True

    def holds_received(self, req: Request) -> bool:
        """Whether `req` waits with its received KV (not yet admitted, never preempted here)."""
        return req.req_id in self.received and req.num_computed_tokens == 0 and len(self.block_table(req)) > 0  # type: ignore[attr-defined]

    def match_prefix(self, req: Request) -> int:
        n = self.received.get(req.req_id)
        if n is not None:
            if len(self.block_table(req)):  # type: ignore[attr-defined]
                return n
            del self.received[req.req_id]
        return super().match_prefix(req)  # type: ignore[misc]


_receiving_classes: dict[type, type] = {}


def receiving(cls: type) -> type:
    """`cls` with ReceivingAllocator's match_prefix, keeping cls's decode promises (varlen/promises.py)."""
    # By the MRO: compiled, the allocator classes share KVAllocator's ABC cache (issubclass answers mix up).
    if not (isinstance(cls, type) and KVAllocator in cls.__mro__):
        raise ValueError(f"a decode instance's allocator must be a KVAllocator class, got {cls!r}")
    sub = _receiving_classes.get(cls)
    if sub is None:
        base: Any = cls
        # The decode-growth methods (varlen/kv/growth.py) come from cls, not ReceivingAllocator, where cls has them.
        ns = {n: getattr(base, n) for n in ("next_allocation_event", "grow_decodes", "decode_steps_fit")
              if hasattr(base, n)}
        ns["__module__"] = __name__

        def __init__(self: Any, *a: Any, **kw: Any) -> None:
            base.__init__(self, *a, **kw)
            self.received = {}

        ns["__init__"] = __init__
        sub = _receiving_classes[cls] = type(f"Receiving{cls.__name__}", (ReceivingAllocator, cls), ns)
    return sub


@dataclass(slots=True)
class Transfer:
    req_id: str
    prefill: int  # instance indices (prefill 0..P-1, decode P..P+D-1)
    decode: int
    tokens: int
    bytes: float
    ready: float
    start: float
    end: float


@dataclass
class DisaggResult:
    """SimResult's interface (not a subclass: SimResult is compiled), plus the pools and transfers."""

    requests: list[Request]
    replicas: list[Replica]  # the prefill instances, then the decode instances
    wall_s: float
    num_prefill: int
    routed: dict[str, int] = field(default_factory=dict)  # req_id -> prefill instance
    transfers: list[Transfer] = field(default_factory=list)
    decode_routed: dict[str, int] = field(default_factory=dict)
    prefill_hit_tokens: dict[str, int] = field(default_factory=dict)
    blocked: list[int] = field(default_factory=list)  # per instance: waits for transfers to end

    @property
    def steps(self) -> StepLog:
        return StepLog.concat(r.engine.steps for r in self.replicas)

    @property
    def num_steps(self) -> int:
        return sum(len(r.engine.steps) for r in self.replicas)

    @property
    def total_slots(self) -> int:
        """One decode instance's KV pool."""
        return self.decode[0].engine.kv.capacity_tokens

    @property
    def prefill(self) -> list[Replica]:
        return self.replicas[:self.num_prefill]

    @property
    def decode(self) -> list[Replica]:
        return self.replicas[self.num_prefill:]


MakeEngine = Callable[[SimClock], tuple[DisaggEngine, CostModelExecutor]]


def simulate_disaggregated(requests: Sequence[Request], make_prefill: MakeEngine, make_decode: MakeEngine,
                           num_prefill: int, num_decode: int, link: Link, kv_bytes_per_token: float,
                           streams: int = 1, router: str | Router = "round_robin",
                           router_options: dict | None = None, fast_forward: bool = True) -> DisaggResult:
    """Serve `requests` on `num_prefill` prefill and `num_decode` decode instances (module doc)."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"a disaggregated cluster needs >= 1 prefill and >= 1 decode instance, "
                         f"got {num_prefill} and {num_decode}")
    if streams < 1 or not kv_bytes_per_token > 0:
        raise ValueError(f"streams={streams} must be >= 1 and kv_bytes_per_token={kv_bytes_per_token} > 0")
    route = make_router(router, router_options)
    reps: list[Replica] = []
    for i in range(num_prefill + num_decode):
        role = "prefill" if i < num_prefill else "decode"
        clock = SimClock()
        engine, executor = (make_prefill if i < num_prefill else make_decode)(clock)
        if engine.clock is not clock or executor.clock is not clock:
            raise ValueError(f"make_{role} must put the engine and its executor on the clock it is given")
        if not isinstance(engine, DisaggEngine) or engine.keep_finished_kv != (role == "prefill"):
            raise ValueError(f"make_{role} must build a DisaggEngine with keep_finished_kv={role == 'prefill'}")
        if role == "decode" and not isinstance(engine.kv, ReceivingAllocator):
            raise ValueError("make_decode must give its engine a receiving(...) allocator")
        reps.append(Replica(i, engine, clock, executor))
    lens = {r.engine.max_model_len for r in reps}
    if len(lens) != 1:
        raise ValueError(f"every instance must have the same max_model_len, got {sorted(lens)}")
    res = DisaggResult(list(requests), reps, 0.0, num_prefill)
    progress = for_run(len(res.requests))
    t0 = time.perf_counter()
    with gc_paused():
        _Loop(res, route, link, kv_bytes_per_token, streams, fast_forward, progress).run()
    res.wall_s = time.perf_counter() - t0
    if progress is not None:
        progress.close(max(r.clock.now() for r in reps), len(res.requests))
    return res


# Event kinds in their order at equal times: a step must see what finished or arrived then.
_DONE, _XFER, _STEP = 0, 1, 2


class _Loop:
    def __init__(self, res: DisaggResult, route: Router, link: Link, kv_bytes_per_token: float, streams: int,
                 fast_forward: bool, progress: Callable[[float, int, Sequence[Replica]], None] | None = None):
        self.res, self.route, self.link = res, route, link
        self.progress = progress
        self.done = 0  # requests ended: the instances hold copies and in-flight ones, so count, not derive
        self.kv_bytes, self.streams, self.fast_forward = kv_bytes_per_token, streams, fast_forward
        self.P = res.num_prefill
        self.reps = res.replicas
        n = len(self.reps)
        res.blocked = [0] * n
        self.events: list[tuple[float, int, int, int, Any]] = []  # (time, kind, seq, instance, payload)
        self.decode_steps: list[tuple[float, int]] = []  # (time, instance): decode steps, apart (`until`)
        self.seq = 0
        self.busy = [False] * n
        self.waiting_kv: list[deque[tuple[Request, int]]] = [deque() for _ in range(n)]
        self.send_free = [0.0] * n
        self.recv_free = [0.0] * n
        self.orig: dict[str, Request] = {}
        self.now = 0.0

    def push(self, t: float, kind: int, k: int, payload: Any = None) -> None:
        if kind == _STEP and k >= self.P:
            heapq.heappush(self.decode_steps, (t, k))
        else:
            self.seq += 1
            heapq.heappush(self.events, (t, kind, self.seq, k, payload))

    def wake(self, k: int) -> None:
        """Give instance k its next step if it has work and none is due (an idle one's clock moves to now)."""
        rep = self.reps[k]
        if not self.busy[k] and rep.engine.has_unfinished():
            self.busy[k] = True
            rep.clock.sleep_until(self.now)
            self.push(rep.executor.ready_time(rep.clock.now()), _STEP, k)

    def run(self) -> None:
        pending = sorted(self.res.requests, key=lambda r: r.arrival)
        i, n, inf = 0, len(pending), float("inf")
        count = 0
        while i < n or self.events or self.decode_steps:
            count += 1
            if count & 1023 == 0:
                poll()
                if self.progress is not None:
                    self.progress(self.now, self.done, ())  # no replicas: all `done` requests have ended
            ta = pending[i].arrival if i < n else inf
            te = self.events[0][0] if self.events else inf
            td = self.decode_steps[0][0] if self.decode_steps else inf
            now = min(ta, te, td)
            if now < self.now:
                raise AssertionError(f"event at t={now} after t={self.now}")
            self.now = now
            if ta <= te and ta <= td and i < n:
                self.arrive(pending[i])
                i += 1
            elif te <= td:
                t, kind, _, k, payload = heapq.heappop(self.events)
                if kind == _DONE:
                    self.prefill_done(t, k, payload)
                elif kind == _XFER:
                    self.transfer_end(t, payload)
                else:
                    self.step(t, k, ta)
            else:
                t, k = heapq.heappop(self.decode_steps)
                # Transfers waiting for room: step by step, so a finish frees blocks for them at once.
                self.step(t, k, t if self.waiting_kv[k] else min(ta, te))
        self.check_end()

    def arrive(self, req: Request) -> None:
        prefills = self.reps[:self.P]
        k = check_route(self.route, self.route(prefills, req), self.P) if self.P > 1 else 0
        self.res.routed[req.req_id] = k
        self.orig[req.req_id] = req
        copy = Request(req.req_id, req.prompt_token_ids, dataclasses.replace(req.sampling, max_tokens=1),
                       req.arrival, req.priority, req.prompt, expected_output_len=1)
        copy._hashes = req._hashes  # the same prompt's block hashes, computed once for both
        rep = self.reps[k]
        if not self.busy[k]:
            rep.clock.sleep_until(req.arrival)
        rep.engine.add_request(copy)
        if copy.is_finished:
            req.finish(copy.finish_reason, copy.finish_time, copy.finish_message)  # type: ignore[arg-type]
            self.done += 1
            return
        self.wake(k)

    def step(self, t: float, k: int, until: float) -> None:
        rep = self.reps[k]
        eng = rep.engine
        rep.clock.sleep_until(t)
        before = len(eng.steps)
        finished = eng.step(t, until if self.fast_forward else None)
        self.busy[k] = False
        if len(eng.steps) == before and rep.clock.now() == t and not finished:
            if eng.policy.running:
                raise RuntimeError(f"instance {k}: the policy scheduled nothing at t={t} with requests running")
            # Blocked on blocks held for (or reserved by) transfers: a transfer's end wakes it.
            self.res.blocked[k] += 1
        else:
            self.wake(k)
        if k < self.P:
            for copy in finished:
                self.push(copy.finish_time, _DONE, k, copy)  # type: ignore[arg-type]
        else:
            received = eng.kv.received  # type: ignore[attr-defined]
            for r in finished:
                received.pop(r.req_id, None)
            self.done += len(finished)
            self.admit_transfers(k, rep.clock.now())

    def prefill_done(self, t: float, k: int, copy: Request) -> None:
        req = self.orig[copy.req_id]
        req.first_scheduled = copy.first_scheduled
        req.num_preemptions += copy.num_preemptions
        if copy.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
            req.finish(copy.finish_reason, t, copy.finish_message)  # type: ignore[arg-type]
            self.done += 1
            return
        self.res.prefill_hit_tokens[req.req_id] = copy.num_prefix_hit_tokens
        req.output_token_ids.append(copy.output_token_ids[0])
        req.token_times.append(copy.token_times[0])
        prefill = self.reps[k].engine
        reason = prefill._stop_reason(req, req.output_token_ids[-1])
        if reason is not None:
            req.finish(reason, t)
            self.done += 1
            prefill.release_held(req.req_id)  # type: ignore[attr-defined]
            self.wake(k)
            return
        d = min(range(self.P, len(self.reps)), key=self.decode_load)
        self.res.decode_routed[req.req_id] = d
        self.waiting_kv[d].append((req, k))
        self.admit_transfers(d, t)

    def decode_load(self, d: int) -> int:
        p = self.reps[d].engine.policy
        return len(p.waiting) + len(p.running) + len(self.waiting_kv[d]) + self.reps[d].engine.incoming  # type: ignore[attr-defined]

    def admit_transfers(self, d: int, now: float) -> None:
        """Start the transfers decode instance `d` has room for, in order (no overtaking)."""
        queue, eng = self.waiting_kv[d], self.reps[d].engine
        if queue and eng.needs_memory_waiting():  # type: ignore[attr-defined]
            return  # the room it frees goes to those first (module doc)
        kv = eng.kv
        while queue:
            req, k = queue[0]
            if not kv.reserve(req, req.num_prompt_tokens):  # type: ignore[attr-defined]
                return
            queue.popleft()
            eng.incoming += 1  # type: ignore[attr-defined]
            tokens = req.num_prompt_tokens
            nbytes = tokens * self.kv_bytes
            start = max(now, self.send_free[k], self.recv_free[d])
            end = start + self.link.seconds(nbytes / self.streams)
            self.send_free[k] = self.recv_free[d] = end
            tr = Transfer(req.req_id, k, d, tokens, nbytes, req.token_times[0], start, end)
            self.res.transfers.append(tr)
            self.push(end, _XFER, d, (tr, req))

    def transfer_end(self, t: float, payload: tuple[Transfer, Request]) -> None:
        tr, req = payload
        self.reps[tr.prefill].engine.release_held(req.req_id)  # type: ignore[attr-defined]
        self.wake(tr.prefill)
        d = self.reps[tr.decode]
        d.engine.incoming -= 1  # type: ignore[attr-defined]
        d.engine.receive(req)  # type: ignore[attr-defined]
        if not self.busy[tr.decode]:
            d.clock.sleep_until(t)
        self.wake(tr.decode)

    def check_end(self) -> None:
        # The request's prefix hit is the prefill instance's, not the received prompt's.
        for rid, hit in self.res.prefill_hit_tokens.items():
            self.orig[rid].num_prefix_hit_tokens = hit
        for rep in self.reps:
            eng = rep.engine
            if eng.held or eng.incoming or eng.requests:  # type: ignore[attr-defined]
                raise AssertionError(f"instance {rep.index} ended holding KV or requests")
        left = [r.req_id for r in self.res.requests if not r.is_finished]
        if left or any(self.waiting_kv):
            raise AssertionError(f"requests left unfinished: {left[:5]}")
        if self.done != len(self.res.requests):
            raise AssertionError(f"{self.done} requests counted as ended of {len(self.res.requests)}")
