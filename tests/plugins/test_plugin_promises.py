"""A user's plug-in is never silently skipped: a promise that lets the simulator take a shortcut
(the decode fast-forward, a cost model's sums) holds only for the class that declares it
(varlen/promises.py). A subclass of a shipped policy, allocator, cost model or executor that
overrides what the promise is about runs its override on every step, fast-forward on or off, with
the same results; shipped classes keep the fast path."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import varlen.compiled as compiled
from schedulers import ChunkedPolicy
from varlen.scheduler_api import SchedulerPolicy
from sim.cost.base import CostModel, StepSums
from sim.cost.fitted import ProfiledCostModel
from sim.cost.replay import ReplayCostModel
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.kv import ContiguousAllocator, KVAllocator, PagedAllocator
from varlen.promises import PromiseWarning, broken_by
from varlen.testing.fast_forward import (
    ALLOCATORS, POLICIES, assert_same, policy_class, run_both, shared_prefix_requests, state,
)

CAP = 3  # what the overrides below cap: requests or tokens per step


def cost_roofline():
    return RooflineCostModel("tiny", "cpu_2core")


def cost_profiled():
    return ProfiledCostModel(coef={"const": 2e-3, "new_tokens": 3e-6, "num_seqs": 1e-5, "attn_work": 2e-10,
                                   "cached_tokens": 4e-8})


def make_factory(policy_cls, kv_factory, cost_factory=cost_roofline, executor_cls=CostModelExecutor,
                 max_model_len=1024, budget=256, seats=16):
    if not policy_cls.chunked_prefill:
        budget = max(budget, max_model_len)

    def make(clock):
        ex = executor_cls(cost_factory(), clock)
        pol = policy_cls(max_num_seqs=seats, max_num_batched_tokens=budget)
        return FastForwardEngine(pol, kv_factory(), ex, clock=clock, max_model_len=max_model_len), ex

    return make


def paged(num_blocks=90, cls=PagedAllocator, caching=False):
    return lambda: cls(num_blocks=num_blocks, block_size=16, max_model_len=1024, enable_prefix_caching=caching)


REQS = shared_prefix_requests(60, rate=30.0, seed=5)


def run_checked(make, reqs=REQS, broken: str | None = None):
    """Both modes; the same results; the warning (naming the class and method) iff `broken`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PromiseWarning)
        a, b = run_both(reqs, make)
    assert_same(a, b)
    said = [str(w.message) for w in caught if issubclass(w.category, PromiseWarning)]
    if broken is None:
        assert not said, said
    else:
        assert len(said) == 1 and broken in said[0], said  # said once, naming the override
    return b


def token_times(res):
    return [r.token_times for r in res.requests]


def assert_timed_by(res, expected) -> None:
    """Every step's duration is expected(step record): the override timed it."""
    steps = list(res.replicas[0].engine.steps)
    assert [s.duration for s in steps] == pytest.approx([expected(i, s) for i, s in enumerate(steps)], rel=1e-9)


# -- overrides that change what a policy decides ---------------------------------------------

def cap_schedule(P):
    class CapSchedule(P):  # at most CAP requests per step
        def schedule(self, kv):
            out = super().schedule(kv)
            out.scheduled = out.scheduled[:CAP]
            return out
    return CapSchedule


def cap_running(P):
    class CapRunning(P):  # at most CAP tokens for running requests per step
        def _schedule_running(self, kv, out, budget):
            capped = min(budget, CAP)
            return budget - (capped - super()._schedule_running(kv, out, capped))
    return CapRunning


def cap_grant(P):
    class CapGrant(P):  # no grant once CAP tokens are given this step (the first always gets its own)
        def _grant(self, req, budget):
            return 0 if self.max_num_batched_tokens - budget >= CAP else super()._grant(req, budget)
    return CapGrant


def fifo_victims(P):
    class FifoVictims(P):
        def victim_order(self):
            return list(self.running)
    return FifoVictims


def shortest_first(P):
    class ShortestFirst(P):
        def waiting_order(self):
            return sorted(super().waiting_order(), key=lambda r: (r.num_prompt_tokens, r.arrival))
    return ShortestFirst


