"""A process that runs the engine ends with its own output: nothing is printed at interpreter
teardown after it (Triton's bindings print `nanobind: leaked ...` lines there when Triton objects
outlive the program). Triton itself is imported by any process that loads a transformers model
(transformers 5.24: modeling_utils -> integrations.finegrained_fp8 -> integrations.deepgemm, whose
module-level `@torch._dynamo...` decorators import torch._dynamo, whose utils import triton when it
is installed); importing it alone prints nothing at exit. The lines came from sim.simulator's
gc.freeze(): garbage cycles holding Triton objects, frozen after a simulation, were never collected,
so they outlived Triton's module at shutdown (varlen.check after its HF property, sim_fidelity.py)."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import sys
from varlen import LLM, SamplingParams
out = LLM("tiny").generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 2, out
print("the program's last line", file=sys.stderr, flush=True)
"""


def test_a_tiny_engine_step_on_the_default_backend_ends_with_the_programs_last_line():
    run = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.rstrip().endswith("the program's last line"), run.stderr[-3000:]
    assert "backend: auto -> torch_paged" in run.stderr and "nanobind" not in run.stderr


def test_garbage_frozen_by_a_simulation_is_still_collected_at_exit():
    """sim.simulator.gc_paused freezes the objects alive after a simulation (the collector's next pass
    skips them). Garbage cycles frozen with them must still be collected at shutdown, before the
    modules they reference are torn down (else Triton objects so held make nanobind print leaks)."""
    code = ("import gc, sys\nfrom sim.simulator import gc_paused\n"
            "class Cycle:\n    def __del__(self): print('collected', flush=True)\n"
            "c = Cycle(); c.me = c; del c\n"  # garbage the collector has not yet visited
            "with gc_paused(): pass\n"
            "assert gc.get_freeze_count() > 0\nprint('end', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["end", "collected"], run.stdout
