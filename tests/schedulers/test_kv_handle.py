"""A request carries a handle to its record in the paged pool that holds it (Request.kv_handle), so a
decode reaches its blocks and count without a lookup by id. `held` stays the truth: a handle is read
only by the pool that set it and only while its record is in that pool's `held`; free() clears it, so
preemption, abort, a second pool holding the same request and a second object of the same id never
read a stale or foreign record.
"""

from __future__ import annotations

import pytest

from schedulers import ChunkedPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from varlen.clock import SimClock
from varlen.engine import Engine
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams


def _decoding(rid: str, prompt: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + prompt)), SamplingParams(max_tokens=100))


def _decoded(r: Request, n: int = 1) -> None:
    """As a step does: everything computed, n more output tokens."""
    r.num_computed_tokens = r.num_tokens
    r.output_token_ids.extend([1] * n)


def _agree(kv: PagedAllocator, reqs: list[Request]) -> None:
    """A set handle is exactly the pool's live record of that id; a finished request keeps none."""
    for r in reqs:
        h = r.kv_handle
        if h is not None:
            assert kv.held.get(r.req_id) is h and h.owner is kv, r.req_id
        if r.is_finished:
            assert h is None, r.req_id


@pytest.mark.parametrize("caching", [False, True])
def test_allocate_sets_the_handle_and_free_clears_it(caching: bool) -> None:
    kv = PagedAllocator(40, 4, None, enable_prefix_caching=caching)
    r = _decoding("r", 6)
    assert r.kv_handle is None
    assert kv.allocate(r, 6)
    h = kv.held["r"]
    assert r.kv_handle is h and h.owner is kv
    _decoded(r, 3)
    assert kv.allocate_decodes([r], 1) == 1 and kv.held["r"] is h and h.count == 7
    kv.free(r)
    assert r.kv_handle is None and h.owner is None and "r" not in kv.held


def test_a_reset_without_free_drops_the_handle_and_the_pool_finds_its_record_by_id() -> None:
    # Whatever reset a request undergoes leaves no handle; a pool still holding it reads `held`.
    kv = PagedAllocator(40, 4, None, enable_prefix_caching=False)
    r = _decoding("r", 6)
    assert kv.allocate(r, 6)
    h = kv.held["r"]
    r.reset_for_recompute()
    assert r.kv_handle is None
    assert kv.block_table(r) is h.blocks and r.kv_handle is h  # found by id, the handle taken again
    kv.free(r)
    assert r.kv_handle is None and h.owner is None
    assert kv.allocate(r, 6) and kv.held["r"] is not h and r.kv_handle is kv.held["r"]


@pytest.mark.parametrize("caching", [False, True])
def test_a_record_freed_through_another_object_of_the_same_id_is_never_read(caching: bool) -> None:
    kv = PagedAllocator(40, 4, None, enable_prefix_caching=caching)
    first, twin = _decoding("x", 6), _decoding("x", 6)
    assert kv.allocate(first, 6)
    old = first.kv_handle
    old_blocks = list(old.blocks)
    kv.free(twin)  # `held` is keyed by id: this frees first's blocks
    assert "x" not in kv.held and old.owner is None
    fresh = PagedAllocator(40, 4, None, enable_prefix_caching=caching)
    assert kv.block_table(first) == () and kv.next_allocation_event(first, 2) == fresh.next_allocation_event(first, 2)
    other = _decoding("o", 12, start=500)
    assert kv.allocate(other, 12) and set(old_blocks) & set(kv.held["o"].blocks)  # freed blocks, in use again
    _decoded(first)
    assert kv.allocate_decodes([first], 1) == 1  # a new record, not the dead one grown
    rec = kv.held["x"]
    assert rec is not old and rec.count == 7 and len(rec.blocks) == 2
    assert set(rec.blocks).isdisjoint(kv.held["o"].blocks)
    kv.free(first)
    assert dict(kv.num_tokens) == {"o": 12} and kv.live_tokens == 12


