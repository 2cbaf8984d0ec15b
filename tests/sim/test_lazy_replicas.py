"""Replicas advanced lazily (sim/simulator.py's default loop) give the reference loop's results bit
for bit: the same routing, tokens, token times, finishes, step records and allocator state as
advancing every replica to every arrival (simulate(lazy=False)), for every shipped router, a user's
routers (declaring what they read, or nothing) and misbehaving ones."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sim.fast_forward import FastForwardEngine
from sim.routers import LeastOutstandingRouter, Loads, router_reads
from sim.simulator import LeastIndex, simulate
from sim.validate import fresh_copies
from varlen import registry
from varlen.testing.fast_forward import assert_same, factory, shared_prefix_requests
from varlen.testing.strategies import trace_workloads as workloads


def by_hash(replicas, req):
    """A user's state-free router: the request id's hash."""
    return zlib.crc32(req.req_id.encode()) % len(replicas)


by_hash.reads = "nothing"


def undeclared(replicas, req):
    """A user's router declaring nothing: reads the engines (the fullest KV pool is avoided)."""
    return min(range(len(replicas)), key=lambda i: (replicas[i].engine.kv.usage().reserved_slots, -i))


class MostOutstanding:
    """A user's router reading `outstanding` only, through the sequence (no index)."""

    reads = "outstanding"

    def __call__(self, replicas, req):
        return max(range(len(replicas)), key=lambda i: (replicas[i].outstanding, -i)) if len(req.req_id) % 2 \
            else min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


USER_ROUTERS = {"by_hash": lambda: by_hash, "undeclared": lambda: undeclared, "most_outstanding": MostOutstanding}


def build(router: str):
    return USER_ROUTERS[router]() if router in USER_ROUTERS else registry.build("router", router)


ROUTERS = sorted(registry.names("router")) + sorted(USER_ROUTERS)


def reference_and_lazy(reqs, make, router: str, replicas: int):
    ref = simulate(fresh_copies(reqs), make, num_replicas=replicas, router=build(router), fast_forward=False,
                   lazy=False)
    ref_ff = simulate(fresh_copies(reqs), make, num_replicas=replicas, router=build(router), lazy=False)
    lazy = simulate(fresh_copies(reqs), make, num_replicas=replicas, router=build(router))
    return ref, ref_ff, lazy


@pytest.mark.parametrize("router", ROUTERS)
def test_lazy_replicas_change_nothing(router):
    """A busy fleet (queues, preemptions in the small pool) of 4 replicas, prefix caching on."""
    reqs = shared_prefix_requests(90, rate=120.0, seed=5)
    for num_blocks in (400, 60):
        ref, ref_ff, lazy = reference_and_lazy(reqs, factory("chunked", "paged-cache", num_blocks), router, 4)
        assert_same(ref, lazy)
        assert_same(ref_ff, lazy)
        assert len(set(lazy.routed.values())) > 1


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(ROUTERS), st.integers(2, 4))
def test_lazy_replicas_never_change_anything(w, router, replicas):
    """Random small traces, tiny pools (preemptions, rejections, aborts), every policy and allocator."""
    make = factory(w["policy"], w["allocator"], w["num_blocks"], w["block_size"], w["max_model_len"],
                   w["budget"], w["seats"])
    ref, _, lazy = reference_and_lazy(w["reqs"], make, router, replicas)
    assert_same(ref, lazy)


class Counting(FastForwardEngine):
    calls = 0

    def step(self, start=None, until=None):
        self.calls += 1
        return super().step(start, until)


def test_a_replica_nobody_reads_runs_on_between_arrivals():
    """Round-robin reads nothing: a replica decodes in long stretches however many arrivals the
    others get, where the reference loop cuts its stretches at every arrival."""
    base = factory("chunked", "paged", 2000)

    def make(clock):
        eng, ex = base(clock)
        return Counting(eng.policy, eng.kv, ex, clock=clock, max_model_len=eng.max_model_len), ex

    reqs = shared_prefix_requests(200, rate=400.0, seed=7)
    ref = simulate(fresh_copies(reqs), make, num_replicas=8, router="round_robin", lazy=False)
    lazy = simulate(fresh_copies(reqs), make, num_replicas=8, router="round_robin")
    assert_same(ref, lazy)
    ref_calls = sum(r.engine.calls for r in ref.replicas)
    lazy_calls = sum(r.engine.calls for r in lazy.replicas)
    assert lazy_calls < 0.5 * ref_calls, (lazy_calls, ref_calls)


