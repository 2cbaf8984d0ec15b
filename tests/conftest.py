"""Shared test setup: hypothesis profiles, thread count, the tiny model folders and their oracles."""

from __future__ import annotations

import os
import shutil

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
    """Both tiny architectures, written once per test session through the real HF save path (only
    these two: ARCHITECTURES holds 30, which tests/engine/test_model_coverage.py builds itself)."""
    from varlen.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(write_tiny_model(root / arch, arch)) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def models(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, str]):
    """(model, its HF SDPA oracle) of each tiny architecture: the mixed-batch properties' subjects."""
    from varlen.testing.equivalence import load_pair

    return load_pair(tiny_model_dirs[request.param])


@pytest.fixture(scope="session")
def unoptimised_cc(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A CC for tests of where a C build looks and what it keeps, not of the code it makes: the
    compiler varlen.c_build would use, given -O0 after the build's own -O3 (the last one counts).
    paged_attention.c takes ~15 CPU s at -O3 and under 1 s at -O0; the flags in the cache key are
    unchanged, and every build made with it lies in a test's own cache folder."""
    import shlex

    from varlen.c_build import _compiler

    cc = shutil.which(_compiler()) or _compiler()
    path = tmp_path_factory.mktemp("cc") / "cc"
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(cc)} "$@" -O0\n')
    path.chmod(0o755)
    return str(path)
