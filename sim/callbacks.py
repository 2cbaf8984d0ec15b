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
    """After the last job of a `sim.capacity -m` sweep: `python -m varlen.compare <sweep dir>`,
    printed (a sim.run sweep holds no capacity.json: SweepReport reports it instead)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from varlen.compare import main

        sweep_dir = Path(config.hydra.sweep.dir)
        if any(sweep_dir.rglob("capacity.json")):  # nothing to compare if every job failed
            print(f"\ncapacity sweep {sweep_dir}:")
            main([str(sweep_dir), "--metrics", "capacity_requests_per_s,bound_by"])
