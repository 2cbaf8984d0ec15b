"""The running decodes a policy schedules in bulk (SchedulerPolicy._schedule_running with the class's
own _grant; KVAllocator.allocate_decodes) decide exactly what one request at a time decides: every
policy and allocator, with preemptions; a user's allocate() is still called for every decode."""

from __future__ import annotations

import pytest

from sim.validate import fresh_copies
from sim.simulator import simulate
from varlen.kv.base import KVAllocator
from varlen.kv.paged import PagedAllocator
from varlen.request import Request
from varlen.testing.fast_forward import ALLOCATORS, POLICIES, assert_same, factory, policy_class, \
    shared_prefix_requests, state


def one_by_one(cls: type) -> type:
    """`cls` with _grant overridden (same grants): its running requests are scheduled one at a time."""

    class OneByOne(cls):
        repeats_decode_batches = cls.repeats_decode_batches  # the same grants: the promise still holds

        def _grant(self, req: Request, budget: int) -> int:
            return super()._grant(req, budget)

    return OneByOne


def factory_with(policy_cls: type, kv_cls: type | None, num_blocks: int):
    base = factory("chunked", "paged", num_blocks)  # only to share its cost model and sizes

    def make(clock):
        eng, ex = base(clock)
        kv = eng.kv if kv_cls is None else kv_cls(num_blocks=num_blocks, block_size=16, max_model_len=1024,
                                                   enable_prefix_caching=False)
        pol = policy_cls(max_num_seqs=16, max_num_batched_tokens=256 if policy_cls.chunked_prefill else 1024)
        return type(eng)(pol, kv, ex, clock=clock, max_model_len=1024), ex

    return make


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("policy", POLICIES)
def test_bulk_decodes_decide_what_one_at_a_time_decides(policy: str, allocator: str) -> None:
    reqs = shared_prefix_requests(50, 40.0, seed=3)
    shipped = factory(policy, allocator, 60)  # a small pool: preemptions

    def slow(clock):
        eng, ex = shipped(clock)
        pol = eng.policy
        eng.policy = one_by_one(type(pol))(pol.max_num_seqs, pol.max_num_batched_tokens)
        return eng, ex

    for ff in (False, True):
        a = simulate(fresh_copies(reqs), slow, num_replicas=2, router="round_robin", fast_forward=ff)
        b = simulate(fresh_copies(reqs), shipped, num_replicas=2, router="round_robin", fast_forward=ff)
        assert_same(a, b)
        if policy == "chunked" and allocator == "paged":
            assert sum(r.engine.num_preemptions for r in b.replicas) > 0  # the case this test is about


class LoggedAllocate(PagedAllocator):
    """A user's allocator: logs every allocate() call."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[str, int]] = []

    def allocate(self, req: Request, num_tokens: int) -> bool:
        self.calls.append((req.req_id, num_tokens))
        return super().allocate(req, num_tokens)


class CountedBulk(PagedAllocator):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.bulk = 0

    def allocate_decodes(self, reqs: list[Request], num: int) -> int:
        self.bulk += num
        return super().allocate_decodes(reqs, num)


def test_a_user_allocate_is_called_for_every_decode_as_before() -> None:
    reqs = shared_prefix_requests(40, 40.0, seed=5)
    chunked = policy_class("chunked")
    runs = {}
    for name, pol in (("bulk", chunked), ("one by one", one_by_one(chunked))):
        res = simulate(fresh_copies(reqs), factory_with(pol, LoggedAllocate, 60), fast_forward=False)
        runs[name] = res.replicas[0].engine.kv.calls
    assert runs["bulk"] == runs["one by one"]
    assert sum(1 for _, n in runs["bulk"]) > 1000


def test_the_bulk_path_is_taken_for_shipped_policies_only() -> None:
    reqs = shared_prefix_requests(30, 40.0, seed=7)
    chunked = policy_class("chunked")
    bulk = simulate(fresh_copies(reqs), factory_with(chunked, CountedBulk, 200), fast_forward=False)
    assert bulk.replicas[0].engine.kv.bulk > 500
    own = simulate(fresh_copies(reqs), factory_with(one_by_one(chunked), CountedBulk, 200), fast_forward=False)
    assert own.replicas[0].engine.kv.bulk == 0  # a policy's own _grant: asked one request at a time


@pytest.mark.parametrize("caching", [False, True])
def test_paged_allocate_decodes_equals_its_calls_one_by_one(caching: bool) -> None:
    def pool() -> tuple[PagedAllocator, list[Request]]:
        kv = PagedAllocator(num_blocks=12, block_size=4, enable_prefix_caching=caching)
        reqs = [Request(f"r{i}", list(range(i, i + 3 + i % 5))) for i in range(6)]
        for r in reqs:
            assert kv.allocate(r, r.num_prompt_tokens)
            r.num_computed_tokens = r.num_prompt_tokens
            r.output_token_ids.append(0)
        return kv, reqs

    a, ra = pool()
    b, rb = pool()
    for _ in range(8):  # the pool runs out part way: both stop at the same request
        got_a = a.allocate_decodes(ra, len(ra))
        got_b = KVAllocator.allocate_decodes(b, rb, len(rb))
        assert got_a == got_b
        assert state(a) == state(b)
        for rs, got in ((ra, got_a), (rb, got_b)):
            for r in rs[:got]:
                r.num_computed_tokens += 1
                r.output_token_ids.append(0)
    assert got_a < len(ra)


@pytest.mark.parametrize("caching", [False, True])
def test_paged_leading_decodes_equal_the_scan_then_allocate_decodes(caching: bool) -> None:
    """PagedAllocator's fused pass: the leading requests needing one token (a prefill in the middle
    stops it), allocated up to the first failure, as KVAllocator's scan and allocate_decodes decide."""
    def pool() -> tuple[PagedAllocator, list[Request]]:
        kv = PagedAllocator(num_blocks=14, block_size=4, enable_prefix_caching=caching)
        reqs = [Request(f"r{i}", list(range(i, i + 3 + i % 5))) for i in range(7)]
        for i, r in enumerate(reqs):
            assert kv.allocate(r, r.num_prompt_tokens)
            r.num_computed_tokens = r.num_prompt_tokens - (2 if i == 5 else 0)  # r5: a prompt still coming in
            r.output_token_ids.append(0)
        return kv, reqs

    a, ra = pool()
    b, rb = pool()
    seen = set()
    for _ in range(10):  # the pool runs out part way: both stop at the same request, saying it failed
        got_a = a._allocate_leading_decodes(ra, len(ra))
        got_b = KVAllocator._allocate_leading_decodes(b, rb, len(rb))
        assert got_a == got_b
        assert state(a) == state(b)
        seen.add(got_a)
        for rs in (ra, rb):
            for r in rs[:got_a[0]]:
                r.num_computed_tokens += 1
                r.output_token_ids.append(0)
    assert (5, False) in seen and any(failed for _, failed in seen)  # stopped by the prefill, then by the pool
    assert a._allocate_leading_decodes(ra, 2)[0] <= 2  # never past the limit
