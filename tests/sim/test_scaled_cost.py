"""cost.time_scale / ScaledCostModel: a cost model's step times on a machine a known factor slower or faster."""

from __future__ import annotations

import math
from functools import partial

import pytest

from sim.cost.base import StepSums
from sim.cost.fitted import ProfiledCostModel
from sim.cost.registry import build_cost_model, cost_model_factory, shareable
from sim.cost.replay import ReplayCostModel
from sim.cost.roofline import RooflineCostModel
from sim.cost.scaled import ScaledCostModel

STEPS = [([1], [0]), ([1, 1, 1], [10, 200, 3000]), ([64], [0]), ([40, 1, 1], [128, 7, 900]), ([1] * 9, [50] * 9)]


def profiled() -> ProfiledCostModel:
    return ProfiledCostModel(coef={"const": 7e-3, "new_tokens": 2e-4, "num_seqs": 1e-3, "attn_work": 3e-9,
                                   "cached_tokens": 1e-6, "prefill_seqs": 2e-3, "logit_rows": 5e-4,
                                   "decode_batch_2": 4e-3})


@pytest.mark.parametrize("scale", [1.0, 1.0831, 0.87, 3.0])
@pytest.mark.parametrize("make", [lambda: RooflineCostModel("tiny", "cpu_2core"), profiled])
def test_every_step_time_is_the_inner_models_times_the_factor_exactly(make, scale: float) -> None:
    inner = make()
    m = ScaledCostModel(inner, scale)
    for new, cached in STEPS:
        assert m.step_time(new, cached) == inner.step_time(new, cached) * scale
        s = StepSums.of(new, cached)
        assert m.step_time_sums(s) == inner.step_time_sums(s) * scale
        parts, inner_parts = m.parts(s), inner.parts(s)
        assert {k for k, v in parts.items() if v is None} == {k for k, v in inner_parts.items() if v is None}
        assert sum(v for v in parts.values() if v is not None) == pytest.approx(m.step_time(new, cached), rel=1e-12)
    for batch in (1, 2, 5):  # the fast-forward's closure is the step formula, bit for bit
        closure = m.decode_step_time(batch)
        for cached in (0, 333, 5000):
            assert closure(cached) == m.step_time_sums(StepSums(batch, batch, cached, cached, batch, batch))
    assert m.overhead_form == pytest.approx(tuple(x * scale for x in inner.overhead_form), rel=1e-15)


def test_a_simulation_under_a_scale_takes_each_step_that_many_times_as_long() -> None:
    """Every request at time 0 makes the same batches at any speed: each simulated step is `scale` x."""
    from schedulers import ChunkedPolicy
    from sim.validate import simulate_like
    from varlen.kv import PagedAllocator
    from varlen.request import Request
    from varlen.sampling_params import SamplingParams

    def reqs():
        return [Request(f"r{i}", list(range(3, 3 + 20 + 13 * i)), SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True))
                for i in range(6)]

    run = partial(simulate_like, make_policy=partial(ChunkedPolicy, max_num_seqs=4, max_num_batched_tokens=64),
                  make_kv=partial(PagedAllocator, 256, 16, 512), max_model_len=512)
    inner = profiled()
    base, scaled = run(reqs(), cost=inner), run(reqs(), cost=ScaledCostModel(inner, 1.25))
    assert [s.new_tokens for s in base.steps] == [s.new_tokens for s in scaled.steps]
    assert [s.duration for s in scaled.steps] == pytest.approx([s.duration * 1.25 for s in base.steps], rel=1e-12)
    assert len(base.steps) > 10


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "fast", True, None])
def test_a_bad_factor_is_refused_in_one_line(bad) -> None:
    with pytest.raises(ValueError) as e:
        ScaledCostModel(profiled(), bad)
    msg = str(e.value)
    assert "\n" not in msg and "cost.time_scale" in msg and "above 0" in msg


def test_a_model_without_a_step_formula_is_refused_in_one_line() -> None:
    for replay in (ReplayCostModel([0.01, 0.02]), ReplayCostModel([0.01, 0.02], starts=[0.0, 0.5])):
        with pytest.raises(ValueError) as e:
            ScaledCostModel(replay, 1.1)
        assert "\n" not in str(e.value) and "ReplayCostModel" in str(e.value)


def test_cost_time_scale_wraps_any_named_model_and_is_checked_at_once() -> None:
    plain = build_cost_model({"model": "roofline"}, "tiny", "cpu_2core")
    slow = build_cost_model({"model": "roofline", "time_scale": 1.5}, "tiny", "cpu_2core")
    assert isinstance(slow, ScaledCostModel) and slow.scale == 1.5
    assert slow.step_time([1, 1], [40, 90]) == plain.step_time([1, 1], [40, 90]) * 1.5
    make = cost_model_factory({"model": "roofline", "time_scale": 2}, "tiny", "cpu_2core")
    assert shareable(make()) and make() is make()  # a scaled roofline holds no state a run changes
    with pytest.raises(ValueError, match="cost.time_scale=-2"):
        cost_model_factory({"model": "roofline", "time_scale": -2}, "tiny", "cpu_2core")


def test_the_command_line_scales_explain_and_refuses_a_bad_factor_with_exit_2(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    base = [sys.executable, "-m", "sim.explain", "sim_model=llama3_8b", "hardware=h100_sxm", "step.new=[1,1]",
            "step.cached=[100,2000]"]
    totals = []
    for scale, out in ((None, tmp_path / "a"), (1.5, tmp_path / "b")):
        extra = [] if scale is None else [f"+cost.time_scale={scale}"]
        subprocess.run(base + extra + [f"hydra.run.dir={out}"], env=env, check=True, capture_output=True, timeout=600)
        totals.append(json.loads((out / "explain.json").read_text()))
    assert totals[1]["total_s"] == pytest.approx(totals[0]["total_s"] * 1.5, rel=1e-12)
    bad = subprocess.run(base + ["+cost.time_scale=-1", f"hydra.run.dir={tmp_path / 'c'}"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2
    assert "cost.time_scale=-1" in bad.stderr.strip().splitlines()[-1]
