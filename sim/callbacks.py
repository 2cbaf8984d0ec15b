"""Hydra callbacks of `python -m sim.run`: a sweep ends with its report written. Apart from
sim.report so that a single simulation never imports matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepReport(Callback):
    """After the last job of a multirun: `python -m sim.report <sweep dir>`, printed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from sim.report import main

        sweep_dir = Path(config.hydra.sweep.dir)
        if any(sweep_dir.rglob("summary.json")):  # nothing to gather if every job failed
            main([str(sweep_dir)])


class CapacityTable(Callback):
    """After the last job of a `sim.capacity -m` sweep: `python -m varlen.compare <sweep dir>` with
    each mode's figure (capacity.mode=rate: the capacity; slo_scale: the scale and its rate), what
    bound it and the criterion, printed (a sim.run sweep holds neither file: SweepReport reports it)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from varlen.compare import main

        sweep_dir = Path(config.hydra.sweep.dir)
        modes = [mode for mode, file in MODE_FILES.items() if any(sweep_dir.rglob(file))]
        if not modes:  # nothing to compare if every job failed
            return
        print(f"\ncapacity sweep {sweep_dir}" + (" (capacity.mode=slo_scale)" if modes == ["slo_scale"] else "") + ":")
        if len(modes) > 1:
            print("this sweep mixes capacity.mode=rate and capacity.mode=slo_scale runs: a capacity (req/s) and an "
                  "SLO scale at a given rate are different figures; each run has only its own (NaN: n/a)")
        metrics = [m for mode in modes for m in MODE_METRICS[mode]] + ["bound_by", "criterion"]
        main([str(sweep_dir), "--metrics", ",".join(metrics)])


#: capacity.mode -> the file its runs write and the figures its table shows.
MODE_FILES = {"rate": "capacity.json", "slo_scale": "slo_scale.json"}
MODE_METRICS = {"rate": ["capacity_requests_per_s"], "slo_scale": ["slo_scale", "rate_requests_per_s"]}
