"""Sliding-window KV freeing (varlen.kv.windowed): bounded memory, same tokens, exact fast-forward.

- On a model whose layers all slide, a long generation with the windowed allocator gives exactly
  the tokens of the plain paged allocator, while holding a bounded number of blocks per request.
- The model runner refuses it for a model with a full-attention layer, or a window too small.
- The simulator's decode fast-forward stays bit-for-bit exact with it (same checks as
  test_sim_fastforward), and every block comes back when every request has finished.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import given

from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from varlen import LLM, SamplingParams
from varlen.kv import PagedAllocator
from varlen.kv.windowed import WindowedPagedAllocator
from varlen.testing.fast_forward import POLICIES, assert_same, factory, policy_class, run_both, shared_prefix_requests
from varlen.testing.strategies import trace_workloads as workloads
from varlen.tiny_model import WINDOW, write_tiny_model


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    # mistral: every layer slides (window 8); qwen2: one full layer, one sliding.
    return {arch: str(write_tiny_model(root / arch, arch)) for arch in ("mistral", "qwen2")}


def generate(path: str, allocator, backend: str = "torch_sdpa", prompts=None, max_tokens: int = 60,
             num_blocks: int = 40):
    """A small pool: freed blocks are reused by other requests (and plain paging preempts)."""
    llm = LLM(model=path, backend=backend, scheduler="chunked", allocator=allocator, block_size=4,
              num_blocks=num_blocks, max_num_batched_tokens=12, max_model_len=128)
    prompts = prompts or [list(range(5 + i, 35 + i)) for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    peak = max(s.kv_reserved_slots for s in llm.engine.steps)
    kv = llm.engine.kv
    assert kv.usage().reserved_slots == 0 and kv.live_tokens == 0 and not any(kv.ref_count), "blocks leaked"
    return [o.token_ids for o in outs], peak


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("backend", ["torch_ref", "torch_sdpa"])
def test_window_freeing_keeps_tokens_and_bounds_memory(windowed_dirs, backend, caching):
    path = windowed_dirs["mistral"]
    plain, plain_peak = generate(path, "paged", backend)
    freed, freed_peak = generate(path, partial(WindowedPagedAllocator, sliding_window=WINDOW,
                                               enable_prefix_caching=caching), backend)
    assert freed == plain
    # Per request: the window, the step's new tokens (a chunk of <= 12 under the budget), a block of slack.
    bound = 4 * (-(-(WINDOW + 12) // 4) + 1) * 4
    assert freed_peak <= bound < plain_peak, (freed_peak, bound, plain_peak)


@pytest.mark.slow
def test_freeing_one_block_too_early_is_caught(windowed_dirs, monkeypatch):
    """The equality above is not vacuous: a window one block narrower changes the tokens (without
    prefix caching a freed block goes straight back to the top of the free stack, to be reused)."""
    path = windowed_dirs["mistral"]
    plain, _ = generate(path, "paged", "torch_sdpa")
    real = WindowedPagedAllocator._release_passed
    monkeypatch.setattr(WindowedPagedAllocator, "_release_passed",
                        lambda self, req, first: real(self, req, first + self.block_size))
    freed, _ = generate(path, partial(WindowedPagedAllocator, sliding_window=WINDOW, enable_prefix_caching=False),
                        "torch_sdpa")
    assert freed != plain


def test_refused_where_it_would_free_what_a_layer_reads(windowed_dirs):
    with pytest.raises(ValueError, match="whole context"):
        generate(windowed_dirs["qwen2"], partial(WindowedPagedAllocator, sliding_window=WINDOW), max_tokens=2)
    with pytest.raises(ValueError, match=f"widest window is {WINDOW}"):
        generate(windowed_dirs["mistral"], partial(WindowedPagedAllocator, sliding_window=WINDOW - 1), max_tokens=2)
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        WindowedPagedAllocator(num_blocks=8, block_size=4)


def window_factory(policy: str, num_blocks: int, block_size: int = 16, max_model_len: int = 1024,
                   budget: int = 256, seats: int = 16, window: int = 40, caching: bool = True):
    if not policy_class(policy).chunked_prefill:
        budget = max(budget, max_model_len)

    def make(clock):
        ex = CostModelExecutor(RooflineCostModel("tiny", "cpu_2core"), clock)
        kv = WindowedPagedAllocator(num_blocks, block_size, max_model_len, caching, sliding_window=window)
        return FastForwardEngine(policy_class(policy)(max_num_seqs=seats, max_num_batched_tokens=budget), kv, ex, clock=clock,
                      max_model_len=max_model_len), ex

    return make


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_fast_forward_stays_exact_with_window_freeing(policy, caching):
    reqs = shared_prefix_requests(50, rate=30.0, seed=2)
    for num_blocks in (40, 300):
        a, b = run_both(reqs, window_factory(policy, num_blocks, caching=caching))
        assert_same(a, b)
        eng = b.replicas[0].engine
        assert eng.kv.usage().reserved_slots == 0 and not eng.kv.released
    # Not vacuous: the run fast-forwarded, and freeing lowered the peak against plain paging.
    plain = run_both(reqs, factory(policy, "paged-cache" if caching else "paged", 300))[1].replicas[0].engine
    peak = max(s.kv_reserved_slots for s in eng.steps)
    assert peak < max(s.kv_reserved_slots for s in plain.steps)
    assert eng.num_fast_forwarded_steps > 0 or policy == "static"


@given(workloads())
def test_fast_forward_stays_exact_on_random_traces(w):
    make = window_factory(w["policy"], w["num_blocks"], w["block_size"], w["max_model_len"], w["budget"],
                          w["seats"], window=max(1, w["max_model_len"] // 3), caching=w["allocator"] != "paged")
    a, b = run_both(w["reqs"], make, num_replicas=w["replicas"], router="least_outstanding")
    assert_same(a, b)
