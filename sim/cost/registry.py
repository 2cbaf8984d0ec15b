"""Cost models by name (the API's counterpart of conf/cost; sim.run builds them from a config)."""

from __future__ import annotations

from typing import Any

from sim.cost.base import CostModel
from sim.cost.fitted import ProfiledCostModel
from sim.cost.replay import ReplayCostModel
from sim.cost.roofline import RooflineCostModel

COST_MODELS: dict[str, type[CostModel]] = {
    "roofline": RooflineCostModel,
    "profiled": ProfiledCostModel,
    "replay": ReplayCostModel,
}


def make_cost_model(name: str, **kwargs: Any) -> CostModel:
    """Build a cost model by name: roofline, profiled, replay (kwargs go to its constructor)."""
    try:
        cls = COST_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r} (known: {', '.join(COST_MODELS)})") from None
    return cls(**kwargs)
