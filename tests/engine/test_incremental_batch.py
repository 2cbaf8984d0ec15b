"""The executor's per-step metadata, kept up to date incrementally (buffer rows, lazily copied block
tables, the pure-decode path), equals a from-scratch `build_batch` of the same step.

Random serving runs (arrivals between steps, aborts, EOS and length finishes, a KV pool small
enough to preempt, a token budget small enough to chunk prefills) drive the real Engine and
ModelExecutor with a stand-in model that returns random logits; every step's ForwardBatch is
compared field by field with one built from the requests' token ids and the allocator's tables.
Torch-light: no model is loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from test_batch import _same_batch
from varlen.batch import SeqSlice, build_batch
from varlen.clock import SimClock
from varlen.engine import Engine
from varlen.executor import ModelExecutor
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import ALLOCATORS, POLICIES, policy_class

VOCAB = 12
EOS = 1


class StandInRunner:
    """What ModelExecutor needs of a ModelRunner; records each batch, returns seeded random logits."""

    def __init__(self, block_size: int, num_blocks: int, seed: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.gen = torch.Generator().manual_seed(seed)
        self.batches = []

    def check_kv_allocator(self, kv) -> None:
        pass

    def execute(self, batch):
        self.batches.append(batch)
        return torch.randn(len(batch.logits_indices), VOCAB, generator=self.gen)


class CheckedExecutor(ModelExecutor):
    """Compares every step's batch with a rebuild from scratch, and counts the decode path's use."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_steps = self.steps = 0

    def _decode_step(self, scheduled, kv):
        got = super()._decode_step(scheduled, kv)
        self.fast_steps += got is not None
        return got

    def execute(self, scheduled, kv):
        bs = self.runner.block_size
        seqs = [SeqSlice(list(r.token_ids())[r.num_computed_tokens:r.num_computed_tokens + n], r.num_computed_tokens,
                         list(kv.block_table(r)), r.num_computed_tokens + n == r.num_tokens, r.req_id)
                for r, n in scheduled]
        want = build_batch(seqs, bs, self.runner.num_blocks)
        out = super().execute(scheduled, kv)
        _same_batch(self.runner.batches[-1], want, seqs, bs)
        self.steps += 1
        return out


def _run(data, policy: str, allocator: str) -> CheckedExecutor:
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    max_len = 40
    num_blocks = -(-max_len // bs) * data.draw(st.sampled_from([1, 1, 2, 3]), label="pool in full-length requests")
    seats = data.draw(st.integers(1, 6), label="max_num_seqs")
    cls = policy_class(policy)
    budget = data.draw(st.sampled_from([3, 8, 64]), label="budget") if cls.chunked_prefill else max_len
    kv = ALLOCATORS[allocator](num_blocks=num_blocks, block_size=bs, max_model_len=max_len)
    runner = StandInRunner(bs, num_blocks, data.draw(st.integers(0, 9), label="seed"))
    ex = CheckedExecutor(runner, seats, max_len)
    eng = Engine(cls(max_num_seqs=seats, max_num_batched_tokens=budget), kv, ex, SimClock(), max_len,
                 eos_token_id=EOS, vocab_size=VOCAB)
    reqs = []
    for i in range(data.draw(st.integers(1, 8), label="requests")):
        prompt = data.draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=24), label=f"prompt {i}")
        sp = SamplingParams(max_tokens=data.draw(st.integers(1, 24)), temperature=0,
                            ignore_eos=data.draw(st.sampled_from([True, True, False])))  # long runs preempt
        reqs.append((data.draw(st.integers(0, 12), label=f"arrival step {i}"), Request(f"r{i}", prompt, sp)))
    for step in range(400):
        for at, r in reqs:
            if at == step:
                eng.add_request(r)
        if step > 0 and eng.requests and data.draw(st.integers(0, 19), label="abort?") == 0:
            eng.abort(sorted(eng.requests)[0])
        if eng.has_unfinished():
            eng.step()
        elif step > max(at for at, _ in reqs):
            break
    assert all(r.is_finished for _, r in reqs)
    return ex


@pytest.mark.parametrize("policy", POLICIES)
@given(data=st.data())
def test_incremental_batches_equal_a_rebuild(policy, data):
    allocator = data.draw(st.sampled_from(sorted(ALLOCATORS)), label="allocator")
    _run(data, policy, allocator)


def test_decode_steps_take_the_incremental_path():
    """A plain run's decode steps go through the decode path (which the test above checks), and
    a step with a prefill does not."""
    runner = StandInRunner(4, 64, 0)
    ex = CheckedExecutor(runner, 4, 64)
    eng = Engine(policy_class("chunked")(max_num_seqs=4, max_num_batched_tokens=64),
                 ALLOCATORS["paged"](num_blocks=64, block_size=4, max_model_len=64), ex, SimClock(), 64)
    for i in range(3):
        eng.add_request(Request(f"r{i}", list(range(2, 9 + i)), SamplingParams(max_tokens=10, temperature=0)))
    while eng.has_unfinished():
        eng.step()
    assert ex.steps == 10 and ex.fast_steps == 9  # one prefill step, then 9 decode steps


def test_preempted_requests_get_fresh_rows():
    """Four requests outgrow a pool of ten blocks: preempted ones come back on new rows, their
    prompts and outputs recomputed, every step equal to a rebuild."""
    kv = ALLOCATORS["paged"](num_blocks=10, block_size=4, max_model_len=40)
    ex = CheckedExecutor(StandInRunner(4, 10, 0), 4, 40)
    eng = Engine(policy_class("chunked")(max_num_seqs=4, max_num_batched_tokens=8), kv, ex, SimClock(), 40,
                 eos_token_id=EOS, vocab_size=VOCAB)
    reqs = [Request(f"r{i}", [3] * 10, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    assert eng.num_preemptions > 0 and ex.fast_steps > 0 and all(len(r.output_token_ids) == 20 for r in reqs)


class BadIdAllocator(PagedAllocator):
    """From a request's second block on, its table names a block outside the pool."""

    bad_id = -1

    def block_table(self, req):
        table = list(super().block_table(req))
        return table[:1] + [self.bad_id] * (len(table) - 1)


@pytest.mark.parametrize("bad_id", [-1, 64, 2**31 + 5])
def test_decode_step_with_a_block_id_outside_the_pool_is_refused(bad_id):
    """Block ids are checked as they are copied; a decode step reading a bad one never runs and
    the error names the request (as the checked path does)."""
    runner = StandInRunner(4, 64, 0)
    ex = ModelExecutor(runner, 2, 64)
    kv = BadIdAllocator(num_blocks=64, block_size=4, max_model_len=64, enable_prefix_caching=False)
    kv.bad_id = bad_id
    eng = Engine(policy_class("chunked")(max_num_seqs=2, max_num_batched_tokens=64), kv, ex, SimClock(), 64)
    r = Request("victim", [2, 3], SamplingParams(max_tokens=10, temperature=0))
    eng.add_request(r)
    for _ in range(3):  # the prompt, then positions 2 and 3: the first block
        eng.step()
    with pytest.raises(ValueError, match=r"request 'victim' has block ids outside the pool \[0, 64\)"):
        eng.step()  # position 4: the second block
    assert len(runner.batches) == 3 and r.finish_reason is not None and np.all(runner.batches[-1].block_tables >= 0)
