"""Stateful hypothesis tests of the pure scheduling core (the machine: varlen/testing/invariants.py), run
against every policy × allocator; preemption order; the priority policy against a sorting reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from schedulers import PriorityPolicy
from varlen.scheduler_api import SchedulerPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.clock import SimClock
from varlen.engine import Engine
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import ALLOCATORS, POLICIES, assert_same, policy_class
from varlen.testing.invariants import RecordingExecutor, SchedulingMachine
from varlen.testing.strategies import trace_workloads as workloads

TestScheduling = SchedulingMachine.TestCase
TestScheduling.settings = settings(settings.default, max_examples=4 * settings.default.max_examples,
                                   stateful_step_count=60)


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_requeues_at_front_and_lifo_victim(policy):
    kv = PagedAllocator(num_blocks=6, block_size=4)
    p = policy_class(policy)(max_num_seqs=4, max_num_batched_tokens=64)
    eng = Engine(p, kv, RecordingExecutor(), SimClock(), max_model_len=24)
    a = Request("a", list(range(3, 11)), SamplingParams(max_tokens=16, ignore_eos=True))
    b = Request("b", list(range(20, 28)), SamplingParams(max_tokens=16, ignore_eos=True), arrival=1e-3)
    eng.add_request(a)
    eng.add_request(b)
    while not eng.steps or eng.steps[-1].num_preempted == 0:
        eng.step()
    assert b.num_preemptions == 1 and a.num_preemptions == 0  # the later one is the victim
    assert p.waiting[0] is b
    while eng.has_unfinished():
        eng.step()
    assert a.finish_reason.value == b.finish_reason.value == "length"


def _rank(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival


class SortingPriority(SchedulerPolicy):
    """The straightforward priority policy, the reference: both queues sorted every time."""

    chunked_prefill = True
    repeats_decode_batches = True

    def schedule(self, kv):
        self.running.sort(key=_rank)
        return super().schedule(kv)

    def next_decode_batch(self):
        self.running.sort(key=_rank)
        return super().next_decode_batch()

    def waiting_order(self):
        return sorted(self.waiting, key=_rank)

    def victim_order(self):
        return sorted(self.running, key=_rank, reverse=True)


@given(workloads(), st.booleans())
def test_priority_decides_as_the_sorting_reference(w, fast_forward):
    """PriorityPolicy keeps its queues ranked instead of sorting them every step: the same
    decisions, on random traces with priority and arrival ties, preemptions and tiny pools."""
    def make(policy_cls):
        def build(clock):
            ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
            kv = ALLOCATORS[w["allocator"]](num_blocks=w["num_blocks"], block_size=w["block_size"],
                                            max_model_len=w["max_model_len"])
            return FastForwardEngine(policy_cls(max_num_seqs=w["seats"], max_num_batched_tokens=w["budget"]), kv, ex,
                          clock=clock, max_model_len=w["max_model_len"]), ex
        return build

    reqs = w["reqs"]
    for i, r in enumerate(reqs):  # ties in (priority, arrival): groups of four arriving at one instant
        r.arrival = reqs[i - i % 4].arrival
        r.priority %= 2
    a = simulate(fresh_copies(reqs), make(SortingPriority), fast_forward=fast_forward)
    b = simulate(fresh_copies(reqs), make(PriorityPolicy), fast_forward=fast_forward)
    assert_same(a, b)


@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "remove", "popleft", "clear"]), st.integers(0, 1),
                          st.sampled_from([0.0, 1.0]), st.integers(0, 10**6)), max_size=60))
def test_ranked_queue_is_a_stably_sorted_deque(ops):
    """RankedQueue (the priority policy's waiting queue) reads as a deque under the same operations,
    stably sorted by (priority, arrival): preempted requests put back at the front go first among equals."""
    from collections import deque

    from schedulers.priority import RankedQueue

    ranked, ref = RankedQueue(), deque()
    for i, (op, priority, arrival, pick) in enumerate(ops):
        if op == "remove":
            if ref:
                r = ref[pick % len(ref)]
                ref.remove(r)
                ranked.remove(r)
        elif op == "popleft":  # the head of the ranked order, which a deque would not give
            if ref:
                head = sorted(ref, key=_rank)[0]
                ref.remove(head)
                assert ranked.popleft() is head
        elif op == "clear" and pick % 5 == 0:
            ref.clear()
            ranked.clear()
        elif op in ("append", "appendleft"):
            r = Request(f"r{i}", [1], arrival=arrival, priority=priority)
            getattr(ref, op)(r)
            getattr(ranked, op)(r)
        expected = sorted(ref, key=_rank)
        assert list(ranked) == expected and len(ranked) == len(ref) and bool(ranked) == bool(ref)
        assert all(r in ranked for r in ref)
        if ref:
            assert ranked[0] is expected[0]
