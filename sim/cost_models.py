"""Former home of the cost models: importing it fails in one line naming where each name lives."""

raise ImportError(
    "sim.cost_models is gone; import from sim.cost.base (CostModel, StepFixed, StepSums), sim.cost.roofline "
    "(RooflineCostModel), sim.cost.measured (MeasuredCostModel), sim.cost.fitted (ProfiledCostModel, "
    "profile_rows), sim.cost.replay (ReplayCostModel), sim.cost.hardware (HardwareSpec, ModelShape) or "
    "sim.cost.registry (build_cost_model, make_cost_model)")
