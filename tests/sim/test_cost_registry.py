"""Cost models are plug-ins of the `cost` group (conf/cost/<name>.yaml, varlen/registry.py): each
is built the same way from the simulator's `cost` section, a user's own one is its module (and a
yaml, or its dotted path), and a setting is never silently dropped."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sim.cost.base import CostModel
from sim.cost.fitted import ProfiledCostModel
from sim.cost.hardware import HardwareSpec
from sim.cost.registry import build_cost_model
from varlen import registry

H100 = HardwareSpec.load("h100_sxm")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)


def _options(name: str, tmp_path: Path) -> dict:
    """What each shipped model needs beyond its name (a file for the fitted and replay ones)."""
    if name == "profiled":
        path = tmp_path / "fit.json"
        ProfiledCostModel(coef={"const": 1e-3, "new_tokens": 1e-6}).save(path)
        return {"path": str(path)}
    if name == "replay":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([0.25, 0.5]))
        return {"path": str(path)}
    return {}


@pytest.mark.parametrize("name", registry.names("cost"))
def test_every_named_cost_model_builds_from_the_cost_section(name: str, tmp_path: Path) -> None:
    m = build_cost_model({"model": name, **_options(name, tmp_path), "profiles": None}, LLAMA3_8B, H100, None)
    assert type(m) is registry.target("cost", name)
    assert m.step_time([8, 1], [0, 40]) > 0
    # A setting the model does not read is an error naming it, never ignored.
    stray = {"path": "x.json"} if name in ("roofline", "measured") else {"profiles": "/tmp"}
    with pytest.raises(ValueError, match=rf"^cost\.{next(iter(stray))}=.* is not a setting of cost\.model={name} "):
        build_cost_model({"model": name, **_options(name, tmp_path), **stray}, LLAMA3_8B, H100, None)


def test_the_names_are_the_yaml_files_and_nothing_else() -> None:
    assert registry.names("cost") == ["measured", "profiled", "replay", "roofline"]
    with pytest.raises(ValueError, match="unknown cost 'oracle'; choose one of measured, profiled, replay, roofline"):
        build_cost_model({"model": "oracle"}, "tiny", H100)
    assert type(build_cost_model({}, "tiny", H100)).__name__ == "RooflineCostModel"  # the default


@pytest.mark.parametrize("name,why", [("profiled", "needs cost.path"), ("replay", "needs cost.path")])
def test_file_models_say_what_file_they_need(name: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"cost.model={name} {why}"):
        build_cost_model({"model": name}, "tiny", H100)
    with pytest.raises(ValueError, match="is not a file"):
        build_cost_model({"model": name, "path": str(tmp_path)}, "tiny", H100)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"is not .* for cost.model={name}"):
        build_cost_model({"model": name, "path": str(tmp_path / "bad.json")}, "tiny", H100)


USER_MODULE = """
from sim.cost.base import CostModel


class FlatCost(CostModel):
    '''A user's cost model: `seconds` per step, times 2 on hardware with more than 100 TFLOPS.'''

    def __init__(self, hardware, seconds: float = 0.01):
        self.seconds = seconds * (2 if hardware.peak_tflops > 100 else 1)

    def step_time(self, new_tokens, cached_tokens, num_logits=None):
        return self.seconds


class NotACostModel:
    pass
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_costs.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_costs"


def test_a_users_cost_model_is_one_module_named_by_its_dotted_path(user_module: str) -> None:
    m = build_cost_model({"model": f"{user_module}.FlatCost", "seconds": 0.5}, "tiny", H100)
    assert isinstance(m, CostModel) and m.step_time([1], [0]) == 1.0  # hardware given, option passed
    assert build_cost_model({"model": f"{user_module}.FlatCost"}, "tiny", "cpu_2core").step_time([1], [0]) == 0.01
    with pytest.raises(ValueError, match=r"cost\.bogus=3 is not a setting of cost\.model=my_costs\.FlatCost "
                                         r"\(its settings: cost\.seconds\)"):
        build_cost_model({"model": f"{user_module}.FlatCost", "bogus": 3}, "tiny", H100)
    with pytest.raises(ValueError, match="times one GPU; parallel.tensor=2"):
        build_cost_model({"model": f"{user_module}.FlatCost"}, "tiny", H100, {"tensor": 2})
    with pytest.raises(ValueError, match="my_costs.NotACostModel is not a cost model"):
        build_cost_model({"model": f"{user_module}.NotACostModel"}, "tiny", H100)
    with pytest.raises(ValueError, match="cannot import 'my_costs.Nope'"):
        build_cost_model({"model": f"{user_module}.Nope"}, "tiny", H100)


def test_sim_run_times_steps_with_a_users_cost_model(user_module: str) -> None:
    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["sim_model=tiny", "hardware=cpu_2core", "workload.limit=5",
                                        "output.requests=false", f"cost.model={user_module}.FlatCost",
                                        "+cost.seconds=0.125"])
    res, row = simulate_config(cfg)
    assert row["finished"] == 5
    assert row["cost_model"] == f"{user_module}.FlatCost"
    assert row["tpot_p50"] == pytest.approx(0.125)  # every step took the model's 0.125 s
    assert row["ttft_p50"] >= 0.125