def failing_at(n: int, value):
    """A router declaring nothing that returns `value` at its n-th call (round-robin before)."""
    calls = []

    def router(replicas, req):
        calls.append(req.req_id)
        return value if len(calls) == n else len(calls) % len(replicas)

    router.reads = "nothing"
    return router


@pytest.mark.parametrize("value", [-1, 7, True, None])
def test_a_bad_index_stops_both_loops_alike(value):
    """The reference loop's error, and every request ended as it ends it (the lazy loop brings the
    replicas it left behind to the arrival first)."""
    reqs = shared_prefix_requests(60, rate=120.0, seed=9)
    make = factory("chunked", "paged", 400)
    runs = []
    for lazy in (False, True):
        copies = fresh_copies(reqs)
        with pytest.raises(ValueError, match=r"returned .*; a router returns the index of one of the 3 replicas") as e:
            simulate(copies, make, num_replicas=3, router=failing_at(40, value), lazy=lazy)
        runs.append((str(e.value), copies))
    (msg_a, a), (msg_b, b) = runs
    assert msg_a == msg_b
    assert all(r.is_finished for r in a + b)
    for x, y in zip(a, b):
        assert (x.req_id, x.finish_reason, x.finish_time, x.finish_message, x.token_times) == \
               (y.req_id, y.finish_reason, y.finish_time, y.finish_message, y.token_times)
    assert sum(r.finish_reason.value == "length" for r in b) > 5  # some finished before the error


def test_reading_what_was_not_declared_is_an_error_naming_the_router():
    reqs = shared_prefix_requests(20, rate=120.0, seed=4)
    make = factory("chunked", "paged", 400)

    def peeks(replicas, req):
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding)

    peeks.reads = "nothing"
    copies = fresh_copies(reqs)
    with pytest.raises(AttributeError, match=r"router test_lazy_replicas\.test_reading_what_was_not_declared_is_an"
                                             r"_error_naming_the_router\.<locals>\.peeks declares reads='nothing' "
                                             r"but read replicas\[0\]; declare what it reads"):
        simulate(copies, make, num_replicas=2, router=peeks)
    assert all(r.is_finished and r.finish_message for r in copies)

    class Kv:
        reads = "outstanding"

        def __call__(self, replicas, req):
            return min(range(len(replicas)), key=lambda i: replicas[i].engine.kv.usage().reserved_slots)

    with pytest.raises(AttributeError, match=r"declares reads='outstanding' but read replica\.engine"):
        simulate(fresh_copies(reqs), make, num_replicas=2, router=Kv())


@pytest.mark.parametrize("reads", ["everything", 3, None])
def test_an_unknown_declaration_is_refused_before_the_run(reads):
    def r(replicas, req):
        return 0

    r.reads = reads
    with pytest.raises(ValueError, match=r"declares reads=.*; declare one of 'nothing', 'outstanding', 'all'"):
        simulate(fresh_copies(shared_prefix_requests(3, 10.0, 1)), factory("chunked", "paged", 100), num_replicas=2,
                 router=r)


def test_shipped_routers_declare_what_they_read():
    assert [router_reads(registry.build("router", n)) for n in ("round_robin", "least_outstanding", "prefix_aware")] \
        == ["nothing", "outstanding", "all"]
    assert router_reads(undeclared) == "all"


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(0, 6)), max_size=60))
def test_least_index_is_the_lowest_index_of_the_least_load(n, updates):
    index, loads = LeastIndex(n), [0] * n
    for k, load in updates:
        if k < n:
            index.set(k, load)
            loads[k] = load
        assert index.least() == min(range(n), key=loads.__getitem__)
        assert LeastOutstandingRouter()(Loads(None, loads, index.least), None) == index.least()
