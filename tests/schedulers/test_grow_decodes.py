"""PagedAllocator.grow_decodes (k decode steps in one call) takes the blocks of the calls it stands
for, allocate(reqs[p], counts[p] + j + 1) step by step until one fails, and records the counts of
the steps that succeeded (and of the failed step's requests that took a block), whatever sequence
type it is given; decode_steps_fit answers how many of those steps succeed. grow_running and
running_steps_fit (the counts read off the requests) answer and act exactly as they do.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams


def _pool(num_blocks: int, bs: int, prompts: list[int]) -> tuple[PagedAllocator, list[Request]]:
    kv = PagedAllocator(num_blocks, bs, None, enable_prefix_caching=False)
    reqs = []
    for i, n in enumerate(prompts):
        r = Request(f"r{i}", [1] * n, SamplingParams(max_tokens=500))
        if kv.allocate(r, n):
            r.num_computed_tokens = n
            reqs.append(r)
    return kv, reqs


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 40), st.sampled_from([1, 2, 4, 16]), st.lists(st.integers(1, 40), min_size=1, max_size=8),
       st.integers(1, 70), st.booleans(), st.booleans())
def test_grow_decodes_is_its_calls_one_by_one(num_blocks, bs, prompts, num_steps, as_tuples, read_off):
    bulk, reqs = _pool(num_blocks, bs, prompts)
    calls, twins = _pool(num_blocks, bs, prompts)
    if not reqs:
        return
    counts = [r.num_computed_tokens for r in reqs]
    if read_off:  # the fast-forward's calls: each count is the request's num_computed_tokens
        fit = bulk.running_steps_fit(reqs, num_steps)
        res = bulk.grow_running(reqs, num_steps)
    else:
        fit = bulk.decode_steps_fit(tuple(reqs) if as_tuples else reqs, tuple(counts) if as_tuples else counts,
                                    num_steps)
        res = bulk.grow_decodes(tuple(reqs) if as_tuples else reqs, tuple(counts) if as_tuples else counts,
                                num_steps)
    assert res is not None
    ok, changed = res
    done, reserved = num_steps, {}
    took_at_failed: set[str] = set()  # the failed step's calls that took a block before one failed
    for j in range(num_steps):
        before = calls.usage().reserved_slots
        for r, c in zip(twins, counts):
            held = len(calls.block_table(r))
            if not calls.allocate(r, c + j + 1):
                done = j
                break
            if len(calls.block_table(r)) > held:
                took_at_failed.add(r.req_id)
        if calls.usage().reserved_slots != before:
            reserved[j] = calls.usage().reserved_slots
        if done == j:
            break
        took_at_failed.clear()
    assert ok == done == fit
    assert changed == reserved
    # The failed step's blocks are taken as its calls took them; only those requests count its token.
    assert dict(bulk.tables) == dict(calls.tables) and bulk.free_stack() == calls.free_stack()
    want = {r.req_id: c + ok + (r.req_id in took_at_failed) for r, c in zip(reqs, counts)}
    assert dict(bulk.num_tokens) == want and bulk.live_tokens == sum(want.values())
    assert bulk.reserved_slots() == bulk.usage().reserved_slots == calls.usage().reserved_slots
