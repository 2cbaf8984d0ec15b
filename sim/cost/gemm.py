"""The layer's operators for a shape or TP degree not profiled on a GPU, predicted from every
table on it: GEMMs by achieved FLOP/s over their N x K, element-wise operators by row width."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Iterable

import numpy as np
from numpy.typing import ArrayLike

from sim.cost.hardware import ModelShape, expected_experts_touched
from sim.cost.profiles import (
    ELEMENTWISE, GEMMS, LAYER_OPS, PER_LAYER, ComputeTable, ModelKey, ProfileError, Profiles, interp_tokens,
)



#: Kernel widths (log2 units) weighing profiled shapes by distance; chosen by benchmarks/sim_profiles.py.
GEMM_BANDWIDTH = 2.5
GEMM_RIDGE = 1.0
ELEMENTWISE_BANDWIDTH = 0.6


def gemm_dims(key: ModelKey, head_dim: int, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each layer GEMM on one GPU of a TP group."""
    kv = max(key.kv_heads // tp, 1)  # fewer KV heads than GPUs: each GPU keeps a replica
    q = key.heads // tp
    up = (2 if key.gated else 1) * key.intermediate // tp
    return {"attn_pre_proj": ((q + 2 * kv) * head_dim, key.hidden),
            "attn_post_proj": (key.hidden, q * head_dim),
            "mlp_up_proj": (up, key.hidden),
            "mlp_down_proj": (key.hidden, key.intermediate // tp)}


def elementwise_widths(key: ModelKey, head_dim: int, tp: int) -> dict[str, int]:
    kv = max(key.kv_heads // tp, 1)
    return {"input_layernorm": key.hidden, "post_attention_layernorm": key.hidden, "add": key.hidden,
            "emb": key.hidden, "attn_rope": (key.heads // tp + kv) * head_dim, "mlp_act": key.intermediate // tp}


class GpuOperatorModel:
    """Operator times on one GPU for any shape, learnt from its tables: a GEMM by a blend of a local
    linear fit of log FLOP/s in (log2 N, log2 K) and an affine cost in N x K; element-wise by width."""

    def __init__(self, gpu: str, tables: list[ComputeTable]):
        if not tables:
            raise ProfileError(f"no compute tables for GPU {gpu!r}")
        self.gpu = gpu
        self.tables = tables
        g_nk, g_dims, g_curves, g_src = [], [], [], []
        e_curves: dict[str, list[tuple[float, np.ndarray, np.ndarray, ModelKey]]] = {op: [] for op in ELEMENTWISE}
        for t in tables:
            hd = t.key.head_dim
            for tp, (tokens, times) in t.by_tp.items():
                for op, (n, k) in gemm_dims(t.key, hd, tp).items():
                    g_nk.append((math.log2(n), math.log2(k)))
                    g_dims.append((n, k))
                    g_src.append((t.key, tp, op))
                    g_curves.append((tokens, np.log(2.0 * tokens * n * k / (times[op] * 1e-3))))
                for op, w in elementwise_widths(t.key, hd, tp).items():
                    if op in times:
                        e_curves[op].append((float(w), tokens, times[op], t.key))
        self._g_nk = np.array(g_nk)
        self._g_dims = g_dims
        self._g_src = g_src
        # Every profiled M up to the largest all tables reach; past it, time is linear in M.
        top = min(float(c[0][-1]) for c in g_curves)
        grid = np.unique(np.concatenate([c[0] for c in g_curves]))
        self._g_grid = grid[grid <= top]
        self._g_logeff = np.array([np.interp(np.log(self._g_grid), np.log(tok), le) for tok, le in g_curves])
        self._e_curves = e_curves
        self._res: dict[tuple[ModelKey, str], tuple[np.ndarray, np.ndarray]] = {}

    def _fit_logeff(self, n: int, k: int) -> np.ndarray:
        """log FLOP/s of an N x K GEMM on the grid of rows."""
        lam = self.affine_weight
        local = self._local_logeff(n, k)
        return local if lam == 0.0 else lam * self._affine_logeff(n, k) + (1.0 - lam) * local

    def _local_logeff(self, n: int, k: int) -> np.ndarray:
        # A local linear fit follows the trend past the largest profiled GEMM; the ridge keeps slopes sane.
        x = self._g_nk - np.array([math.log2(n), math.log2(k)])
        w = np.exp(-(x ** 2).sum(axis=1) / (2 * GEMM_BANDWIDTH ** 2)) + 1e-300
        X = np.c_[np.ones(len(x)), x]
        A = X.T @ (w[:, None] * X) + GEMM_RIDGE * w.sum() * np.diag([0.0, 1.0, 1.0])
        return np.linalg.solve(A, X.T @ (w[:, None] * self._g_logeff))[0]

    @functools.cached_property
    def _affine(self) -> tuple[np.ndarray, np.ndarray]:
        """time / (2 M) = c0 + c1 x N K at each M, relative least squares, c0, c1 >= 0."""
        nk = np.array([n * k for n, k in self._g_dims], dtype=np.float64)
        t = nk[:, None] / np.exp(self._g_logeff)
        u, v = 1.0 / t, nk[:, None] / t
        su, sv = u.mean(axis=0), v.mean(axis=0)
        u, v = u / su, v / sv
        uu, uv, vv = (u * u).sum(0), (u * v).sum(0), (v * v).sum(0)
        ru, rv = u.sum(0), v.sum(0)
        det = uu * vv - uv * uv
        ok = det > 1e-9 * uu * vv
        c0 = np.where(ok, (ru * vv - rv * uv) / np.where(ok, det, 1.0), 0.0)
        c1 = np.where(ok, (rv * uu - ru * uv) / np.where(ok, det, 1.0), rv / vv)
        c1 = np.where(c0 < 0, rv / vv, c1)  # no fixed cost fits better than a negative one
        c0 = np.maximum(c0, 0.0)
        c0 = np.where(c1 < 0, ru / uu, c0)
        c1 = np.maximum(c1, 0.0)
        return c0 / su, c1 / sv

    def _affine_logeff(self, n: int, k: int) -> np.ndarray:
        c0, c1 = self._affine
        return np.log(n * k / (c0 + c1 * (n * k)))

    @functools.cached_property
    def affine_weight(self) -> float:
        """The affine fit's share, fitted leaving each shape out in turn, within [0, 1]."""
        keys = {t.key for t in self.tables}
        num = den = 0.0
        for key in keys if len(keys) > 1 else ():
            rest = GpuOperatorModel(self.gpu, [t for t in self.tables if t.key != key])
            for t in self.tables:
                if t.key != key:
                    continue
                for tp, (tok, times) in t.by_tp.items():
                    for op, (n, k) in gemm_dims(key, key.head_dim, tp).items():
                        got = np.interp(np.log(rest._g_grid), np.log(tok), np.log(2.0 * tok * n * k / (times[op] * 1e-3)))
                        local = rest._local_logeff(n, k)
                        d = rest._affine_logeff(n, k) - local
                        num += float((got - local) @ d)
                        den += float(d @ d)
        return min(max(num / den, 0.0), 1.0) if den > 0 else 0.0

    def _ms(self, m: ArrayLike, n: int, k: int, logeff: np.ndarray) -> np.ndarray:
        m = np.maximum(np.asarray(m, dtype=np.float64), 1.0)
        eff = np.exp(np.interp(np.log(m), np.log(self._g_grid), logeff))
        return 2.0 * m * n * k / eff * 1e3

    def gemm_ms(self, m: ArrayLike, n: int, k: int) -> np.ndarray:
        return self._ms(m, n, k, self._fit_logeff(n, k))

    def siblings(self, key: ModelKey) -> list[int]:
        return sorted({tp for kk, tp, _ in self._g_src if kk == key})

    def _residuals(self, key: ModelKey, op: str) -> tuple[np.ndarray, np.ndarray]:
        """This shape's shards of one GEMM: log2(N x K) ascending and their log FLOP/s minus the fit's."""
        if (key, op) not in self._res:
            by_tp: dict[int, list[int]] = {}
            for i, (kk, tp, o) in enumerate(self._g_src):
                if kk == key and o == op:
                    by_tp.setdefault(tp, []).append(i)
            shards = sorted((self._g_nk[rows[0]].sum(), rows) for rows in by_tp.values())
            xs = np.array([x for x, _ in shards])
            ys = np.array([self._g_logeff[rows].mean(axis=0) - self._fit_logeff(*self._g_dims[rows[0]])
                           for _, rows in shards]).reshape(len(shards), len(self._g_grid))
            self._res[(key, op)] = (xs, ys)
        return self._res[(key, op)]

    @staticmethod
    def _carry(xs: np.ndarray, ys: np.ndarray, x: float) -> np.ndarray:
        """The residual at log2(N x K) = x, linear between shards, the nearest one's beyond."""
        j = int(np.searchsorted(xs, x))
        if j == 0 or j == len(xs):
            return ys[min(j, len(xs) - 1)]
        f = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
        return (1 - f) * ys[j - 1] + f * ys[j]

    @functools.cached_property
    def sibling_weight(self) -> float:
        """The share of the siblings' residual carried over (leave-one-out, within [0, 1])."""
        num = den = 0.0
        for key in {kk for kk, _, _ in self._g_src}:
            for op in GEMMS:
                xs, ys = self._residuals(key, op)
                for j in range(len(xs) if len(xs) > 1 else 0):
                    pred = self._carry(np.delete(xs, j), np.delete(ys, j, axis=0), xs[j])
                    num += float(ys[j] @ pred)
                    den += float(pred @ pred)
        return min(max(num / den, 0.0), 1.0) if den > 0 else 0.0

    def layer_gemm_ms(self, m: ArrayLike, key: ModelKey, head_dim: int, tp: int) -> dict[str, np.ndarray]:
        """The layer's GEMMs at a TP degree with no table: the fit plus its siblings' residual."""
        out = {}
        for op, (n, k) in gemm_dims(key, head_dim, tp).items():
            logeff = self._fit_logeff(n, k)
            xs, ys = self._residuals(key, op)
            if len(xs):
                logeff = logeff + self.sibling_weight * self._carry(xs, ys, math.log2(n) + math.log2(k))
            out[op] = self._ms(m, n, k, logeff)
        return out

    def elementwise_ms(self, op: str, m: ArrayLike, width: int, key: ModelKey | None = None) -> np.ndarray:
        m = np.maximum(np.asarray(m, dtype=np.float64), 1.0)
        curves = self._e_curves[op]
        # Unsharded rows (norms, adds, embedding): other TP degrees timed the very same kernel.
        same = [c for c in curves if c[3] == key and c[0] == width]
        if same:
            return np.exp(np.mean([np.log(interp_tokens(tok, ms, m)) for _, tok, ms, _ in same], axis=0))
        logw = np.array([math.log2(c[0]) for c in curves])
        w = np.exp(-(logw - math.log2(width)) ** 2 / (2 * ELEMENTWISE_BANDWIDTH ** 2)) + 1e-300
        logs = np.array([np.log(interp_tokens(tok, ms, m * width / cw)) for cw, tok, ms, _ in curves])
        return np.exp((w @ logs) / w.sum())


#: Hidden from a prediction (validation): a shape at every TP degree, or at one.
Held = ModelKey | tuple[ModelKey, int]


def _is_held(exclude: Iterable[Held], key: ModelKey, tp: int) -> bool:
    return any(h == key or h == (key, tp) for h in exclude)


@functools.lru_cache(maxsize=16)
def _operator_model(profiles: Profiles, gpu: str, exclude: frozenset[Held] = frozenset()) -> GpuOperatorModel:
    tables = []
    for t in profiles.compute(gpu):
        by_tp = {tp: v for tp, v in t.by_tp.items() if not _is_held(exclude, t.key, tp)}
        if by_tp:
            tables.append(t if len(by_tp) == len(t.by_tp) else replace(t, by_tp=by_tp))
    return GpuOperatorModel(gpu, tables)


def _exact(profiles: Profiles, gpu: str, key: ModelKey, tp: int, tokens: np.ndarray,
           vocab: int | None, exclude: Iterable[Held] = ()) -> tuple[dict[str, np.ndarray], str] | None:
    """The operators from a table of this shape and TP degree on this GPU (same vocabulary first)."""
    for t in sorted(profiles.compute(gpu), key=lambda t: t.vocab != vocab):  # stable: root order kept
        if t.key == key and tp in t.by_tp and not _is_held(exclude, key, tp):
            tok, times = t.by_tp[tp]
            out = {op: np.zeros_like(tokens) for op in (*LAYER_OPS, "emb")}
            out.update({op: interp_tokens(tok, ms, tokens) for op, ms in times.items()})
            return out, f"{gpu}/{t.name} TP{tp}"
    return None


def layer_op_ms(profiles: Profiles, gpu: str, key: ModelKey, head_dim: int, tp: int, tokens: np.ndarray,
                exclude: tuple[Held, ...] = (), vocab: int | None = None) -> tuple[dict[str, np.ndarray], str]:
    """ms per layer of each non-attention operator at these token counts, and their source (this
    shape's table, else predicted); `exclude`: tables hidden for validation."""
    hit = _exact(profiles, gpu, key, tp, tokens, vocab, exclude)
    if hit is not None:
        return hit[0], f"measured: {hit[1]}"
    om = _operator_model(profiles, gpu, frozenset(exclude))
    out = om.layer_gemm_ms(tokens, key, head_dim, tp)
    for op, w in elementwise_widths(key, head_dim, tp).items():
        out[op] = om.elementwise_ms(op, tokens, w, key)
    sib = om.siblings(key)
    incl = f" incl. this shape at TP {', '.join(map(str, sib))}" if sib else ""
    return out, f"predicted from GEMM shapes on {gpu}{incl} (no table for this shape at TP{tp})"


#: The operators of a layer's MLP: an expert layer runs them once per touched expert.
MLP_OPS = ("mlp_up_proj", "mlp_act", "mlp_down_proj")


def moe_layer_ms(profiles: Profiles, gpu: str, shape: ModelShape, tp: int, tokens: np.ndarray,
                 router_ms: np.ndarray, exclude: tuple[Held, ...] = (), vocab: int | None = None) -> tuple[np.ndarray, str]:
    """ms of one expert layer at these token counts: its projections and norms as a dense layer's; its
    routed experts as the experts the tokens touch in expectation (uniform routing), each one expert's
    MLP (a dense MLP of the expert's width: a table of that shape, else predicted) at its share of the
    rows (tokens x top-k / touched); the shared experts as one MLP of their summed width over every
    token; the router `router_ms` (a hidden x experts GEMM no table holds)."""
    def key(width: int) -> ModelKey:
        return ModelKey(shape.heads, shape.kv_heads, shape.hidden, width, shape.gated, shape.head_dim)

    ops, source = layer_op_ms(profiles, gpu, key(shape.expert_intermediate), shape.head_dim, tp, tokens, exclude, vocab)
    out = np.sum([PER_LAYER[op] * ops[op] for op in LAYER_OPS if op not in MLP_OPS], axis=0)
    touched = expected_experts_touched(tokens, shape.experts, shape.experts_per_token)
    rows = tokens * shape.experts_per_token / np.maximum(touched, 1e-300)
    out = out + touched * np.sum([np.interp(rows, tokens, ops[op]) for op in MLP_OPS], axis=0)
    shared = ""
    if shape.shared_intermediate:
        s_ops, s_source = layer_op_ms(profiles, gpu, key(shape.shared_intermediate), shape.head_dim, tp, tokens,
                                      exclude, vocab)
        out = out + np.sum([s_ops[op] for op in MLP_OPS], axis=0)
        shared = f"; shared experts (width {shape.shared_intermediate}) {s_source}"
    return out + router_ms, (f"mixture of experts: {shape.experts_per_token} of {shape.experts} experts per token, "
                             f"the touched experts' MLPs at their share of the rows (uniform routing), one expert's "
                             f"{source}{shared}; router: roofline (no table holds an N={shape.experts} GEMM)")
