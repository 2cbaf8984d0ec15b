"""The scheduling invariants as a hypothesis state machine: random add / step / abort sequences
against a policy and an allocator, with a pool small enough that preemption happens. After every
rule: no block leaked or held twice, reference counts equal the number of holders, limits
respected, and the step's batch is what the scheduler decided. At teardown every request ends
(liveness). Torch-free: the executor is a stand-in."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from varlen import registry
from varlen.clock import SimClock
from varlen.engine import Engine, Executor
from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.request import Request, Status
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import POLICIES, policy_class

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
        self.kv = self.make_allocator(allocator, num_blocks, block_size, reservation)
        self.exe = RecordingExecutor()
        self.engine = Engine(self.policy, self.kv, self.exe, SimClock(), self.max_len, eos_token_id=EOS)
        self.reqs: list[Request] = []
        self.prefixes = [[7] * 20, list(range(3, 40))]

    def make_allocator(self, allocator: str, num_blocks: int, block_size: int, reservation: str):
        """paged, contiguous (with `reservation`), or any other name of the allocator group
        (varlen.check runs the machine on a user's)."""
        if allocator == "paged":
            return PagedAllocator(num_blocks, block_size, self.max_len)
        if allocator == "contiguous":
            return ContiguousAllocator(num_blocks, block_size, self.max_len, reservation)
        return registry.build("allocator", allocator)(num_blocks=num_blocks, block_size=block_size,
                                                      max_model_len=self.max_len)

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
            free = [*self.kv.free_stack(), *self.kv.free_cached]
            assert len(set(free)) == len(free), "a block listed free twice"
            if self.kv.enable_prefix_caching:  # block_hash exists only with it
                assert all(self.kv.block_hash[b] is None for b in self.kv.free_plain), "cached content on the plain stack"
            assert self.kv.live_tokens == sum(self.kv.num_tokens.values())
            counts = self.kv.ref_count  # read once: the pool itself builds it from its tables on each read
            assert len(counts) == self.kv.fresh, "ref_count covers exactly the blocks used so far"
            for b in range(self.kv.num_blocks):
                rc = counts[b] if b < self.kv.fresh else 0  # never used: held by nobody
                assert rc == held[b], f"block {b}: refcount != holders"
                assert (b in free) == (held[b] == 0), f"block {b} leaked or double-listed"
            for t in self.kv.tables.values():
                assert len(set(t)) == len(t)
        elif not isinstance(self.kv, ContiguousAllocator):
            # An allocator of another kind: what its interface shows (a leak shows at teardown).
            usage = self.kv.usage()
            assert 0 <= usage.free_slots <= usage.total_slots == self.kv.capacity_tokens
            for r in self.policy.running:
                t = list(self.kv.block_table(r))
                assert len(set(t)) == len(t), f"{r.req_id}: a block twice in its table"
                assert all(0 <= b < self.kv.num_blocks for b in t), f"{r.req_id}: a block id outside the pool"
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


