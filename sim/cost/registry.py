"""Cost models by name (conf/cost/<name>.yaml's `_target_`, or a class's dotted path), each built
by `cls.from_config(options, model_config, hardware, parallel)` from the yaml's keys and `cost.*`."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf

from sim.cost.base import CostModel
from varlen import registry


def build_cost_model(cost: Mapping[str, Any], model_config: Any, hardware: Any,
                     parallel: Mapping[str, Any] | Any | None = None) -> CostModel:
    """The cost model `cost.model` names (default roofline) for this model, hardware and
    parallelism; ValueError in one line for a bad name, setting or split."""
    return cost_model_factory(cost, model_config, hardware, parallel)()


def shareable(model: CostModel) -> bool:
    """Whether one object of this cost model may serve every replica of a run: a shipped model whose
    figures come from what its constructor computed alone (no state a run changes, as a replay's
    position in its timeline). Exact classes: a subclass may add state."""
    from sim.cost.communication import CommunicationCostModel
    from sim.cost.roofline import RooflineCostModel
    from sim.cost.scaled import ScaledCostModel

    if type(model) in (CommunicationCostModel, ScaledCostModel):
        return shareable(model.inner)
    return type(model) is RooflineCostModel


def cost_model_factory(cost: Mapping[str, Any], model_config: Any, hardware: Any,
                       parallel: Mapping[str, Any] | Any | None = None) -> Callable[[], CostModel]:
    """build_cost_model's arguments checked and resolved once, as a maker of each replica's cost
    model: the one object where `shareable`, else a new one per call from the same settings.
    `cost.time_scale` (any model with a step formula) multiplies every step's time (sim/cost/scaled.py)."""
    from sim.cost.hardware import HardwareSpec, ModelShape, load_model_config
    from sim.cost.scaled import ScaledCostModel, check_time_scale
    from sim.parallel import Parallelism

    options = {k: v for k, v in dict(cost).items() if v is not None}
    name = options.pop("model", None) or "roofline"
    scale = options.pop("time_scale", None)
    if scale is not None:
        scale = check_time_scale(scale)
    try:
        spec = registry.spec("cost", name)
        cls = registry.target("cost", spec)
    except ValueError as e:
        raise ValueError(f"cost.model={name}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, CostModel)):
        raise ValueError(f"cost.model={name}: {spec._target_} is not a cost model (a subclass of "
                         f"sim.cost.base.CostModel)")
    defaults = OmegaConf.to_container(spec, resolve=True)
    assert isinstance(defaults, dict)
    options = {**{k: v for k, v in defaults.items() if k != "_target_" and v is not None}, **options}
    par = parallel if isinstance(parallel, Parallelism) else Parallelism.of(parallel)
    cfg = load_model_config(model_config)
    par.check(ModelShape.from_config(cfg))
    hw = HardwareSpec.coerce(hardware)
    shared: list[CostModel] = []

    def make() -> CostModel:
        if shared:
            return shared[0]
        model: CostModel = cls.from_config(copy.deepcopy(options), cfg, hw, par)
        if scale is not None:
            model = ScaledCostModel(model, scale)
        if shareable(model):
            shared.append(model)
        return model

    return make


def make_cost_model(name: str, **kwargs: Any) -> CostModel:
    """A cost model by name (conf/cost/) or dotted class path, from its constructor's keywords."""
    model: CostModel = registry.target("cost", name)(**kwargs)
    return model
