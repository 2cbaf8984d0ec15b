"""The cost models' former single module, kept so that code written against it still imports:
they live in the sim.cost package now (one module per model). New code imports from there."""

from sim.cost.base import CostModel, StepFixed, StepSums, _as_arrays, attention_pairs
from sim.cost.fitted import (
    DEFAULT_FEATURES, FEATURES, FitReport, ProfiledCostModel, Step, _nnls, _nnls_numpy, profile_rows,
)
from sim.cost.hardware import HardwareSpec, ModelShape, hardware_dir, load_model_config
from sim.cost.registry import build_cost_model, make_cost_model
from sim.cost.replay import ReplayCostModel
from sim.cost.roofline import RooflineCostModel, StepEstimate

__all__ = ["DEFAULT_FEATURES", "FEATURES", "CostModel", "FitReport", "HardwareSpec", "ModelShape",
           "ProfiledCostModel", "ReplayCostModel", "RooflineCostModel", "Step", "StepEstimate", "StepFixed",
           "StepSums", "_as_arrays", "_nnls", "_nnls_numpy", "attention_pairs", "build_cost_model", "hardware_dir",
           "load_model_config", "make_cost_model", "profile_rows"]
