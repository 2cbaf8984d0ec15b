"""Attention's cost calibrated on sim.profile's attention tables, for the measured model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.cost.profiles import Profiles


@dataclass(frozen=True)
class AttentionCalibration:
    """One layer's attention = const + per_seq x requests + per_byte x bytes + per_flop x FLOPs of causal
    query-key pairs, fitted (non-negative, relative error) to sim.profile's attention tables. A backend with
    a second path for long prompts (long_query_min > 0: torch_paged's SDPA from 64 new tokens) has that
    path's own terms: after a cached context, per_rect_flop x FLOPs of the request's whole n x (cached + n)
    rectangle (SDPA with a mask computes the masked half too) + per_gathered x its cached + n keys (gathered
    from the paged cache into one block); a fresh prompt (plain causal), per_fresh_flop
    x FLOPs of its causal pairs; per_long per such request. per_flop is then the kernel's alone."""

    const: float
    per_seq: float
    per_byte: float
    per_flop: float
    cases: int
    source: str
    long_query_min: int = 0
    per_rect_flop: float = 0.0
    per_long: float = 0.0
    per_fresh_flop: float = 0.0
    per_gathered: float = 0.0


def calibrate_attention(profiles: Profiles, gpu: str) -> AttentionCalibration | None:
    from sim.cost.fitted import _nnls

    cases, names, splits = [], [], set()
    for path, c in profiles.attention(gpu):
        names.append(str(path.parent.relative_to(path.parents[2])))
        split = c.get("long_query_min", np.zeros_like(c["batch_size"]))
        for i in range(len(c["batch_size"])):
            cases.append((c["batch_size"][i], c["new_tokens"][i], c["cached_tokens"][i], c["n_head"][i] * c["head_dim"][i],
                          c["n_kv_head"][i] * c["head_dim"][i], c["dtype_bytes"][i], c["time_stats.attention.median"][i]))
            splits.add(int(split[i]))
    if len(cases) < 4:
        return None
    # Two paths only where every table is of one backend with the same long-prompt threshold.
    long_min = next(iter(splits)) if len(splits) == 1 else 0
    X, y = [], []
    for b, n, cached, q_dim, kv_dim, d, ms in cases:
        nbytes = 2 * kv_dim * d * b * (cached + 2 * n) + 2 * q_dim * d * b * n
        long = 0 < long_min <= n
        pairs = b * (n * cached + n * (n + 1) / 2)
        rect = b * n * (cached + n) if long and cached > 0 else 0.0
        fresh = pairs if long and cached == 0 else 0.0
        X.append([1.0, b, nbytes, 4 * q_dim * (0.0 if long else pairs)]
                 + ([4 * q_dim * rect, b if long else 0.0, 4 * q_dim * fresh, b * (cached + n) if rect else 0.0]
                    if long_min else []))
        y.append(ms * 1e-3)
    A, t = np.array(X), np.array(y)
    A, t = A / t[:, None], np.ones_like(t)  # relative error
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    coef = _nnls(A / norms, t) / norms
    extra = (long_min, *(float(x) for x in coef[4:])) if long_min else (0, 0.0, 0.0, 0.0, 0.0)
    return AttentionCalibration(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), cases=len(y),
                                source=", ".join(names), long_query_min=int(extra[0]), per_rect_flop=extra[1],
                                per_long=extra[2], per_fresh_flop=extra[3], per_gathered=extra[4])
