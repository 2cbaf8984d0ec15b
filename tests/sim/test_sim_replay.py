"""Proof that the simulator makes the engine's decisions: the real engine (tiny model, CPU) serves
a small trace with arrivals; the simulator replays the recorded step times and start times and
must produce the same batches, step by step (request ids, new tokens, cached tokens)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from varlen import registry
from sim.cost.replay import ReplayCostModel
from sim.validate import batch_sequence, first_difference, fresh_copies, simulate_like
from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.metrics import request_table
from varlen.sampling_params import SamplingParams
from varlen.traces import load_trace
from varlen.workload import trace_requests

DATA = Path(__file__).resolve().parents[1] / "data"

CASES = {
    # trace, scheduler, allocator, token budget, KV blocks (small: preemptions), max_model_len
    "azure-chunked-paged": ("azure_conv_small.csv", "chunked", partial(PagedAllocator), 48, 40, 256),
    "azure-continuous-paged-preempting": ("azure_conv_small.csv", "continuous", partial(PagedAllocator), 256, 20, 256),
    "azure-static-contiguous": ("azure_conv_small.csv", "static", partial(ContiguousAllocator, reservation="pow2"),
                                256, 64, 256),
    # Mooncake hash ids become shared prompt blocks: prefix caching decides cached tokens.
    "mooncake-chunked-prefix-cache": ("mooncake_conv_small.jsonl", "chunked", partial(PagedAllocator), 128, 96, 1100),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_timeline_gives_identical_batches(case, tiny_model_dirs):
    from varlen import LLM

    trace_file, sched, alloc, budget, num_blocks, max_len = CASES[case]
    # Preemption needs several long-running requests at once: drop the clipped one-token ones.
    trace = load_trace(DATA / trace_file, max_model_len=max_len, rate=25.0, limit=24,
                       over_length="drop" if "preempting" in case else "clip")

    def make_policy():
        return registry.target("scheduler", sched)(max_num_seqs=4, max_num_batched_tokens=budget)

    llm = LLM(tiny_model_dirs["qwen3"], scheduler=make_policy(), allocator=alloc, block_size=16,
              num_blocks=num_blocks, max_model_len=max_len)
    vocab = llm.runner.config.vocab_size
    # Real prompt content for every trace: all-zero stand-in prompts would make requests of equal
    # length greedy-decode identical outputs in the real engine (and share output blocks in its
    # prefix cache), which the simulator's placeholder outputs cannot mirror.
    reqs = trace_requests(trace, vocab, SamplingParams(ignore_eos=True, temperature=0.0), token_ids=True)
    originals = fresh_copies(reqs)
    llm.engine.run(reqs)
    real = llm.engine
    assert len(real.steps) > 20

    kv = real.kv
    sim = simulate_like(originals, make_policy,
                        lambda: alloc(num_blocks=kv.num_blocks, block_size=kv.block_size,
                                      max_model_len=kv.max_model_len),
                        real.max_model_len, ReplayCostModel.from_steps(real.steps))
    eng = sim.replicas[0].engine
    diff = first_difference(batch_sequence(real.steps), batch_sequence(eng.steps))
    assert diff is None, diff
    # Same decisions on the same timeline: the same per-request timestamps and counters.
    cols = ["req_id", "finish_reason", "output_tokens", "num_preemptions", "prefix_hit_tokens"]
    a, b = request_table(reqs), request_table(sim.requests)
    assert a[cols].equals(b[cols])
    assert (a["first_token"] - b["first_token"]).abs().max() < 1e-9
    assert [s.start for s in real.steps] == [s.start for s in eng.steps]
    if "preempting" in case:
        assert real.num_preemptions > 0
    if "prefix" in case:
        assert sum(r.num_prefix_hit_tokens for r in reqs) > 0
