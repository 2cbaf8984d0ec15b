"""A new plug-in is one file and one yaml: a backend and a policy written outside the repository
(a temporary package, and a config folder on VARLEN_CONFIG_PATH) run through LLM(...), varlen.run,
sim.run and the property suites, which take them from their groups like the shipped ones."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings, strategies as st

from tests.cli.test_cli_errors import run_main
from varlen import LLM, SamplingParams, registry
from varlen.testing.equivalence import check_mixed_batches_match_each_request_alone

ROOT = Path(__file__).resolve().parents[2]

FILES = {
    # The backend: one module...
    "pkgs/mybackends/__init__.py": "",
    "pkgs/mybackends/fancy.py": '''
        from backends.torch_sdpa import TorchSdpaBackend

        class FancyBackend(TorchSdpaBackend):
            """torch_sdpa, counting the steps it prepares (where a new kernel's metadata would go)."""
            name = "fancy"
            steps = 0

            def prepare(self, batch, device):
                type(self).steps += 1
                return super().prepare(batch, device)
        ''',
    # ... and its yaml.
    "conf/backend/fancy.yaml": '''
        # A user's backend (tests/plugins/test_plugins.py).
        _target_: mybackends.fancy.FancyBackend
        ''',
    # The policy: one module...
    "pkgs/mypolicies/__init__.py": "",
    "pkgs/mypolicies/capped.py": '''
        from schedulers.chunked import ChunkedPolicy

        class FewestTokensFirst(ChunkedPolicy):
            """chunked, admitting the waiting request that asks for the fewest output tokens first
            (arrival order among equals); `max_chunk` caps any request's tokens in a step."""
            repeats_decode_batches = True  # its own promise: a decode's turn and grant are unchanged

            def __init__(self, max_num_seqs=64, max_num_batched_tokens=2048, max_chunk=None):
                super().__init__(max_num_seqs, max_num_batched_tokens)
                self.max_chunk = max_chunk

            def waiting_order(self):
                return sorted(self.waiting, key=lambda r: r.sampling.max_tokens)

            def _grant(self, req, budget):
                return super()._grant(req, budget if self.max_chunk is None else min(budget, self.max_chunk))
        ''',
    # ... and its yaml.
    "conf/scheduler/mine.yaml": '''
        # A user's policy (tests/plugins/test_plugins.py): chunked, fewest output tokens admitted first.
        _target_: mypolicies.capped.FewestTokensFirst
        max_num_seqs: 64
        max_num_batched_tokens: 512
        max_chunk: null
        ''',
}


@contextlib.contextmanager
def installed_plugins(root: Path, files: dict[str, str], packages: tuple[str, ...]) -> Iterator[dict]:
    """`files` written under `root`, their config folder (root/conf) on VARLEN_CONFIG_PATH and their
    packages (root/pkgs) on sys.path, here and, by the yielded `env`, in a subprocess."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip())
    env = dict(os.environ, VARLEN_CONFIG_PATH=str(root / "conf"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root / "pkgs"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VARLEN_CONFIG_PATH", str(root / "conf"))
        mp.syspath_prepend(str(root / "pkgs"))
        yield dict(root=root, env=env)
    for mod in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def user_plugins(tmp_path_factory):
    with installed_plugins(tmp_path_factory.mktemp("user"), FILES, ("mybackends", "mypolicies")) as found:
        yield found


def test_the_groups_name_them(user_plugins):
    assert "fancy" in registry.names("backend") and "mine" in registry.names("scheduler")
    assert registry.files("scheduler")["mine"] == user_plugins["root"] / "conf/scheduler/mine.yaml"
    pol = registry.build("scheduler", "mine", max_num_seqs=2, max_chunk=8)
    assert type(pol).__name__ == "FewestTokensFirst" and pol.max_chunk == 8 and pol.max_num_seqs == 2


def test_llm_runs_them(user_plugins, tiny_model_dirs):
    prompts = [[5] * 30, [6] * 3, [7] * 19]
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 5, 2)]
    llm = LLM(tiny_model_dirs["qwen3"], backend="fancy", scheduler="mine", block_size=4, max_model_len=64,
              max_num_seqs=1)
    backend_cls = type(llm.backend)
    before = backend_cls.steps
    got = [o.token_ids for o in llm.generate(prompts, sps)]
    assert backend_cls.__name__ == "FancyBackend" and backend_cls.steps - before == len(llm.engine.steps)
    # One seat: the request asking for the fewest tokens (the third) runs first, then the second.
    firsts = list(dict.fromkeys(rid for s in llm.engine.steps for rid in s.req_ids))
    assert firsts == ["2", "1", "0"]
    ref = LLM(tiny_model_dirs["qwen3"], backend="torch_sdpa", scheduler="chunked", block_size=4, max_model_len=64)
    assert got == [o.token_ids for o in ref.generate(prompts, sps)]


@settings(max_examples=10)
@given(data=st.data())
def test_the_user_backend_passes_the_batch_equivalence_check(user_plugins, models, data):
    check_mixed_batches_match_each_request_alone(models, "fancy", data)


def test_varlen_run_runs_them(user_plugins, tmp_path, monkeypatch, capsys):
    # In this process, as `python -m varlen.run` runs it (run_cli, Hydra): a subprocess would pay
    # ~10 s of torch and transformers imports; the user's folder and packages are set up here too.
    monkeypatch.setenv("VARLEN_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("varlen.run", ["backend=fancy", "scheduler=mine", "scheduler.max_chunk=4",
                                             f"hydra.run.dir={tmp_path / 'out'}", "progress=false", "engine.threads=1",
                                             "workload.limit=5", "workload.output_len=uniform:2:4"],
                              monkeypatch, capsys, through_cli=True)
    assert code == 0, err
    assert "backend fancy | scheduler FewestTokensFirst" in out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["finished"] == 5
    assert max_new_tokens(tmp_path / "out" / "steps.csv") == 4  # scheduler.max_chunk=4 reached the policy


def test_sim_run_runs_the_policy(user_plugins, tmp_path):
    res = subprocess.run([sys.executable, "-m", "sim.run", "scheduler=mine", "workload.limit=30", "sim_model=tiny",
                          "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=1024",
                          f"hydra.run.dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, env=user_plugins["env"], timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["scheduler"] == "mine" and summary["finished"] == 30


def test_a_class_path_on_the_command_line(user_plugins, tmp_path):
    """No yaml at all: scheduler._target_= names the class (its module on sys.path)."""
    res = subprocess.run([sys.executable, "-m", "sim.run", "scheduler._target_=mypolicies.capped.FewestTokensFirst",
                          "+scheduler.max_chunk=2", "workload.limit=10", "sim_model=tiny", "hardware=cpu_2core",
                          "engine.num_blocks=256", "engine.max_model_len=1024", f"hydra.run.dir={tmp_path / 'out'}",
                          "output.steps=true", "output.step_detail=true"],
                         capture_output=True, text=True, env=dict(user_plugins["env"], VARLEN_CONFIG_PATH=""),
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["finished"] == 10 and summary["scheduler"] == "mypolicies.capped.FewestTokensFirst"
    assert max_new_tokens(tmp_path / "out" / "steps.csv") == 2


def max_new_tokens(steps_csv: Path) -> int:
    """The most new tokens any request got in one step (steps.csv's per-request column)."""
    import pandas as pd

    col = pd.read_csv(steps_csv, dtype={"new_tokens": str})["new_tokens"]
    return max(int(n) for v in col for n in v.split())


@pytest.mark.slow
def test_the_suites_take_them_from_the_groups(user_plugins):
    """The property and invariant suites parametrise over registry.names(group): with the user's
    folder on VARLEN_CONFIG_PATH they run the user's backend and policy too, unchanged."""
    suites = ["tests/engine/test_equivalence.py", "tests/schedulers/test_scheduling_invariants.py",
              "tests/sim/test_sim_fastforward.py", "tests/plugins/test_plugin_promises.py",
              "tests/schedulers/test_policies.py"]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "fancy or mine",
                          *suites], capture_output=True, text=True, env=user_plugins["env"], cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", res.stdout).group(1))
    assert passed >= 12 and "skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]