CHANGES_DECODES = (cap_schedule, cap_running, cap_grant)


@functools.cache
def shipped_token_times(policy: str) -> list:
    """The shipped policy's token times on REQS, paged(70): simulated once for the overrides compared with it."""
    return token_times(simulate(fresh_copies(REQS), make_factory(policy_class(policy), paged(70))))


@pytest.mark.parametrize("override", [*CHANGES_DECODES, fifo_victims, shortest_first], ids=lambda f: f.__name__)
@pytest.mark.parametrize("policy", POLICIES)
def test_user_policy_is_asked_every_step(policy, override):
    P = policy_class(policy)
    user = override(P)
    method = next(n for n in ("schedule", "_schedule_running", "_grant", "victim_order", "waiting_order")
                  if n in user.__dict__)
    b = run_checked(make_factory(user, paged(70)), broken=f"{user.__name__}.{method}")
    assert b.replicas[0].engine.num_fast_forwarded_steps == 0
    if override in CHANGES_DECODES:  # the override matters: a fast-forward that skipped it would differ
        assert shipped_token_times(policy) != token_times(b)
        assert max(len(s.req_ids) for s in b.replicas[0].engine.steps) <= (CAP if override is cap_schedule else 16)


def test_a_user_policy_that_declares_the_promise_keeps_the_fast_path():
    class Declared(ChunkedPolicy):
        repeats_decode_batches = True  # its own: waiting_order does not touch decode batches

        def waiting_order(self):
            return sorted(self.waiting, key=lambda r: (r.num_prompt_tokens, r.arrival))

    b = run_checked(make_factory(Declared, paged(400)))
    assert b.replicas[0].engine.num_fast_forwarded_steps > 0.3 * b.num_steps


# -- allocators ------------------------------------------------------------------------------

