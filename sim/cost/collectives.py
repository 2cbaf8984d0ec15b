"""Collective communication on one node (all-reduce, send/recv), from its tables or predicted
as a ring over send/recv: tensor and pipeline parallelism's cost."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from sim.cost.profiles import CollectiveTable, ProfileError, Profiles


def interp_size(size: np.ndarray, ms: np.ndarray, x: ArrayLike) -> np.ndarray:
    """Time vs bytes: log-log linear between profiled sizes, linear in bytes above the largest."""
    x = np.maximum(np.asarray(x, dtype=np.float64), 1.0)
    y = np.exp(np.interp(np.log(x), np.log(size), np.log(ms)))
    return np.where(x > size[-1], ms[-1] * x / size[-1], y)


class Collectives:
    """All-reduce and send/recv times on one node; without a table, a ring over send/recv (noted)."""

    def __init__(self, node: str | None, profiles: Profiles):
        self.node = node
        self._profiles = profiles
        self._tables: dict[str, CollectiveTable] | None = None
        self.notes: list[str] = []

    @property
    def tables(self) -> dict[str, CollectiveTable]:
        if self._tables is None:
            self._tables = self._profiles.network(self.node) if self.node else {}
        return self._tables

    @tables.setter
    def tables(self, value: dict[str, CollectiveTable]) -> None:
        self._tables = value

    def _ring_params(self) -> tuple[float, float]:
        """(latency ms, ms per byte) of one point-to-point hop, fitted to send/recv on one node."""
        sr = self.tables.get("send_recv")
        if sr is None:
            raise ProfileError(f"node {self.node!r} has no send_recv table to predict collectives from "
                               f"(nodes with tables: see sim/profiles/README.md); set hardware.node")
        key = max(sr.curves, key=lambda k: (k[1], -k[0]))
        size, ms = sr.curves[key]
        slope, lat = np.polyfit(size, ms, 1)
        return max(float(lat), float(ms[0])), max(float(slope), 1e-15)

    def all_reduce_ms(self, nbytes: ArrayLike, workers: int) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if workers <= 1:
            return np.zeros_like(nbytes)
        ar = self.tables.get("all_reduce")
        if ar is not None:
            # One TP group on one node: devices_per_node == workers when profiled, else the most.
            cands = [k for k in ar.curves if k[0] == workers]
            if cands:
                key = max(cands, key=lambda k: (k[1] == workers, k[1]))
                return interp_size(*ar.curves[key], nbytes)
            # Another worker count: its curve scaled by the ring's bytes per GPU, 2 (n - 1) / n.
            inside = [k for k in ar.curves if k[0] == k[1]]
            if inside:
                near = min(inside, key=lambda k: (abs(math.log(k[0] / workers)), -k[0]))
                self._note(f"all-reduce over {workers} GPUs on {self.node}: predicted from its {near[0]}-GPU table")
                scale = (workers - 1) / workers * near[0] / (near[0] - 1)
                return interp_size(*ar.curves[near], nbytes) * scale
        lat, per_byte = self._ring_params()
        self._note(f"all-reduce over {workers} GPUs on {self.node}: predicted (ring over send/recv; no all-reduce table)")
        steps = 2 * (workers - 1)
        return steps * (lat + per_byte * nbytes / workers)

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def send_recv_ms(self, nbytes: ArrayLike, same_node: bool = True) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=np.float64)
        sr = self.tables.get("send_recv")
        if sr is None:
            raise ProfileError(f"node {self.node!r} has no send_recv table (pipeline parallelism times "
                               f"stage-to-stage transfers from it); set hardware.node")
        want = 2 if same_node else 1
        key = min(sr.curves, key=lambda k: (abs(k[1] - want), k[0]))
        return interp_size(*sr.curves[key], nbytes)

    def has_measured_all_reduce(self, workers: int) -> bool:
        ar = self.tables.get("all_reduce")
        return workers <= 1 or (ar is not None and any(k[0] == workers for k in ar.curves))

