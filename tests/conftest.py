"""Shared test setup: hypothesis profiles, thread count, the tiny model folders and their oracles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Two processes each using 2 torch threads slow each other 10x on the 2-core CI machine.
torch.set_num_threads(int(os.environ.get("VARLEN_TEST_THREADS", "1")))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=25, **_common)
settings.register_profile("dev", max_examples=100, **_common)
settings.register_profile("thorough", max_examples=5000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both tiny architectures, written once per test session through the real HF save path."""
    from varlen.tiny_model import ARCHITECTURES, write_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(write_tiny_model(root / arch, arch)) for arch in ARCHITECTURES}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def models(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, str]):
    """(model, its HF SDPA oracle) of each tiny architecture: the mixed-batch properties' subjects."""
    from varlen.testing.equivalence import load_pair

    return load_pair(tiny_model_dirs[request.param])
