"""Attention's cost calibrated on sim.profile's attention tables, for the measured model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.cost.profiles import Profiles


@dataclass(frozen=True)
class AttentionCalibration:
    """One layer's attention = const + per_seq x requests + per_byte x bytes + per_flop x FLOPs,
    fitted (non-negative, relative error) to sim.profile's attention tables."""

    const: float
    per_seq: float
    per_byte: float
    per_flop: float
    cases: int
    source: str


def calibrate_attention(profiles: Profiles, gpu: str) -> AttentionCalibration | None:
    from sim.cost.fitted import _nnls

    X, y, names = [], [], []
    for path, c in profiles.attention(gpu):
        names.append(str(path.parent.relative_to(path.parents[2])))
        for i in range(len(c["batch_size"])):
            b, n, cached = c["batch_size"][i], c["new_tokens"][i], c["cached_tokens"][i]
            q_dim, kv_dim, d = c["n_head"][i] * c["head_dim"][i], c["n_kv_head"][i] * c["head_dim"][i], c["dtype_bytes"][i]
            pairs = b * (n * cached + n * (n + 1) / 2)
            nbytes = 2 * kv_dim * d * b * (cached + 2 * n) + 2 * q_dim * d * b * n
            X.append([1.0, b, nbytes, 4 * q_dim * pairs])
            y.append(c["time_stats.attention.median"][i] * 1e-3)
    if len(y) < 4:
        return None
    A, t = np.array(X), np.array(y)
    A, t = A / t[:, None], np.ones_like(t)  # relative error
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    coef = _nnls(A / norms, t) / norms
    return AttentionCalibration(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), cases=len(y),
                                source=", ".join(names))
