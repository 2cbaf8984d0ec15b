"""Mixed batch == each request alone: any grouping of requests' steps into varlen batches gives each
request the logits the unmodified HF model (SDPA) gives it alone. By causality, HF's logits at
position p of the whole sequence are those of the sequence so far, so one oracle forward per
request covers every step."""

from __future__ import annotations

import numpy as np
import torch

from backends import usable_backends
from varlen import registry
from varlen.batch import SeqSlice, build_batch
from varlen.model_runner import ModelRunner, load_model
from varlen.testing.strategies import Req, batch_workloads, groupings

TOL = 1e-4
# Backends whose kernels run here only in an interpreter (slow): the suites give them fewer examples.
INTERPRETED = ["triton"]
# The GPU suite's backends and their block sizes: flash-attn 2.x pages must be multiples of 256;
# FlashInfer and Triton take any size, including 1 and sizes that do not divide the lengths.
GPU_BLOCK_SIZES = {"flash_attn": [256, 512], "flashinfer": [1, 7, 16, 256], "triton": [16, 1, 7, 256]}


def cpu_backends() -> list[str]:
    """The backends of the group (shipped and the user's) that run on this CPU in float32."""
    return usable_backends("cpu", torch.float32, block_size=1)


def load_pair(path: str):
    """(model under test, oracle): the same checkpoint loaded twice, the oracle on HF's SDPA attention."""
    return load_model(path, torch.float32, "cpu"), load_model(path, torch.float32, "cpu", "sdpa")


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


def check_mixed_batches_match_each_request_alone(models, backend: str, data, max_requests: int = 8) -> None:
    model, oracle = models
    block_size, pool, reqs = data.draw(batch_workloads(max_requests=max_requests))
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
    block_size, pool, reqs = data.draw(batch_workloads(max_requests=max_requests))
    n_steps = [len(r.steps) for r in reqs]
    first = data.draw(groupings(n_steps), label="first")
    second = data.draw(groupings(n_steps), label="second")
    a = run_grouping(ModelRunner(model, registry.build("backend", backend), block_size, pool), reqs, first)
    b = run_grouping(ModelRunner(model, registry.build("backend", backend), block_size, pool), reqs, second)
    assert a.keys() == b.keys()
    for key in a:
        err = (a[key] - b[key]).abs().max().item()
        assert err <= TOL, f"(request, step) {key}: batchings differ by {err:.2e}"
