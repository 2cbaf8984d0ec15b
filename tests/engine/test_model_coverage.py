"""The coverage matrix: every supported architecture runs exactly, every other one is refused.

For each tiny architecture of `varlen.tiny_model.ARCHITECTURES` (written as a real HF folder and
loaded back), and each CPU backend (torch_paged, the default on CPU, among them): if the backend declares every attention feature the model's
layers use, the mixed-batch property test of test_equivalence runs against the HF model alone
(eager attention, the definition of each feature), with prompts longer than the sliding window
where the model has one; otherwise the backend must refuse the model at start-up, in one line.
Each of `REFUSED_ARCHITECTURES` must be refused with its reason. README.md's table is the one
`python -m varlen.architectures` generates.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from varlen import registry
from varlen.architectures import markdown_table, readme_table
from varlen.model_attention import UnsupportedModel
from varlen.model_runner import ATTN_NAME, ModelRunner, load_model, register_varlen_attention
from varlen.testing.equivalence import assert_each_matches_alone, run_grouping
from varlen.testing.strategies import batch_workloads as workloads, groupings
from varlen.tiny_model import ARCHITECTURES, REFUSED_ARCHITECTURES, WINDOW, tiny_model, write_tiny_model

CPU_BACKENDS = ["torch_ref", "torch_sdpa", "torch_paged"]
# A few examples per architecture: the matrix is wide; the `ci` profile's 25 become 3 here.
FEW = max(3, settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci")).max_examples // 8)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch_models(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("arch") / request.param, request.param)
    return request.param, load_model(path, torch.float32, "cpu"), load_model(path, torch.float32, "cpu", "eager")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=FEW)
@given(data=st.data())
def test_architecture_matches_hf_per_request(arch_models, backend, data):
    arch, model, oracle = arch_models
    block_size, pool, reqs = data.draw(workloads(min_prompt=WINDOW + 3, max_requests=4))
    rounds = data.draw(groupings([len(r.steps) for r in reqs]), label="rounds")
    be = registry.build("backend", backend)
    try:
        runner = ModelRunner(model, be, block_size, pool)
    except ValueError as err:
        # Refused at start-up: only for a feature the backend does not declare, said in one line.
        msg = str(err)
        assert "\n" not in msg and type(model).__name__ in msg and "does not implement" in msg, msg
        used = {f for layer in ModelRunner(model, registry.build("backend", "torch_ref"), block_size, pool).layers
                for f in layer.features}
        assert used - be.features, f"{backend} refused {arch} although it declares {sorted(used)}"
        return
    assert_each_matches_alone(run_grouping(runner, reqs, rounds), reqs, oracle, f"{arch}/{backend} ")


def test_the_default_backend_is_the_fast_path_for_every_architecture(arch_models, capsys):
    """backend=auto picks torch_paged on CPU fp32 for every architecture (all its features are
    torch_paged's), says so in one line, and then is torch_paged."""
    arch, model, _ = arch_models
    runner = ModelRunner(model, registry.build("backend", "auto"), 4, 8)
    assert runner.backend.name == "torch_paged" and type(runner.backend.chosen).__name__ == "TorchPagedBackend"
    assert capsys.readouterr().err.strip().splitlines()[-1] == "backend: auto -> torch_paged (cpu float32)"


REASONS = {"deepseek_v3": "multi-head latent attention", "mamba": "state-space", "jamba": "state-space",
           "falcon_h1": "state-space", "qwen3_next": "linear-attention", "llama4_text": "chunked local attention",
           "bloom": "never call the attention interface", "mpt": "probe forward", "stablelm": "forward keywords"}


@pytest.mark.parametrize("arch", list(REFUSED_ARCHITECTURES))
def test_refused_architectures_say_why_in_one_line(arch):
    assert set(REASONS) == set(REFUSED_ARCHITECTURES)
    register_varlen_attention()
    model = tiny_model(arch, attn_implementation=ATTN_NAME)
    with pytest.raises(UnsupportedModel) as info:
        ModelRunner(model, registry.build("backend", "torch_ref"), 4, 8)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(type(model).__name__) and REASONS[arch] in msg, msg
    assert "supported" in msg, msg  # and what is supported


def test_readme_table_is_generated_from_the_matrix():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert readme_table(readme) == markdown_table(), \
        "README's architectures table is stale: run python -m varlen.architectures --write"
