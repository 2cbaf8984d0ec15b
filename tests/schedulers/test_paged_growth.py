"""PagedAllocator's per-block state grows with use, and blocks go out in the old free stack's order.

- An idle pool holds no per-block lists sized to the pool (a fleet's replicas are mostly idle).
- Over a mixed sequence of allocate / allocate_decodes / grow_decodes / free calls, every block
  handed out is the top of one stack [num_blocks-1, ..., 0] with freed tables pushed back reversed:
  the order a pool that listed every id up front hands them out, so results stay identical.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams


def test_an_idle_pool_holds_no_per_block_lists():
    n = 26_674  # Llama-3-8B's blocks on an H100
    kv = PagedAllocator(n, 16, None, enable_prefix_caching=False)
    assert kv.ref_count == [] and kv.free_plain == [] and kv.block_hash == [] and kv.block_tokens == []
    assert kv.usage().free_slots == n * 16 and kv.num_free_plain() == n
    cached = PagedAllocator(n, 16, None, enable_prefix_caching=True)
    assert cached.ref_count == [] and cached.free_plain == [] and len(cached.block_hash) == n  # hashes need it


def test_ref_count_grows_only_to_the_highest_block_used():
    kv = PagedAllocator(1000, 4, None, enable_prefix_caching=False)
    a, b = (Request(rid, [1] * 10, SamplingParams(max_tokens=50)) for rid in "ab")
    assert kv.allocate(a, 10) and kv.allocate(b, 10)  # 3 blocks each
    assert kv.block_table(a) == [0, 1, 2] and kv.block_table(b) == [3, 4, 5] and len(kv.ref_count) == 6
    kv.free(a)
    c = Request("c", [1] * 17, SamplingParams(max_tokens=50))
    assert kv.allocate(c, 17)  # 5 blocks: a's three back first (head first), then the next unused two
    assert kv.block_table(c) == [0, 1, 2, 6, 7] and kv.ref_count == [1] * 8
    kv.free(b)
    c.num_computed_tokens = 20
    assert kv.allocate_decodes([c], 1) == 1 and kv.block_table(c)[5:] == [3]  # a returned block before unused 8


ops = st.lists(st.tuples(st.sampled_from(["new", "decodes", "grow", "free"]), st.integers(0, 10**6),
                         st.integers(1, 30)), max_size=30)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.sampled_from([1, 2, 4]), ops)
def test_blocks_go_out_in_the_full_stacks_order(num_blocks, bs, steps):
    kv = PagedAllocator(num_blocks, bs, None, enable_prefix_caching=False)
    stack = list(range(num_blocks - 1, -1, -1))  # the reference: every id listed up front, top = next
    live: list[Request] = []

    def taken_from_stack(order: list[int]) -> None:
        for b in order:
            assert b == stack.pop(), "a block out of the full stack's order"

    for i, (op, k, n) in enumerate(steps):
        if op == "new":
            r = Request(f"r{i}", [1] * n, SamplingParams(max_tokens=200))
            if kv.allocate(r, n):
                r.num_computed_tokens = n
                live.append(r)
                taken_from_stack(list(kv.block_table(r)))
        elif op == "decodes" and live:
            batch = live[k % len(live):][:n]
            before = [len(kv.block_table(r)) for r in batch]
            done = kv.allocate_decodes(batch, len(batch))
            taken_from_stack([b for r, m in zip(batch, before) for b in kv.block_table(r)[m:]])
            for r in batch[:done]:
                r.num_computed_tokens += 1
        elif op == "grow" and live:
            counts = [r.num_computed_tokens for r in live]
            before = [len(kv.block_table(r)) for r in live]
            res = kv.grow_decodes(live, counts, n)
            assert res is not None
            # grants go step first, then batch order: request p's m-th new block at step len*bs - c + m*bs
            grants = sorted((before[p] * bs - counts[p] + m * bs, p, b) for p, r in enumerate(live)
                            for m, b in enumerate(kv.block_table(r)[before[p]:]))
            taken_from_stack([b for *_, b in grants])
            for r, c in zip(live, counts):
                r.num_computed_tokens = c + res[0]
        elif op == "free" and live:
            r = live.pop(k % len(live))
            stack.extend(reversed(kv.block_table(r)))
            kv.free(r)
        assert kv.free_stack() == stack
        assert len(kv.ref_count) == kv.fresh <= num_blocks
        held = {b for r in live for b in kv.block_table(r)}
        assert [b for b in range(kv.fresh) if kv.ref_count[b]] == sorted(held)
        assert kv.usage().free_slots == len(stack) * bs


def _ops_on(kv: PagedAllocator) -> list[Request]:
    """A few takes, decodes and frees (without prefix caching); the requests still held."""
    reqs = [Request(f"q{i}", [1] * n, SamplingParams(max_tokens=50)) for i, n in enumerate((9, 3, 17))]
    for r in reqs:
        assert kv.allocate(r, r.num_prompt_tokens)
        r.num_computed_tokens = r.num_prompt_tokens
    kv.free(reqs[1])
    live = [reqs[0], reqs[2]]
    assert kv.allocate_decodes(live, 2) == 2
    assert kv.grow_decodes(live, [r.num_computed_tokens + 1 for r in live], 9) is not None
    return live


class Subclassed(PagedAllocator):
    pass


def test_ref_count_without_caching_is_the_tables_in_the_class_and_kept_in_a_subclass():
    # PagedAllocator itself keeps no count per block without caching (each block has one holder): it
    # reads them off the tables; a subclass keeps and checks them as before. Both show the same counts.
    own, sub = PagedAllocator(40, 4, None, enable_prefix_caching=False), Subclassed(40, 4, None, False)
    for kv in (own, sub):
        live = _ops_on(kv)
        held = {b for r in live for b in kv.block_table(r)}
        assert kv.ref_count == [int(b in held) for b in range(kv.fresh)]
    assert own.free_stack() == sub.free_stack() and dict(own.tables) == dict(sub.tables)
    assert own.ref_count is not own.ref_count and sub.ref_count is sub.ref_count  # made on read / kept
    for rid in list(own.held):
        own.free(Request(rid, [1], SamplingParams()))
    assert own.ref_count == [0] * own.fresh and own.num_free_plain() == 40 and own.live_tokens == 0
    victim = next(iter(sub.held))
    sub.ref_count[sub.held[victim].blocks[0]] = 2  # a count the subclass's free checks
    try:
        sub.free(Request(victim, [1], SamplingParams()))
    except AssertionError as e:
        assert "holders without prefix caching" in str(e)
    else:
        raise AssertionError("a subclass's kept counts are no longer checked")
