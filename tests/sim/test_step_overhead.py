"""The per-step engine overhead: base + per request + per prefill request (sim.profile's form) in the
hardware specs, the roofline and measured models and sim.explain; a spec with only the old constant
`step_overhead_s` times steps exactly as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.cost.base import StepSums
from sim.cost.hardware import HardwareSpec
from sim.cost.measured import MeasuredCostModel
from sim.cost.roofline import RooflineCostModel

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
BATCHES = [([512], [0]), ([1] * 8, [300] * 8), ([200, 1, 1, 64], [0, 40, 900, 10]), ([1] * 128, [50] * 128)]


def _spec(name: str, **overhead: float) -> HardwareSpec:
    d = yaml.safe_load((ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
    d = {k: v for k, v in d.items() if not k.startswith("step_overhead")}
    return HardwareSpec.from_dict({**d, **overhead})


@pytest.mark.parametrize("cost", [RooflineCostModel, MeasuredCostModel])
def test_a_spec_with_only_step_overhead_s_times_steps_as_the_constant(cost: type) -> None:
    only = _spec("a100_80gb_sxm", step_overhead_s=0.0015)  # the old yaml's form
    zeros = _spec("a100_80gb_sxm", step_overhead_s=0.0015, step_overhead_per_seq_s=0.0, step_overhead_per_prefill_s=0.0)
    given = cost(LLAMA3_8B, _spec("a100_80gb_sxm"), overhead_s=0.0015)  # a constant given to the model
    assert (only.step_overhead_per_seq_s, only.step_overhead_per_prefill_s) == (0.0, 0.0)
    a, b = cost(LLAMA3_8B, only), cost(LLAMA3_8B, zeros)
    for n, c in BATCHES:
        assert a.step_time(n, c) == b.step_time(n, c) == given.step_time(n, c)
    assert a.decode_step_time(16)(4000) == given.decode_step_time(16)(4000)


@pytest.mark.parametrize("cost", [RooflineCostModel, MeasuredCostModel])
def test_overhead_grows_per_request_and_per_prefill(cost: type) -> None:
    form = dict(step_overhead_s=1e-3, step_overhead_per_seq_s=5e-5, step_overhead_per_prefill_s=4e-4)
    m, bare = cost(LLAMA3_8B, _spec("a100_80gb_sxm", **form)), cost(LLAMA3_8B, _spec("a100_80gb_sxm"))
    assert m.overhead_form == (1e-3, 5e-5, 4e-4) and bare.overhead_form == (0.0, 0.0, 0.0)
    for n, c in BATCHES:
        prefills = sum(x > 1 for x in n)
        want = 1e-3 + 5e-5 * len(n) + 4e-4 * prefills
        assert m.step_time(n, c) - bare.step_time(n, c) == pytest.approx(want, rel=1e-9)
    f = m.decode_step_time(32)  # the fast-forward's closure: the same floats as one step at a time
    assert f(6400) == m.step_time_sums(StepSums(32, 32, 6400, 6400, 32, 32))
    # An empty step (nothing new) pays the base and its requests' cost too.
    assert m.step_time([0, 0], [5, 5]) == pytest.approx(1e-3 + 2 * 5e-5)


def test_shipped_gpu_specs_carry_a_per_request_term() -> None:
    for name in ("a100_40gb_sxm", "a100_80gb_sxm", "a40", "h100_sxm", "h200_sxm"):
        hw = HardwareSpec.load(name)
        assert hw.step_overhead_per_seq_s > 0 and hw.step_overhead_s > 0, name
        assert hw.step_overhead(128, 0) > 4 * hw.step_overhead(1, 0), name  # large batches cost more per step
        text = (ROOT / "conf" / "hardware" / f"{name}.yaml").read_text()
        assert "cpu_overheads.csv" in text or "ESTIMATE" in text, name  # where the figure comes from


@pytest.mark.parametrize("field, value", [("step_overhead_per_seq_s", -1e-3), ("step_overhead_s", "1ms"),
                                          ("step_overhead_per_prefill_s", float("inf"))])
def test_a_bad_overhead_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{field}=.* must be a number of seconds >= 0"):
        _spec("h100_sxm", **{field: value})


def test_explain_breaks_the_overhead_down() -> None:
    from sim.explain import breakdown, format_table, overhead_terms

    m = RooflineCostModel(LLAMA3_8B, _spec("h100_sxm", step_overhead_s=8e-4, step_overhead_per_seq_s=4e-5,
                                           step_overhead_per_prefill_s=3e-4))
    new, cached = [300, 1, 1], [0, 10, 2000]
    parts, terms = breakdown(m, new, cached), overhead_terms(m, new)
    assert terms is not None and (terms["requests"], terms["prefills"]) == (3, 1)
    assert terms["per_step_s"] + terms["requests_s"] + terms["prefills_s"] == pytest.approx(parts["overhead_s"])
    d = {**parts, "model": "m", "hardware": "h", "cost_model": "roofline", "tensor": 1, "pipeline": 1,
         "step_new": new, "step_cached": cached, "overhead_terms": terms, "notes": m.notes,
         "kv_tokens_per_replica": 1, "weight_gb_per_gpu": 1.0}
    table = format_table(d)
    assert "  x 3 requests      0.1200  (0.04 ms each)" in table and "  x 1 prefills      0.3000" in table
    assert any(n.startswith("overhead: 0.8 ms per step + 0.04 ms per request + 0.3 ms per prefill") for n in m.notes)
