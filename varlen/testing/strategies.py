"""Hypothesis strategies: one mixed step for the backend-level properties, mixed-batch workloads
for the model-level ones, small serving traces for the scheduling ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import strategies as st

from sim.executor import SIM_TOKEN
from varlen.batch import ForwardBatch, SeqSlice, build_batch
from varlen.request import Request
from varlen.sampling_params import SamplingParams


@st.composite
def mixed_batches(draw, pure_decode: bool | None = None) -> tuple[ForwardBatch, int]:
    """(batch, pool size): a step of 1-8 requests, fresh prefills, later chunks and decodes over
    scattered, shuffled blocks. Some requests hold spare blocks past what they need (an allocator
    may reserve ahead), which no backend may read."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16]), label="block_size")
    n = draw(st.integers(1, 8), label="num_requests")
    if pure_decode is None:
        pure_decode = draw(st.booleans(), label="pure_decode")
    shapes = []
    for _ in range(n):
        cached = draw(st.integers(0, 40))
        new = 1 if pure_decode else draw(st.integers(1, 20))
        spare = draw(st.integers(0, 2))
        shapes.append((cached, new, -(-(cached + new) // block_size) + spare))
    pool = sum(s[2] for s in shapes) + draw(st.integers(0, 8), label="free_blocks")
    perm = draw(st.permutations(range(pool)), label="block_ids")
    seqs, at = [], 0
    for i, (cached, new, nblk) in enumerate(shapes):
        seqs.append(SeqSlice(list(range(3, 3 + new)), cached, list(perm[at:at + nblk]), req_id=i))
        at += nblk
    return build_batch(seqs, block_size, pool), pool


@st.composite
def problems(draw, pure_decode: bool | None = None) -> dict:
    """A batch plus random fp32 tensors: the KV pool's earlier contents and this step's q/k/v."""
    batch, pool = draw(mixed_batches(pure_decode))
    h_kv = draw(st.sampled_from([1, 2]), label="kv_heads")
    group = draw(st.sampled_from([1, 2, 3]), label="gqa_group")
    d = draw(st.sampled_from([4, 8]), label="head_dim")
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    n = batch.num_tokens
    return dict(
        batch=batch,
        cache=torch.randn(2, pool, batch.block_size, h_kv, d, generator=gen),
        q=torch.randn(n, h_kv * group, d, generator=gen),
        k=torch.randn(n, h_kv, d, generator=gen),
        v=torch.randn(n, h_kv, d, generator=gen),
        scale=d ** -0.5,
    )


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
    from varlen.testing.fast_forward import ALLOCATORS, POLICIES  # builds the allocators: only when drawn

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