def test_two_pools_holding_one_request_each_read_their_own_record() -> None:
    # As disaggregated pools or a user's allocator wrapping a shipped one may: one slot, two records.
    a, b = PagedAllocator(40, 4, None, False), PagedAllocator(40, 4, None, False)
    assert b.allocate(_decoding("pad", 8, start=900), 8)  # b's blocks differ from a's
    r = _decoding("r", 7)
    assert a.allocate(r, 7) and r.kv_handle is a.held["r"]
    assert b.allocate(r, 8) and r.kv_handle is b.held["r"]  # the newest holder's handle
    assert a.block_table(r) == [0, 1] and b.block_table(r) == [2, 3]
    _decoded(r)  # 8 tokens: a's table has room, b's count is there already
    assert a.allocate_decodes([r], 1) == 1 and b.allocate_decodes([r], 1) == 1
    assert a.held["r"].count == 8 and b.held["r"].count == 8 and a.live_tokens == 8
    assert a.decode_steps_fit([r], [8], 3) == 3 and a.next_allocation_event(r, 8) == 9
    ok, changed = a.grow_decodes([r], [8], 2)  # a takes block 2 for count 9: b's table is untouched
    assert ok == 2 and a.held["r"].blocks == [0, 1, 2] and b.held["r"].blocks == [2, 3]
    assert a.held["r"].count == 10 and b.held["r"].count == 8
    a.free(r)
    assert r.kv_handle is b.held["r"] and b.block_table(r) == [2, 3] and a.block_table(r) == ()
    assert a.allocate(r, 4) and r.kv_handle is a.held["r"]
    b.free(r)  # b's free leaves a's handle alone
    assert r.kv_handle is a.held["r"] and a.block_table(r) == [0] and "r" not in b.held
    assert dict(b.num_tokens) == {"pad": 8} and b.live_tokens == 8


def test_a_subclass_sees_the_calls_it_saw_before() -> None:
    class Counting(PagedAllocator):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            self.calls: list[tuple] = []

        def allocate(self, req: Request, num_tokens: int) -> bool:
            self.calls.append(("allocate", req.req_id, num_tokens))
            return super().allocate(req, num_tokens)

        def _record_count(self, req_id: str, num_tokens: int) -> None:
            self.calls.append(("count", req_id, num_tokens))
            super()._record_count(req_id, num_tokens)

        def _forget_count(self, req_id: str) -> None:
            self.calls.append(("forget", req_id))
            super()._forget_count(req_id)

    kv = Counting(40, 4, None, enable_prefix_caching=False)
    r, s = _decoding("r", 6), _decoding("s", 8, start=300)
    assert kv.allocate(r, 6) and kv.allocate(s, 8)
    _decoded(r), _decoded(s)
    assert kv.allocate_decodes([r, s], 2) == 2
    assert kv.grow_decodes([r, s], [7, 9], 2) == (2, {1: 24})
    kv.free(r)
    assert kv.calls == [("allocate", "r", 6), ("count", "r", 6), ("allocate", "s", 8), ("count", "s", 8),
                        ("allocate", "r", 7), ("count", "r", 7), ("allocate", "s", 9), ("count", "s", 9),
                        ("count", "r", 9), ("count", "s", 11), ("forget", "r")]
    assert r.kv_handle is None and s.kv_handle is kv.held["s"] and kv.held["s"].blocks == [2, 3, 4]


@pytest.mark.parametrize("engine_cls", [Engine, FastForwardEngine])
def test_preemption_and_abort_leave_no_stale_handle(engine_cls: type) -> None:
    clock = SimClock()
    ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
    kv = PagedAllocator(24, 4, 256, enable_prefix_caching=False)  # 96 slots for 6 requests of ~60
    eng = engine_cls(ChunkedPolicy(max_num_seqs=6, max_num_batched_tokens=32), kv, ex, clock, max_model_len=256)
    reqs = [Request(f"r{i}", list(range(10 * i, 10 * i + 12)), SamplingParams(max_tokens=48, ignore_eos=True))
            for i in range(6)]
    for r in reqs:
        eng.add_request(r)
    reached = 0
    for step in range(2000):
        if not eng.has_unfinished():
            break
        if step == 30:
            victim = next(r for r in reqs if r.req_id in kv.held)
            eng.abort(victim.req_id)
            assert victim.kv_handle is None
        eng.step()
        _agree(kv, reqs)
        reached += sum(r.kv_handle is not None for r in reqs)
    assert all(r.is_finished for r in reqs) and not kv.held and kv.live_tokens == 0
    assert sum(r.num_preemptions for r in reqs) > 0 and reached > 0
    assert [r.finish_reason.value for r in reqs].count("aborted") == 1
