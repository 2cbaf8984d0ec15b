"""Stateful hypothesis tests of the pure scheduling core: allocators, policies and the engine loop.

Random add / step / abort sequences against every policy × allocator, with a pool small enough
that preemption happens. After every rule: no block leaked or held twice, reference counts equal
the number of holders, limits respected, and the step's batch is what the scheduler decided. At
teardown, every request ends (liveness). Torch-free: the executor is a stand-in.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schedulers import PriorityPolicy
from varlen.scheduler_api import SchedulerPolicy
from sim.cost_models import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from test_sim_fastforward import ALLOCATORS, POLICIES, assert_same, policy_class, workloads
from varlen.clock import SimClock
from varlen.engine import Engine, Executor
from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.request import Request, Status
from varlen.sampling_params import SamplingParams

EOS = 1


class RecordingExecutor(Executor):
    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int, int]]] = []

    def execute(self, scheduled, kv):
        self.calls.append([(r.req_id, r.num_computed_tokens, n) for r, n in scheduled])
        for r, n in scheduled:  # the batch may only touch slots the request holds
            assert len(kv.block_table(r)) * kv.block_size >= r.num_computed_tokens + n
        # A deterministic stand-in model: sometimes EOS, so both stop reasons occur.
        return [(hash((r.req_id, r.num_tokens)) % 50 + 1) if r.num_computed_tokens + n == r.num_tokens else None
                for r, n in scheduled]


class SchedulingMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(POLICIES), allocator=st.sampled_from(["paged", "contiguous"]),
                block_size=st.sampled_from([1, 2, 4, 16]), seats=st.integers(1, 6),
                reservation=st.sampled_from(["max", "pow2", "oracle"]))
    def setup(self, policy, allocator, block_size, seats, reservation):
        self.max_len = 48
        num_blocks = -(-self.max_len // block_size) * 2  # two full-length requests
        chunked = policy_class(policy).chunked_prefill
        self.budget = 8 if chunked else self.max_len
        self.policy = policy_class(policy)(max_num_seqs=seats, max_num_batched_tokens=self.budget)
        self.kv = (PagedAllocator(num_blocks, block_size, self.max_len) if allocator == "paged"
                   else ContiguousAllocator(num_blocks, block_size, self.max_len, reservation))
        self.exe = RecordingExecutor()
        self.engine = Engine(self.policy, self.kv, self.exe, SimClock(), self.max_len, eos_token_id=EOS)
        self.reqs: list[Request] = []
        self.prefixes = [[7] * 20, list(range(3, 40))]

    @rule(n=st.integers(0, 40), share=st.sampled_from([None, 0, 1]), max_tokens=st.integers(1, 20),
          priority=st.integers(0, 3), ignore_eos=st.booleans())
    def add(self, n, share, max_tokens, priority, ignore_eos):
        prompt = (self.prefixes[share][:n] if share is not None else []) + [100 + len(self.reqs)] * \
            (n - (min(n, len(self.prefixes[share])) if share is not None else 0))
        r = Request(f"r{len(self.reqs)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    arrival=self.engine.clock.now() + 1e-9, priority=priority,
                    expected_output_len=max_tokens)
        self.reqs.append(r)
        self.engine.add_request(r)
        if n == 0:
            assert r.finish_reason.value == "rejected"

    @precondition(lambda self: self.engine.has_unfinished())
    @rule()
    def step(self):
        before = len(self.exe.calls)
        promised = self.policy.next_decode_batch()  # the fast-forward's promise, when it makes one
        promised_ids = None if promised is None else [r.req_id for r in promised]
        preemptions = self.engine.num_preemptions
        self.engine.clock.advance(0.01)
        self.engine.step()
        # Kept while every allocation succeeds (a preemption means one failed).
        if promised_ids is not None and self.engine.num_preemptions == preemptions:
            assert len(self.exe.calls) > before, "a promised decode step did not run"
            assert self.exe.calls[-1] == [(rid, c, 1) for rid, c, _ in self.exe.calls[-1]]
            assert [c[0] for c in self.exe.calls[-1]] == promised_ids, "the step broke the decode promise"
        if len(self.exe.calls) > before:
            call, rec = self.exe.calls[-1], self.engine.steps[-1]
            assert [c[0] for c in call] == rec.req_ids and [c[2] for c in call] == rec.new_tokens
            assert len(call) <= self.policy.max_num_seqs
            # A chunked policy's budget bounds the step; a whole-prompt one's bounds its prompts
            # (the decodes beside them do not share it: schedulers/base.py).
            budgeted = call if self.policy.chunked_prefill else [c for c in call if c[2] > 1 or c[1] == 0]
            assert sum(n for *_, n in budgeted) <= self.policy.max_num_batched_tokens
            assert len({c[0] for c in call}) == len(call), "a request twice in one batch"

    @precondition(lambda self: any(not r.is_finished for r in self.reqs))
    @rule(k=st.integers(0, 10**6))
    def abort(self, k):
        live = [r for r in self.reqs if not r.is_finished]
        self.engine.abort(live[k % len(live)].req_id)

    @invariant()
    def blocks_are_accounted_for(self):
        holders = {r.req_id for r in self.policy.running}
        if isinstance(self.kv, PagedAllocator):
            held = Counter(b for rid, t in self.kv.tables.items() for b in t)
            assert set(self.kv.tables) == holders, "only running requests hold blocks"
            free = [*self.kv.free_plain, *self.kv.free_cached]
            assert len(set(free)) == len(free), "a block listed free twice"
            assert all(self.kv.block_hash[b] is None for b in self.kv.free_plain), "cached content on the plain stack"
            assert self.kv.live_tokens == sum(self.kv.num_tokens.values())
            for b in range(self.kv.num_blocks):
                assert self.kv.ref_count[b] == held[b], f"block {b}: refcount != holders"
                assert (b in free) == (held[b] == 0), f"block {b} leaked or double-listed"
            for t in self.kv.tables.values():
                assert len(set(t)) == len(t)
        else:
            assert set(self.kv.runs) == holders
            assert self.kv.live_tokens == sum(self.kv.num_tokens.values())
            assert self.kv.free_blocks == sum(n for _, n in self.kv.extents)
            spans = sorted([*self.kv.extents, *self.kv.runs.values()])
            at = 0
            for start, length in spans:
                assert start == at and length > 0, "runs overlap or a gap is lost"
                at += length
            assert at == self.kv.num_blocks

    @invariant()
    def states_are_consistent(self):
        for r in self.reqs:
            if r.status is Status.RUNNING:
                assert r in self.policy.running
                assert len(self.kv.block_table(r)) * self.kv.block_size >= r.num_computed_tokens
            elif r.status is Status.WAITING:
                assert r in self.policy.waiting and r.num_computed_tokens == 0
            else:
                assert r.finish_reason is not None and r not in self.policy.running and r not in self.policy.waiting
            assert r.num_output_tokens <= r.sampling.max_tokens and r.num_tokens <= self.max_len

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(20_000):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        assert all(r.is_finished for r in self.reqs), "liveness: a request never ended"
        self.blocks_are_accounted_for()
        assert self.kv.usage().free_slots == self.kv.capacity_tokens


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