class WatermarkPaged(PagedAllocator):
    """Keeps CAP blocks free: a call that would take one of them fails (the policy preempts)."""

    def allocate(self, req, num_tokens):
        need = -(-num_tokens // self.block_size) - len(self.tables.get(req.req_id, ()))
        if need > 0 and self.num_free_plain() + len(self.free_cached) - need < CAP:
            return False
        return super().allocate(req, num_tokens)


def token_capped(A):
    class TokenCapped(A):
        """A pool limited in live tokens rather than blocks: every decode counts."""

        def allocate(self, req, num_tokens):
            if self.live_tokens - self.num_tokens.get(req.req_id, 0) + num_tokens > 1100:
                return False
            return super().allocate(req, num_tokens)
    return TokenCapped


TokenCappedPaged, TokenCappedContiguous = token_capped(PagedAllocator), token_capped(ContiguousAllocator)
ALLOCATOR_OVERRIDES = {  # name: (user class, its arguments, the shipped class it changes)
    "watermark-paged": (WatermarkPaged, (90, 16, 1024, False), PagedAllocator),
    "watermark-paged-cache": (WatermarkPaged, (90, 16, 1024, True), PagedAllocator),
    "token-capped-paged": (TokenCappedPaged, (400, 16, 1024, False), PagedAllocator),
    "token-capped-contiguous-pow2": (TokenCappedContiguous, (400, 16, 1024, "pow2"), ContiguousAllocator),
    "token-capped-contiguous-max": (TokenCappedContiguous, (400, 16, 1024, "max"), ContiguousAllocator),
}


@pytest.mark.parametrize("policy", ["chunked", "continuous"])
@pytest.mark.parametrize("allocator", list(ALLOCATOR_OVERRIDES))
def test_user_allocator_is_asked_every_call(allocator, policy):
    cls, args, shipped = ALLOCATOR_OVERRIDES[allocator]
    user = type(cls.__name__, (cls,), {})  # a class of this test's own: each is checked (and said) once
    b = run_checked(make_factory(policy_class(policy), lambda: user(*args)), broken=f"{cls.__name__}.allocate")
    assert b.replicas[0].engine.num_fast_forwarded_steps == 0
    if not allocator.endswith("max"):  # max-length reservations leave the live-token cap no say
        base = simulate(fresh_copies(REQS), make_factory(policy_class(policy), lambda: shipped(*args)))
        assert token_times(base) != token_times(b)


class ComparablePaged(PagedAllocator):
    def __eq__(self, other):
        return state(self) == state(other)


class RecordingAllocator(KVAllocator):
    """A user allocator written from scratch (the interface's default next_allocation_event: every
    call matters), recording its calls: the fast-forward must make exactly the same ones."""

    def __init__(self, num_blocks, block_size, max_model_len=None):
        super().__init__(num_blocks, block_size, max_model_len)
        self.inner = ComparablePaged(num_blocks, block_size, max_model_len, enable_prefix_caching=False)
        self.calls: list[tuple[str, int]] = []

    def allocate(self, req, num_tokens):
        self.calls.append((req.req_id, num_tokens))
        ok = self.inner.allocate(req, num_tokens)
        self.live_tokens = self.inner.live_tokens
        return ok

    def free(self, req):
        self.calls.append((req.req_id, -1))
        self.inner.free(req)
        self.live_tokens = self.inner.live_tokens

    def block_table(self, req):
        return self.inner.block_table(req)

    def usage(self):
        return self.inner.usage()


def test_allocator_from_scratch_gets_every_call_in_a_fast_forward():
    b = run_checked(make_factory(ChunkedPolicy, lambda: RecordingAllocator(400, 16, 1024)))
    assert b.replicas[0].engine.num_fast_forwarded_steps > 0.3 * b.num_steps  # the interface default is kept


# -- cost models and the executor ------------------------------------------------------------

def doubled(C, method):
    def twice(self, *args):
        return 2 * getattr(super(cls, self), method)(*args)
    cls = type(f"Doubled_{C.__name__}_{method}", (C,), {method: twice})
    return cls


@pytest.mark.parametrize("cost", [RooflineCostModel, ProfiledCostModel], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["step_time_sums", "step_time"])
def test_user_cost_model_times_every_step(cost, method):
    user = doubled(cost, method)
    base_factory = cost_roofline if cost is RooflineCostModel else cost_profiled
    user_factory = (lambda: user("tiny", "cpu_2core")) if cost is RooflineCostModel else \
        (lambda: user(coef=cost_profiled().coefficients()))
    # Both write a formula (sim/cost/base.py); the decode closure is the interface's, derived from
    # the formula only while no class below it overrides step_time_sums, else from step_time_sums:
    # an override of step_time_sums keeps the fast path and is timed by it. The formula promises
    # to equal step_time: an override of step_time alone runs every step.
    broken = None if method == "step_time_sums" else f"{user.__name__}.{method}"
    b = run_checked(make_factory(ChunkedPolicy, paged(400), user_factory), broken=broken)
    plain = base_factory()
    assert_timed_by(b, lambda i, s: 2 * plain.step_time(s.new_tokens, s.cached_tokens, s.num_sampled))
    ff = b.replicas[0].engine.num_fast_forwarded_steps
    assert (ff > 0) if broken is None else (ff == 0)


@pytest.mark.parametrize("cost", [RooflineCostModel, ProfiledCostModel], ids=lambda c: c.__name__)
def test_user_formula_term_times_every_step_and_keeps_the_fast_path(cost):
    """Overriding one term of a shipped model's formula (its attention) is the formula: the sums,
    the decode closure and step_time all follow it, so the fast-forward stays on."""
    user = doubled(cost, "layer_attention")
    base_factory = cost_roofline if cost is RooflineCostModel else cost_profiled
    user_factory = (lambda: user("tiny", "cpu_2core")) if cost is RooflineCostModel else \
        (lambda: user(coef=cost_profiled().coefficients()))
    b = run_checked(make_factory(ChunkedPolicy, paged(400), user_factory))
    plain = base_factory()

    def expected(i, s):
        sums = StepSums.of(s.new_tokens, s.cached_tokens, s.num_sampled)
        return plain.step_time_sums(sums) + plain.parts(sums)["attention_s"]  # attention counted twice
    assert_timed_by(b, expected)
    assert b.replicas[0].engine.num_fast_forwarded_steps > 0.1 * b.num_steps


def test_user_replay_cost_model():
    durations = [1e-3 * (1 + i % 7) for i in range(5000)]
    user = doubled(ReplayCostModel, "step_time")
    b = run_checked(make_factory(ChunkedPolicy, paged(400), lambda: user(durations)))
    assert_timed_by(b, lambda i, s: 2 * durations[i])


class OverheadExecutor(CostModelExecutor):
    """Adds a fixed host overhead to every step."""

    def execute(self, scheduled, kv):
        out = super().execute(scheduled, kv)
        self.clock.advance(5e-3)
        return out


def test_user_executor_runs_every_step():
    b = run_checked(make_factory(ChunkedPolicy, paged(400), executor_cls=OverheadExecutor),
                    broken="OverheadExecutor.execute")
    assert b.replicas[0].engine.num_fast_forwarded_steps == 0
    plain = cost_roofline()
    assert_timed_by(b, lambda i, s: plain.step_time_sums(StepSums.of(s.new_tokens, s.cached_tokens, s.num_sampled))
                    + 5e-3)


def test_a_user_cost_model_that_declares_its_decode_closure_keeps_the_fast_path():
    class Mine(RooflineCostModel):
        def step_time_sums(self, s):
            return 2 * super().step_time_sums(s)

        def decode_step_time(self, num_seqs):  # its own promise: the interface's derived closure
            return CostModel.decode_step_time(self, num_seqs)

    b = run_checked(make_factory(ChunkedPolicy, paged(400), lambda: Mine("tiny", "cpu_2core")))
    assert b.replicas[0].engine.num_fast_forwarded_steps > 0.3 * b.num_steps


# -- shipped classes keep the fast path; the rule itself ---------------------------------------

@pytest.mark.parametrize("allocator", ["paged", "paged-cache", "contiguous-pow2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_shipped_classes_keep_the_fast_path(policy, allocator):
    for cost in (cost_roofline, cost_profiled):
        make = make_factory(policy_class(policy), lambda: ALLOCATORS[allocator](num_blocks=400, block_size=16,
                                                                             max_model_len=1024), cost)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PromiseWarning)
            res = simulate(fresh_copies(REQS), make)
        assert res.replicas[0].engine.num_fast_forwarded_steps > 0.1 * res.num_steps, (policy, allocator, cost)


def test_broken_by():
    class Base:
        promise = False

        def act(self):
            pass

    class Declares(Base):
        promise = True

    class Overrides(Declares):
        def act(self):
            pass

    class Mixin:
        def act(self):
            pass

    class Redeclares(Overrides):
        promise = True

    assert broken_by(Declares, "promise", ["act"], Base) == ""
    assert "Overrides.act" in broken_by(Overrides, "promise", ["act"], Base)
    assert "Mixin.act" in broken_by(type("M", (Mixin, Declares), {}), "promise", ["act"], Base)
    assert broken_by(type("M", (Declares, Mixin), {}), "promise", ["act"], Base) == ""  # above the declarer
    assert broken_by(Redeclares, "promise", ["act"], Base) == ""
    assert broken_by(type("B", (Base,), {"act": lambda self: None}), "promise", ["act"], Base) == ""  # the default
    # Compiled classes list their methods and class attributes in __dict__ as Python classes do.
    assert "repeats_decode_batches" in ChunkedPolicy.__dict__ and "schedule" in SchedulerPolicy.__dict__
    assert "Mine.schedule" in broken_by(type("Mine", (ChunkedPolicy,), {"schedule": lambda s, kv: None}),
                                        "repeats_decode_batches", ["schedule"], SchedulerPolicy)


@pytest.mark.skipif(not compiled.is_compiled(), reason=f"no compiled core: {compiled.status()}")
@pytest.mark.slow
def test_under_the_pure_core_too():
    """This file ran under the compiled core; run it again under the pure-Python one."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "not under_the_pure_core"], cwd=root, env={**os.environ, "VARLEN_PURE": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
