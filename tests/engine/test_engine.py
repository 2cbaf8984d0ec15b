"""The engine end to end on a real (tiny) model: greedy output equals HF `generate`, token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varlen import LLM, SamplingParams
from varlen.model_runner import load_model

SCHEDULERS = ["static", "continuous", "chunked", "priority"]
ALLOCATORS = ["paged", "contiguous"]
MAX_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 500, n).tolist() for n in (1, 5, 17, 33, 8, 50, 2, 24)]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    hf = load_model(model_dir, torch.float32, "cpu", "sdpa")
    outs = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            n = 4 + 3 * i
            g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def params_for(prompts):
    return [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]


def make_llm(model_dir, scheduler, allocator, **kw):
    budget = 16 if scheduler in ("chunked", "priority") else MAX_LEN
    return LLM(model_dir, scheduler=scheduler, allocator=allocator, block_size=4, max_model_len=MAX_LEN,
               max_num_batched_tokens=budget, max_num_seqs=kw.pop("max_num_seqs", 4), **kw)


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_equals_hf_generate(model_dir, prompts, hf_greedy, scheduler, allocator):
    llm = make_llm(model_dir, scheduler, allocator)
    outs = llm.generate(prompts, params_for(prompts))
    assert [o.token_ids for o in outs] == hf_greedy
    assert all(o.finish_reason == "length" for o in outs)
    new = [n for s in llm.engine.steps for n in s.new_tokens]
    if scheduler in ("chunked", "priority"):
        assert max(sum(s.new_tokens) for s in llm.engine.steps) <= 16
        assert any(1 < n < p for n in new for p in (33, 50))  # a prompt really was split
    assert max(len(s.req_ids) for s in llm.engine.steps) <= 4
    if scheduler == "static":  # nobody joins a batch before all of it has finished
        batches, current = [], set()
        for s in llm.engine.steps:
            ids = set(s.req_ids)
            if not ids & current:
                batches.append(ids)
                current = ids
            assert ids <= current, "a request joined a running static batch"
    if scheduler == "continuous":  # whole prompts only
        firsts = {}
        for s in llm.engine.steps:
            for r, n, c in zip(s.req_ids, s.new_tokens, s.cached_tokens):
                firsts.setdefault(r, (n, c))
        assert all(c == 0 for n, c in firsts.values())


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_kv_pressure_preempts_and_changes_nothing(model_dir, prompts, hf_greedy, scheduler, allocator):
    # 26 blocks of 4 = 104 slots: one request fits, all eight at once never do.
    llm = make_llm(model_dir, scheduler, allocator, num_blocks=26, max_num_seqs=8, reservation="oracle") \
        if allocator == "contiguous" else make_llm(model_dir, scheduler, allocator, num_blocks=26, max_num_seqs=8)
    outs = llm.generate(prompts, params_for(prompts))
    assert [o.token_ids for o in outs] == hf_greedy
    if allocator == "paged":
        assert llm.engine.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.num_preemptions
    assert max(s.kv_reserved_slots for s in llm.engine.steps) <= 26 * 4


def test_sampling_is_reproducible_per_request_seed(model_dir, prompts):
    sp = [SamplingParams(max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=i, ignore_eos=True)
          for i in range(len(prompts))]
    a = make_llm(model_dir, "chunked", "paged").generate(prompts, sp)
    # Same seeds, another batching (one at a time) and KV pressure: same tokens.
    b = make_llm(model_dir, "chunked", "paged", max_num_seqs=1, num_blocks=26).generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1


def test_prefix_caching_reuses_blocks_and_matches_hf(model_dir):
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 500, 40).tolist()
    prompts = [shared + rng.integers(3, 500, k).tolist() for k in (3, 9, 1)]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = make_llm(model_dir, "chunked", "paged")
    first = llm.generate(prompts[:1], sp)
    rest = llm.generate(prompts[1:], sp)
    kv = llm.engine.kv
    assert kv.prefix_hit_blocks >= 2 * (40 // 4)  # both later requests reuse the 10 shared blocks
    assert [o.metrics.num_prefix_hit_tokens for o in rest] == [40, 40]
    plain = make_llm(model_dir, "chunked", "paged", enable_prefix_caching=False).generate(prompts, sp)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    hf = load_model(model_dir, torch.float32, "cpu", "sdpa")
    with torch.inference_mode():
        for p, o in zip(prompts, first + rest):
            g = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o.token_ids == g[0, len(p):].tolist()


def test_bad_requests_are_rejected_others_run(model_dir):
    llm = make_llm(model_dir, "chunked", "paged")
    outs = llm.generate([[5, 6, 7], [], list(range(3, 3 + MAX_LEN + 1)), "hello"],
                        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "rejected", "rejected", "length"]
    assert "empty prompt" in outs[1].finish_message
    assert f"longer than max_model_len ({MAX_LEN} tokens)" in outs[2].finish_message
    assert len(outs[0].token_ids) == 3 and outs[3].text is not None


def test_stop_tokens_and_max_model_len(model_dir, prompts, hf_greedy):
    llm = make_llm(model_dir, "chunked", "paged")
    stop = hf_greedy[3][2]
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    # A request reaching max_model_len ends with "length" there.
    out = llm.generate([prompts[5]], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompts[5]) + len(out.token_ids) == MAX_LEN


def test_abort(model_dir, prompts):
    llm = make_llm(model_dir, "chunked", "paged")
    reqs = llm.make_requests(prompts[:3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for r in reqs:
        llm.engine.add_request(r)
    llm.engine.step()
    llm.engine.abort(reqs[1].req_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.finish_reason.value for r in reqs] == ["length", "aborted", "length"]
    assert llm.engine.kv.usage().reserved_slots == 0 or llm.engine.kv.usage().live_tokens == 0


def test_bad_settings_fail_clearly(model_dir):
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'; choose one of"):
        LLM(model_dir, scheduler="fifo")
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        LLM(model_dir, scheduler="continuous", max_num_batched_tokens=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens=0: must be an integer >= 1"):
        SamplingParams(max_tokens=0)
