"""`python -m varlen.check KIND=NAME`: a user's plug-in (a config folder on VARLEN_CONFIG_PATH, its
package on sys.path) checked alone. A correct one passes (exit 0, a table); a subtly wrong policy,
a backend with a wrong answer, a cost model whose parts miss time and a router out of range each
fail with the property named (exit 1); bad input is one line (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.plugins.test_plugins import installed_plugins
from varlen.check import main

FILES = {
    "pkgs/checkme/__init__.py": "",
    "pkgs/checkme/policies.py": '''
        from schedulers.chunked import ChunkedPolicy

        class FastLane(ChunkedPolicy):
            """chunked, admitting the shortest waiting prompt first."""
            repeats_decode_batches = True

            def waiting_order(self):
                return sorted(self.waiting, key=lambda r: r.num_prompt_tokens)

        class OneTooMany(ChunkedPolicy):
            """chunked, but a cut chunk gets one token past the step's budget."""
            repeats_decode_batches = True

            def _grant(self, req, budget):
                pending = req.num_prompt_tokens + len(req.output_token_ids) - req.num_computed_tokens
                return min(pending, budget + 1)
        ''',
    "pkgs/checkme/backend.py": '''
        from backends.torch_sdpa import TorchSdpaBackend

        class Scaled(TorchSdpaBackend):
            """torch_sdpa with its output 0.1% too large (a wrong softmax scale, say)."""
            name = "scaled"

            def forward(self, *args, **kwargs):
                return super().forward(*args, **kwargs) * 1.001
        ''',
    "pkgs/checkme/cost.py": '''
        from sim.cost.roofline import RooflineCostModel

        class Padded(RooflineCostModel):
            """roofline plus 1 ms a step that no part accounts for."""
            def step_total(self, f, attention):
                return super().step_total(f, attention) + 1e-3
        ''',
    "pkgs/checkme/router.py": '''
        class PastTheEnd:
            """Every third request to a replica that does not exist."""
            def __init__(self):
                self.n = 0

            def __call__(self, replicas, req):
                self.n += 1
                return len(replicas) if self.n % 3 == 0 else 0
        ''',
    "pkgs/checkme/alloc.py": '''
        from varlen.kv import PagedAllocator

        class Forgetful(PagedAllocator):
            """paged, but every third request's blocks are never given back."""
            freed = 0

            def free(self, req):
                type(self).freed += 1
                if type(self).freed % 3:
                    super().free(req)
        ''',
    "conf/allocator/forgetful.yaml": "_target_: checkme.alloc.Forgetful\n_partial_: true\n",
    "conf/scheduler/fastlane.yaml": "_target_: checkme.policies.FastLane\nmax_num_seqs: 64\nmax_num_batched_tokens: 512\n",
    "conf/scheduler/onetoomany.yaml": "_target_: checkme.policies.OneTooMany\n",
    "conf/backend/scaled.yaml": "_target_: checkme.backend.Scaled\n",
    "conf/cost/padded.yaml": "_target_: checkme.cost.Padded\n",
    "conf/router/past_the_end.yaml": "_target_: checkme.router.PastTheEnd\n",
}


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    with installed_plugins(tmp_path_factory.mktemp("checkme"), FILES, ("checkme",)) as found:
        yield found["env"]


def check(capsys, *args: str, examples: int = 3) -> tuple[int, str]:
    # The same examples every run; shrinking a failure to its smallest would take minutes.
    code = main([*args, "--examples", str(examples), "--derandomize", "--no-shrink"])
    return code, capsys.readouterr().out


def test_a_correct_policy_passes_from_the_command_line(plugins, tmp_path):
    res = subprocess.run([sys.executable, "-m", "varlen.check", "scheduler=fastlane", "--examples", "2"],
                         capture_output=True, text=True, env=plugins, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("  PASS")]
    assert len(rows) == 4 and "4 passed, 0 failed" in res.stdout
    for prop in ("scheduling invariants", "fast-forward changes nothing", "decode promise kept",
                 "each request alone (HF greedy)"):
        assert any(prop in r for r in rows), prop
    assert "info  fast-forward covers" in res.stdout and "info  step overhead" in res.stdout
    assert res.stdout.rstrip().endswith("4 passed, 0 failed")  # the verdict is the last thing said
    assert "leaked" not in res.stdout + res.stderr


def test_a_policy_one_token_over_budget_fails_named(plugins, capsys):
    code, out = check(capsys, "scheduler=onetoomany", examples=20)
    assert code == 1
    failed = [ln for ln in out.splitlines() if ln.startswith("  FAIL")]
    assert any("scheduling invariants" in ln for ln in failed), out
    assert out.splitlines()[-1].startswith(f"{4 - len(failed)} passed, {len(failed)} failed: ")
    assert "| Falsifying example:" in out and "| state.step()" in out  # the steps that broke it


def test_an_allocator_leaking_blocks_fails_named(plugins, capsys):
    code, out = check(capsys, "allocator=forgetful", examples=10)
    assert code == 1
    assert "FAIL  scheduling invariants" in out, out


def test_a_backend_with_a_wrong_answer_fails(plugins, capsys):
    code, out = check(capsys, "backend=scaled")
    assert code == 1
    assert "FAIL  same output and KV write as torch_ref" in out and "differs from torch_ref's" in out
    assert "FAIL  mixed batch == each request alone" in out


def test_shipped_torch_sdpa_passes(plugins, capsys):
    code, out = check(capsys, "backend=torch_sdpa")
    assert code == 0, out
    assert "3 passed, 0 failed" in out


def test_a_cost_model_with_unaccounted_time_fails_on_its_parts(plugins, capsys):
    code, out = check(capsys, "cost=padded")
    assert code == 1
    assert "FAIL  parts sum to the step time" in out and "PASS  step time finite and non-negative" in out
    code, out = check(capsys, "cost=roofline")
    assert code == 0, out


def test_a_router_out_of_range_fails(plugins, capsys):
    code, out = check(capsys, "router=past_the_end")
    assert code == 1 and "FAIL  a valid replica index" in out and "replicas" in out
    code, out = check(capsys, "router=round_robin")
    assert code == 0, out


@pytest.mark.parametrize("args, said", [
    (["scheduler=nosuch"], "unknown scheduler 'nosuch'"),
    (["policy=chunked"], "KIND one of scheduler, allocator, backend, cost, router"),
    (["scheduler=chunked", "allocator.x=1"], "give settings of the plug-in as scheduler.key=value"),
    (["cost=profiled"], "needs cost.path"),
])
def test_bad_input_is_one_line_and_exit_2(plugins, capsys, args, said):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and err.startswith("varlen.check: ")


def test_without_hypothesis_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    assert main(["scheduler=chunked"]) == 2
    assert capsys.readouterr().err == 'varlen.check needs hypothesis: pip install "varlen[test]"\n'
