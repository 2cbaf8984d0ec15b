"""Hypothesis strategies: mixed-batch workloads for the model-level properties, small serving
traces for the scheduling ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from sim.executor import SIM_TOKEN
from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.testing.fast_forward import ALLOCATORS, POLICIES


@dataclass
class Req:
    tokens: list[int]
    steps: list[int]  # number of new tokens in each step; sums to len(tokens)
    wants: list[bool]  # per step: ask for logits?
    blocks: list[int] = field(default_factory=list)


@st.composite
def batch_workloads(draw, vocab: int = 509, min_prompt: int = 1, max_requests: int = 8):
    """(block_size, pool, requests): each request's steps are a full prefill or chunks, then decodes,
    over block ids scattered through the pool. min_prompt: e.g. longer than a sliding window."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16]), label="block_size")
    n = draw(st.integers(1, max_requests), label="num_requests")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="token_seed"))
    reqs = []
    for _ in range(n):
        prompt = draw(st.integers(min_prompt, max(40, min_prompt)))
        cuts = sorted(draw(st.sets(st.integers(1, prompt - 1), max_size=3))) if prompt > 1 else []
        chunks = np.diff([0, *cuts, prompt]).tolist()
        decodes = draw(st.integers(0, 5))
        steps = chunks + [1] * decodes
        wants = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
        wants[-1] = True  # every request reports at least once
        reqs.append(Req(rng.integers(3, vocab, size=prompt + decodes).tolist(), steps, wants))
    need = sum(-(-len(r.tokens) // block_size) for r in reqs)
    pool = need + draw(st.integers(0, 8), label="spare_blocks")
    perm = draw(st.permutations(range(pool)), label="block_ids")
    at = 0
    for r in reqs:
        k = -(-len(r.tokens) // block_size)
        r.blocks = list(perm[at:at + k])
        at += k
    return block_size, pool, reqs


def groupings(n_steps: list[int]):
    """A random partition of every request's steps into batches, steps of a request in order."""
    @st.composite
    def draw_rounds(draw):
        left, done, rounds = list(n_steps), [0] * len(n_steps), []
        while any(left):
            active = [i for i, k in enumerate(left) if k]
            chosen = [i for i in active if draw(st.booleans())] or [active[0]]
            rounds.append([(i, done[i]) for i in chosen])
            for i in chosen:
                left[i] -= 1
                done[i] += 1
        return rounds
    return draw_rounds()


@st.composite
def trace_workloads(draw):
    """A small trace and an engine to serve it: any policy and allocator, pools small enough for
    preemptions and rejections, prompts of few symbols (prefix hits)."""
    n = draw(st.integers(1, 14))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 96))
    num_blocks = draw(st.integers(-(-max_model_len // block_size), 4 * -(-max_model_len // block_size)))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0005, 0.003, 0.02, 0.2]), min_size=n, max_size=n))
    reqs = []
    t = 0.0
    for i, gap in enumerate(gaps):
        t += gap
        plen = draw(st.integers(1, max_model_len))
        prompt = [draw(st.integers(0, 3)) for _ in range(plen)]  # few symbols: prefix hits
        stop = [SIM_TOKEN] if draw(st.integers(0, 9)) == 0 else []
        sp = SamplingParams(ignore_eos=True, max_tokens=draw(st.integers(1, 60)), stop_token_ids=stop)
        reqs.append(Request(f"r{i}", prompt, sp, arrival=t, priority=draw(st.integers(0, 2))))
    return dict(reqs=reqs, policy=draw(st.sampled_from(POLICIES)),
                allocator=draw(st.sampled_from(sorted(ALLOCATORS))), num_blocks=num_blocks,
                block_size=block_size, max_model_len=max_model_len, budget=draw(st.integers(1, 48)),
                seats=draw(st.integers(1, 6)), replicas=draw(st.sampled_from([1, 1, 2])))
