"""The heart of the suite: any mixed varlen batch gives each request the logits it would get alone.

Hypothesis draws whole workloads: 1–8 requests, each split into steps (full prefill or several
chunks, then decodes), a block size (1 and sizes that do not divide the lengths included), block
ids scattered and shuffled over a pool, and a random grouping of the requests' steps into mixed
batches. The oracle is the unmodified HF model (SDPA attention) run on each request alone.

By causality, HF's logits at position p of the request's whole sequence are the logits of the
sequence "so far" at p, so one oracle forward per request covers every step.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

if not torch.cuda.is_available():
    # The triton backend runs on CPU in Triton's interpreter, which must be chosen before anything
    # imports triton (backends/triton_paged.py says why); nothing has yet.
    os.environ["TRITON_INTERPRET"] = "1"

from backends import usable_backends  # noqa: E402
from varlen import registry  # noqa: E402
from varlen.batch import SeqSlice, build_batch  # noqa: E402
from varlen.model_runner import ModelRunner, load_model  # noqa: E402

TOL = 1e-4
CPU_BACKENDS = usable_backends("cpu", torch.float32, block_size=1)
# Backends whose kernels run here only in an interpreter, one program of their grid at a time in
# Python: the same properties on fewer examples (ci: 3 per test and model; thorough: 625).
INTERPRETED = ["triton"]
INTERPRETED_EXAMPLES = max(3, settings.default.max_examples // 8)


# Skipped only where they cannot run by design; anything else that keeps them from running
# (triton imported too early, a broken install) fails them, loudly.
if torch.cuda.is_available():
    NO_INTERPRETER = "this machine has CUDA: Triton runs compiled here (tests/test_gpu_backends.py)"
elif importlib.util.find_spec("triton") is None:
    NO_INTERPRETER = 'triton is not installed: pip install -e ".[triton]"'
else:
    NO_INTERPRETER = ""
COMPILED_PARAMS = [b for b in CPU_BACKENDS if b not in INTERPRETED]
INTERPRETED_PARAMS = [pytest.param(b, marks=pytest.mark.skipif(bool(NO_INTERPRETER), reason=NO_INTERPRETER))
                      for b in INTERPRETED]


@dataclass
class Req:
    tokens: list[int]
    steps: list[int]  # number of new tokens in each step; sums to len(tokens)
    wants: list[bool]  # per step: ask for logits?
    blocks: list[int] = field(default_factory=list)


@st.composite
def workloads(draw, vocab: int = 509, min_prompt: int = 1, max_requests: int = 8):
    """min_prompt: e.g. longer than a sliding window, so that windows cut every request."""
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


def run_grouping(runner: ModelRunner, reqs: list[Req], rounds) -> dict[tuple[int, int], torch.Tensor]:
    """Execute the rounds; return logits keyed by (request, step) for steps that asked for them."""
    offsets = [np.concatenate([[0], np.cumsum(r.steps)]) for r in reqs]
    out = {}
    for rnd in rounds:
        seqs = []
        for i, s in rnd:
            r, lo, hi = reqs[i], offsets[i][s], offsets[i][s + 1]
            seqs.append(SeqSlice(r.tokens[lo:hi], int(lo), r.blocks, r.wants[s], req_id=i))
        logits = runner.execute(build_batch(seqs, runner.block_size, runner.num_blocks))
        keys = [(i, s) for i, s in rnd if reqs[i].wants[s]]
        assert logits.shape[0] == len(keys)
        out.update(zip(keys, logits))
    return out


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def models(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    return load_model(path, torch.float32, "cpu"), load_model(path, torch.float32, "cpu", "sdpa")


def check_mixed_batches_match_each_request_alone(models, backend: str, data, max_requests: int = 8) -> None:
    model, oracle = models
    block_size, pool, reqs = data.draw(workloads(max_requests=max_requests))
    rounds = data.draw(groupings([len(r.steps) for r in reqs]), label="rounds")
    runner = ModelRunner(model, registry.build("backend", backend), block_size, pool)
    assert_each_matches_alone(run_grouping(runner, reqs, rounds), reqs, oracle)


def assert_each_matches_alone(got: dict, reqs: list, oracle, label: str = "") -> None:
    """Every logit row the batched run kept equals the oracle's on that request alone, within TOL."""
    with torch.inference_mode():
        for i, r in enumerate(reqs):
            alone = oracle(torch.tensor([r.tokens])).logits[0]
            ends = np.cumsum(r.steps) - 1
            for s, want in enumerate(r.wants):
                if want:
                    err = (got[(i, s)] - alone[ends[s]]).abs().max().item()
                    assert err <= TOL, f"{label}request {i} step {s}: max abs error {err:.2e} > {TOL}"


