"""The heart of the suite: any mixed varlen batch gives each request the logits it would get alone
(the property and its workloads: varlen/testing/equivalence.py, varlen/testing/strategies.py), on
every CPU backend and both tiny architectures."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

if not torch.cuda.is_available():
    # The triton backend runs on CPU in Triton's interpreter, which must be chosen before anything
    # imports triton (backends/triton_paged.py says why); nothing has yet.
    os.environ["TRITON_INTERPRET"] = "1"

from varlen import registry  # noqa: E402
from varlen.batch import SeqSlice, build_batch  # noqa: E402
from varlen.model_runner import ModelRunner  # noqa: E402
from varlen.testing.equivalence import (  # noqa: E402
    INTERPRETED, TOL, assert_each_matches_alone, check_mixed_batches_match_each_request_alone,
    check_two_batchings_agree, cpu_backends, load_pair, run_grouping,
)
from varlen.testing.strategies import batch_workloads as workloads, groupings  # noqa: E402

CPU_BACKENDS = cpu_backends()
# Interpreted kernels run one program of their grid at a time in Python: the same properties on
# fewer examples (ci: 3 per test and model; thorough: 625).
INTERPRETED_EXAMPLES = max(3, settings.default.max_examples // 8)


# Skipped only where they cannot run by design; anything else that keeps them from running
# (triton imported too early, a broken install) fails them, loudly.
if torch.cuda.is_available():
    NO_INTERPRETER = "this machine has CUDA: Triton runs compiled here (tests/backends/test_gpu_backends.py)"
elif importlib.util.find_spec("triton") is None:
    NO_INTERPRETER = 'triton is not installed: pip install -e ".[triton]"'
else:
    NO_INTERPRETER = ""
COMPILED_PARAMS = [b for b in CPU_BACKENDS if b not in INTERPRETED]
INTERPRETED_PARAMS = [pytest.param(b, marks=pytest.mark.skipif(bool(NO_INTERPRETER), reason=NO_INTERPRETER))
                      for b in INTERPRETED]


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
    return load_pair(tiny_model_dirs["qwen3"])


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