def check_two_batchings_agree(models, backend: str, data, max_requests: int = 8) -> None:
    model, _ = models
    block_size, pool, reqs = data.draw(workloads(max_requests=max_requests))
    n_steps = [len(r.steps) for r in reqs]
    first = data.draw(groupings(n_steps), label="first")
    second = data.draw(groupings(n_steps), label="second")
    a = run_grouping(ModelRunner(model, registry.build("backend", backend), block_size, pool), reqs, first)
    b = run_grouping(ModelRunner(model, registry.build("backend", backend), block_size, pool), reqs, second)
    assert a.keys() == b.keys()
    for key in a:
        err = (a[key] - b[key]).abs().max().item()
        assert err <= TOL, f"(request, step) {key}: batchings differ by {err:.2e}"


@pytest.mark.parametrize("backend", COMPILED_PARAMS)
@given(data=st.data())
def test_mixed_batches_match_each_request_alone(models, backend, data):
    check_mixed_batches_match_each_request_alone(models, backend, data)


@pytest.mark.parametrize("backend", COMPILED_PARAMS)
@given(data=st.data())
def test_two_batchings_agree(models, backend, data):
    check_two_batchings_agree(models, backend, data)


@pytest.mark.parametrize("backend", INTERPRETED_PARAMS)
@settings(max_examples=INTERPRETED_EXAMPLES)
@given(data=st.data())
def test_mixed_batches_match_each_request_alone_interpreted(models, backend, data):
    check_mixed_batches_match_each_request_alone(models, backend, data, max_requests=4)


# Interpreted: up to 4 requests a workload (steps still mix prefills, chunks and decodes).
@pytest.mark.parametrize("backend", INTERPRETED_PARAMS)
@settings(max_examples=INTERPRETED_EXAMPLES)
@given(data=st.data())
def test_two_batchings_agree_interpreted(models, backend, data):
    check_two_batchings_agree(models, backend, data, max_requests=4)


def test_error_is_detected(models):
    """The oracle comparison is not vacuous: attending to a wrong context is caught."""
    model, oracle = models
    tokens = list(range(10, 30))
    runner = ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    runner.execute(build_batch([SeqSlice(tokens[:10], 0, [0, 1, 2, 3, 4])], 4))
    # Second chunk pointed at a block table whose first block is wrong (block 5 was never written).
    logits = runner.execute(build_batch([SeqSlice(tokens[10:], 10, [5, 1, 2, 3, 4])], 4))
    with torch.inference_mode():
        alone = oracle(torch.tensor([tokens])).logits[0, -1]
    assert (logits[0] - alone).abs().max().item() > TOL


@pytest.fixture(scope="module")
def packed_models(tiny_model_dirs):
    """Its own copy of the model (packing changes the modules' forward, and `models` is shared)."""
    path = tiny_model_dirs["qwen3"]
    return load_model(path, torch.float32, "cpu"), load_model(path, torch.float32, "cpu", "sdpa")


@pytest.mark.parametrize("backend", ["torch_paged", "torch_sdpa"])
@given(data=st.data())
def test_mixed_batches_match_each_request_alone_on_packed_linear_layers(packed_models, backend, data):
    """The same property with every linear layer on oneDNN's packed kernel (`linear_kernel=onednn`;
    `auto` leaves the tiny model's small layers on F.linear, so the suites above do not reach it)."""
    model, oracle = packed_models
    block_size, pool, reqs = data.draw(workloads(max_requests=6))
    rounds = data.draw(groupings([len(r.steps) for r in reqs]), label="rounds")
    runner = ModelRunner(model, registry.build("backend", backend), block_size, pool, linear_kernel="onednn")
    assert runner.linear_kernel == "onednn_packed"
    assert_each_matches_alone(run_grouping(runner, reqs, rounds), reqs, oracle)
