"""The measured operator tables (sim/profiles/, or a user's folder of the same layout): reading
them, interpolating them, and predicting from them what they do not hold (shapes, TP degrees and
collectives not profiled), for the measured cost model (sim/cost/measured.py) and
benchmarks/sim_profiles.py. Torch-free and pandas-free (the simulator starts fast); the tables
are read once per process."""

from __future__ import annotations

import csv
import functools
import gzip
import io
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike

from sim.cost.hardware import HardwareSpec, ModelShape

def _shipped() -> Path:
    import sim  # from the package, not this file: compiled, a module's file is in the build cache

    return Path(sim.__file__).resolve().parent / "profiles" / "vidur"


SHIPPED = _shipped()

# The per-layer operators of a table, and how many times a layer runs each (two residual adds).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")
PER_LAYER = {op: (2 if op == "add" else 1) for op in LAYER_OPS}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
NON_GATED = ("phi", "gpt2", "gpt_neox", "opt", "falcon", "bloom", "gpt_bigcode")
ATTENTION_COLUMNS = ("batch_size", "new_tokens", "cached_tokens", "n_head", "n_kv_head", "head_dim", "dtype_bytes",
                     "time_stats.attention.median")
# Tokens per step the precomputed per-token tables cover; beyond, time scales with the tokens.
GRID_TOKENS = 16384
HEAD_ROWS = 4096


class ProfileError(ValueError):
    """A profile folder or table that cannot serve a request (missing GPU, bad table)."""


# ---------------------------------------------------------------------------------------------
# Reading the tables


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rows = list(csv.reader(io.StringIO(raw.decode())))
    if not rows:
        raise ProfileError(f"{path}: empty table")
    return rows[0], rows[1:]


def _columns(path: Path, header: list[str], rows: list[list[str]], names: Iterable[str]) -> dict[str, np.ndarray]:
    idx = {h: i for i, h in enumerate(header)}
    missing = [n for n in names if n not in idx]
    if missing:
        raise ProfileError(f"{path}: missing columns {missing}")
    out = {}
    for n in names:
        col = [r[idx[n]] for r in rows]
        if n == "use_gated_mlp":
            out[n] = np.array([v.strip().lower() == "true" for v in col])
        else:
            out[n] = np.array(col, dtype=np.float64)
    return out


@dataclass(frozen=True)
class ModelKey:
    """The shape a compute table was profiled for (what a model config is matched on)."""

    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    gated: bool
    head_dim: int

    @classmethod
    def of(cls, shape: ModelShape, gated: bool) -> ModelKey:
        return cls(shape.heads, shape.kv_heads, shape.hidden, shape.intermediate, gated, shape.head_dim)


@dataclass
class ComputeTable:
    """One model's operator timings on one GPU: per TP degree, tokens -> ms per layer per op."""

    gpu: str
    name: str  # <org>/<model>
    path: Path
    key: ModelKey
    vocab: int
    by_tp: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]  # tp -> (tokens, {op: ms})

    def ops(self, tp: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.by_tp[tp]


def read_compute_table(path: Path, gpu: str, name: str) -> ComputeTable:
    header, rows = _read_csv(path)
    # The GEMMs are required; a model without some other operator (phi-2 has one layernorm per
    # layer) lacks its column, and its layers do not pay for it.
    ops = tuple(op for op in (*LAYER_OPS, "emb") if op in GEMMS or f"time_stats.{op}.median" in header)
    cols = _columns(path, header, rows, [*SHAPE_COLUMNS, "num_tokens", "num_tensor_parallel_workers",
                                         *(f"time_stats.{op}.median" for op in ops)])
    shapes = {tuple(cols[c][i] for c in SHAPE_COLUMNS) for i in range(len(rows))}
    if len(shapes) != 1:
        raise ProfileError(f"{path}: {len(shapes)} model shapes in one table")
    h, kv, e, x, vocab, gated = next(iter(shapes))
    by_tp: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    for tp in sorted({int(v) for v in cols["num_tensor_parallel_workers"]}):
        sel = cols["num_tensor_parallel_workers"] == tp
        # A token count profiled twice (the shipped tables repeat 2048 and 4096): the mean.
        tokens, inv = np.unique(cols["num_tokens"][sel], return_inverse=True)
        if tokens[0] < 1:
            raise ProfileError(f"{path}: TP {tp}: num_tokens must be >= 1")
        counts = np.bincount(inv)
        times = {op: np.bincount(inv, cols[f"time_stats.{op}.median"][sel]) / counts for op in ops}
        for op, t in times.items():
            if not np.all(np.isfinite(t)) or np.any(t <= 0):
                raise ProfileError(f"{path}: TP {tp}: {op} has non-positive or missing times")
        by_tp[tp] = (tokens, times)
    # Vidur's tables have no head_dim column: theirs is n_embd / n_head. sim.profile writes one.
    hd = _columns(path, header, rows, ["head_dim"])["head_dim"][0] if "head_dim" in header else e // h
    key = ModelKey(int(h), int(kv), int(e), int(x), bool(gated), int(hd))
    return ComputeTable(gpu, name, path, key, int(vocab), by_tp)


@dataclass
class CollectiveTable:
    """One collective on one node: (num_workers, devices_per_node) -> (bytes, ms), sorted."""

    node: str
    kind: str  # all_reduce | send_recv
    path: Path
    curves: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
    max_devices_per_node: int


def read_collective_table(path: Path, node: str, kind: str) -> CollectiveTable:
    header, rows = _read_csv(path)
    cols = _columns(path, header, rows, ["num_workers", "devices_per_node", "size", "max_devices_per_node",
                                         f"time_stats.{kind}.median"])
    curves = {}
    pairs = {(int(w), int(d)) for w, d in zip(cols["num_workers"], cols["devices_per_node"])}
    for w, d in sorted(pairs):
        sel = (cols["num_workers"] == w) & (cols["devices_per_node"] == d)
        size, ms = cols["size"][sel], cols[f"time_stats.{kind}.median"][sel]
        order = np.argsort(size, kind="stable")
        size, ms = size[order], ms[order]
        if np.any(ms <= 0) or np.any(size <= 0):
            raise ProfileError(f"{path}: {w} workers: non-positive sizes or times")
        # A size profiled more than once (re-runs): the mean, as for compute tables.
        u, inv = np.unique(size, return_inverse=True)
        curves[(w, d)] = (u, np.bincount(inv, ms) / np.bincount(inv))
    return CollectiveTable(node, kind, path, curves, int(cols["max_devices_per_node"].max()))


def _table_file(folder: Path, stem: str) -> Path | None:
    for suffix in (".csv", ".csv.gz"):
        p = folder / f"{stem}{suffix}"
        if p.is_file():
            return p
    return None


class Profiles:
    """Every table under one or more profile folders (later folders override earlier ones for the
    same GPU and model shape, or node and collective); a table is read when first needed."""

    def __init__(self, roots: Iterable[Path]):
        self.roots = tuple(roots)
        self._compute_paths: dict[str, list[tuple[str, Path]]] = {}
        self._network_paths: dict[str, dict[str, Path]] = {}
        self._attention_paths: dict[str, list[Path]] = {}
        self._overhead_paths: dict[str, list[Path]] = {}
        self._compute: dict[str, list[ComputeTable]] = {}
        self._network: dict[str, dict[str, CollectiveTable]] = {}
        for r in self.roots:
            self._scan(r)

    def _scan(self, root: Path) -> None:
        if not root.is_dir():
            raise ProfileError(f"cost.profiles: {str(root)!r} is not a folder (expected "
                               f"compute/<gpu>/<org>/<model>/mlp.csv and/or network/<node>/all_reduce.csv)")
        comp = root / "compute"
        if comp.is_dir():
            for gpu_dir in sorted(p for p in comp.iterdir() if p.is_dir()):
                for f in sorted(gpu_dir.glob("*/*/mlp.csv*")):
                    if f.name in ("mlp.csv", "mlp.csv.gz"):
                        self._compute_paths.setdefault(gpu_dir.name, []).append(
                            (f"{f.parent.parent.name}/{f.parent.name}", f))
                for f in sorted(gpu_dir.glob("*/*/attention.csv*")):
                    if f.name in ("attention.csv", "attention.csv.gz"):
                        self._attention_paths.setdefault(gpu_dir.name, []).append(f)
                for f in sorted(gpu_dir.glob("*/*/overhead.csv")):
                    self._overhead_paths.setdefault(gpu_dir.name, []).append(f)
        net = root / "network"
        if net.is_dir():
            for node_dir in sorted(p for p in net.iterdir() if p.is_dir()):
                for kind in ("all_reduce", "send_recv"):
                    table = _table_file(node_dir, kind)
                    if table is not None:
                        self._network_paths.setdefault(node_dir.name, {})[kind] = table

    @property
    def gpus(self) -> list[str]:
        return sorted(self._compute_paths)

    @property
    def nodes(self) -> list[str]:
        return sorted(self._network_paths)

    def compute(self, gpu: str) -> list[ComputeTable]:
        if gpu not in self._compute:
            # A later root's tables first: a user's table wins over a shipped one of the same shape.
            by_root = [(i, name, path) for name, path in self._compute_paths.get(gpu, [])
                       for i, r in enumerate(self.roots) if path.is_relative_to(r)]
            self._compute[gpu] = [read_compute_table(path, gpu, name)
                                  for _, name, path in sorted(by_root, key=lambda x: -x[0])]
        return self._compute[gpu]

    def attention(self, gpu: str) -> list[tuple[Path, dict[str, np.ndarray]]]:
        """sim.profile's attention tables on this GPU: (path, columns)."""
        out = []
        for path in self._attention_paths.get(gpu, []):
            header, rows = _read_csv(path)
            out.append((path, _columns(path, header, rows, ATTENTION_COLUMNS)))
        return out

    def engine_overhead(self, gpu: str) -> tuple[str, dict[str, float]] | None:
        """sim.profile's fitted per-step engine cost on this device (the last one found)."""
        paths = self._overhead_paths.get(gpu, [])
        if not paths:
            return None
        path = paths[-1]
        header, rows = _read_csv(path)
        cols = _columns(path, header, rows, ["const_ms", "per_seq_ms", "per_prefill_ms"])
        return str(path.parent.relative_to(path.parents[2])), {k: float(v[0]) for k, v in cols.items()}

    def network(self, node: str) -> dict[str, CollectiveTable]:
        if node not in self._network:
            self._network[node] = {k: read_collective_table(p, node, k)
                                   for k, p in self._network_paths.get(node, {}).items()}
        return self._network[node]


def load_profiles(user: str | os.PathLike | None = None) -> Profiles:
    """The shipped tables, plus (overriding them) those under `user` (cost.profiles). Read once
    per process while the user's folder keeps the same files (each replica builds its model)."""
    if user is None:
        return _load((SHIPPED,), ())
    root = Path(user).expanduser().resolve()
    files = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*.csv*"))) \
        if root.is_dir() else ()
    return _load((SHIPPED, root), files)


@functools.lru_cache(maxsize=8)
def _load(roots: tuple[Path, ...], signature: tuple[Any, ...]) -> Profiles:
    return Profiles(roots)


# ---------------------------------------------------------------------------------------------
# Interpolation


def interp_tokens(tokens: np.ndarray, ms: np.ndarray, x: ArrayLike) -> np.ndarray:
    """Piecewise-linear in tokens (exact at profiled points); below the first point the first
    time (a kernel's floor), beyond the last the time per token of the last point."""
    x = np.asarray(x, dtype=np.float64)
    y = np.interp(x, tokens, ms)
    hi = x > tokens[-1]
    if np.any(hi):
        y = np.where(hi, ms[-1] * x / tokens[-1], y)
    return y


def interp_size(size: np.ndarray, ms: np.ndarray, x: ArrayLike) -> np.ndarray:
    """Collective time vs bytes: linear in log-log between profiled sizes (exact at them), the
    smallest size's time below, bandwidth-bound (linear in bytes) above the largest."""
    x = np.maximum(np.asarray(x, dtype=np.float64), 1.0)
    y = np.exp(np.interp(np.log(x), np.log(size), np.log(ms)))
    return np.where(x > size[-1], ms[-1] * x / size[-1], y)


# ---------------------------------------------------------------------------------------------
# Predicting operators of shapes not profiled on a GPU

#: Width (in log2 units of N and K, or of the row width) of the kernel that weighs profiled
#: shapes by their distance to the one predicted; chosen by benchmarks/sim_profiles.py.
GEMM_BANDWIDTH = 2.5
GEMM_RIDGE = 1.0
ELEMENTWISE_BANDWIDTH = 0.6


def gemm_dims(key: ModelKey, head_dim: int, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each layer GEMM on one GPU of a TP group (rows M = tokens)."""
    kv = max(key.kv_heads // tp, 1)  # fewer KV heads than GPUs: each GPU keeps a replica
    q = key.heads // tp
    up = (2 if key.gated else 1) * key.intermediate // tp
    return {"attn_pre_proj": ((q + 2 * kv) * head_dim, key.hidden),
            "attn_post_proj": (key.hidden, q * head_dim),
            "mlp_up_proj": (up, key.hidden),
            "mlp_down_proj": (key.hidden, key.intermediate // tp)}


def elementwise_widths(key: ModelKey, head_dim: int, tp: int) -> dict[str, int]:
    """Elements per token of each element-wise operator on one GPU."""
    kv = max(key.kv_heads // tp, 1)
    return {"input_layernorm": key.hidden, "post_attention_layernorm": key.hidden, "add": key.hidden,
            "emb": key.hidden, "attn_rope": (key.heads // tp + kv) * head_dim, "mlp_act": key.intermediate // tp}


class GpuOperatorModel:
    """Operator times on one GPU for any shape, learnt from the tables profiled on it.

    GEMMs: at each number of rows M, the achieved FLOP/s of every profiled GEMM (each model's
    four layer GEMMs at each TP degree: N x K from ~1k x 1k to ~57k x 8k); a new (N, K) gets a
    blend of a kernel-weighted local linear fit of their log FLOP/s in (log2 N, log2 K) and a
    fixed cost plus a throughput in N x K (`affine_weight`). Small M is weight-read bound, large
    M compute bound; the curves carry both, per GPU. A shape profiled at other TP degrees also
    carries their departure from that fit (`layer_gemm_ms`).
    Element-wise operators: the same shape's own at other TP degrees where the row is as wide,
    else the profiled times at the same number of elements (M x width), weighted by distance in
    log2 width.
    """

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
        self._g_src = g_src  # (shape, TP, operator) of each
        # Common grid of rows for the GEMM efficiencies: every profiled M up to the largest that
        # all tables reach; past it, efficiency stays at its last value (time linear in M).
        top = min(float(c[0][-1]) for c in g_curves)
        grid = np.unique(np.concatenate([c[0] for c in g_curves]))
        self._g_grid = grid[grid <= top]
        self._g_logeff = np.array([np.interp(np.log(self._g_grid), np.log(tok), le) for tok, le in g_curves])
        self._e_curves = e_curves
        self._res: dict[tuple[ModelKey, str], tuple[np.ndarray, np.ndarray]] = {}

    def _fit_logeff(self, n: int, k: int) -> np.ndarray:
        """log FLOP/s of an N x K GEMM on the grid of rows, from every profiled GEMM on this GPU:
        the local fit and the affine one, weighted by `affine_weight`."""
        lam = self.affine_weight
        local = self._local_logeff(n, k)
        return local if lam == 0.0 else lam * self._affine_logeff(n, k) + (1.0 - lam) * local

    def _local_logeff(self, n: int, k: int) -> np.ndarray:
        # Kernel-weighted local linear fit of log FLOP/s in (log2 N, log2 K) at every M of the grid
        # (a ridge keeps the slopes sane where few shapes are near): unlike a weighted mean it
        # follows the trend when asked for a larger GEMM than any profiled (70B on a GPU where
        # only 7B was timed).
        x = self._g_nk - np.array([math.log2(n), math.log2(k)])
        w = np.exp(-(x ** 2).sum(axis=1) / (2 * GEMM_BANDWIDTH ** 2)) + 1e-300
        X = np.c_[np.ones(len(x)), x]
        A = X.T @ (w[:, None] * X) + GEMM_RIDGE * w.sum() * np.diag([0.0, 1.0, 1.0])
        return np.linalg.solve(A, X.T @ (w[:, None] * self._g_logeff))[0]

    @functools.cached_property
    def _affine(self) -> tuple[np.ndarray, np.ndarray]:
        """At each M of the grid, time / (2 M) = c0 + c1 x N K: a fixed cost and a throughput,
        least squares in relative error over every profiled GEMM (c0, c1 >= 0)."""
        nk = np.array([n * k for n, k in self._g_dims], dtype=np.float64)
        t = nk[:, None] / np.exp(self._g_logeff)  # time / (2 M), per GEMM and M
        u, v = 1.0 / t, nk[:, None] / t  # each column scaled to ~1 before the 2 x 2 solve
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
        """How much of the affine fit to blend into the local one: the local fit extrapolates a
        trend in log FLOP/s (too slow for a GEMM larger than any profiled, too fast for a tiny
        one), the affine one saturates; each is off where the other holds. Fitted leaving each
        profiled shape out in turn and predicting its GEMMs from the others (least squares in log
        FLOP/s, within [0, 1]); 0 (the local fit) with fewer than two shapes to do so."""
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
        """The TP degrees at which this GPU has a table of this shape."""
        return sorted({tp for kk, tp, _ in self._g_src if kk == key})

    def _residuals(self, key: ModelKey, op: str) -> tuple[np.ndarray, np.ndarray]:
        """This shape's profiled shards of one layer GEMM, one per TP degree: log2(N x K)
        (ascending) and their log FLOP/s minus the fit's, on the grid of rows (two tables of one
        shape, Llama-2-70B and Llama-3-70B, time the same GEMMs: their mean)."""
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
        """The residual at log2(N x K) = x: linear between the two shards around it, the nearest
        one's beyond them."""
        j = int(np.searchsorted(xs, x))
        if j == 0 or j == len(xs):
            return ys[min(j, len(xs) - 1)]
        f = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
        return (1 - f) * ys[j - 1] + f * ys[j]

    @functools.cached_property
    def sibling_weight(self) -> float:
        """How much of the siblings' residual to carry over: fitted on the shapes this GPU has
        several TP tables of, each shard predicted from its siblings as above (least squares,
        within [0, 1]). Their steps are shared only in part (cuBLAS picks its kernel per N x K
        too), and a shard's one-off slow kernel must not be copied whole."""
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
        """The layer's GEMMs of a shape at a TP degree this GPU has no table for. Where the same
        shape was profiled at other TP degrees (its sibling shards: the same GEMMs with N or K
        split differently), their departure from the fit -- the steps in M of the kernels this
        GPU picks for these very GEMMs, which other shapes do not show -- is carried over,
        interpolated between siblings in log2(N x K) at each M (the nearest one's beyond them),
        times `sibling_weight`."""
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
        # The same shape's tables at other TP degrees, where this operator's row is as wide (norms,
        # adds, embedding: not sharded), time the very same kernel.
        same = [c for c in curves if c[3] == key and c[0] == width]
        if same:
            return np.exp(np.mean([np.log(interp_tokens(tok, ms, m)) for _, tok, ms, _ in same], axis=0))
        logw = np.array([math.log2(c[0]) for c in curves])
        w = np.exp(-(logw - math.log2(width)) ** 2 / (2 * ELEMENTWISE_BANDWIDTH ** 2)) + 1e-300
        logs = np.array([np.log(interp_tokens(tok, ms, m * width / cw)) for cw, tok, ms, _ in curves])
        return np.exp((w @ logs) / w.sum())


# ---------------------------------------------------------------------------------------------
# Collectives


class Collectives:
    """All-reduce and send/recv times on one node, from its tables; a worker count without an
    all-reduce table is predicted as a ring over the node's send/recv (flagged)."""

    def __init__(self, node: str | None, profiles: Profiles):
        self.node = node
        self._profiles = profiles
        self._tables: dict[str, CollectiveTable] | None = None
        self.notes: list[str] = []

    @property
    def tables(self) -> dict[str, CollectiveTable]:
        # Read when first timed: a single-GPU model never pays for the node's tables.
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
            # Another worker count on this node: its curve scaled by the ring's bytes per GPU,
            # 2 (n - 1) / n (median 5-19% off on the DGX nodes when a count is held out; the
            # pairwise nodes' slow links between pairs make 2 -> 4 unpredictable).
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


# ---------------------------------------------------------------------------------------------
# The cost model


def is_gated(cfg: Mapping[str, Any]) -> bool:
    c = dict(cfg.get("text_config", cfg))
    return str(c.get("model_type", "llama")) not in NON_GATED


def resolve_gpu(hardware: HardwareSpec, profiles: Profiles) -> str:
    """The compute-table GPU for a hardware spec, or a one-line error naming the fix."""
    for name in (hardware.profile_gpu, hardware.name):
        if name and name in profiles.gpus:
            return name
    have = ", ".join(profiles.gpus) or "none"
    raise ProfileError(
        f"cost.model=measured: no operator tables for hardware {hardware.name!r}"
        f"{f' (profile_gpu {hardware.profile_gpu!r})' if hardware.profile_gpu else ''}; tables exist for: {have}. "
        f"Point cost.profiles at a folder with compute/{hardware.profile_gpu or hardware.name}/<org>/<model>/mlp.csv "
        f"(python -m sim.profile writes one), or use cost.model=roofline")


#: What validation hides from a prediction: a shape's tables on a GPU at every TP degree
#: (`ModelKey`), or at one (`(ModelKey, tp)`).
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
    """The operators from a table of this shape and TP degree on this GPU, if there is one. A
    table of the same shape serves (Llama-2-70B and Llama-3-70B share one); the same vocabulary first."""
    for t in sorted(profiles.compute(gpu), key=lambda t: t.vocab != vocab):  # stable: root order kept
        if t.key == key and tp in t.by_tp and not _is_held(exclude, key, tp):
            tok, times = t.by_tp[tp]
            out = {op: np.zeros_like(tokens) for op in (*LAYER_OPS, "emb")}
            out.update({op: interp_tokens(tok, ms, tokens) for op, ms in times.items()})
            return out, f"{gpu}/{t.name} TP{tp}"
    return None


def layer_op_ms(profiles: Profiles, gpu: str, key: ModelKey, head_dim: int, tp: int, tokens: np.ndarray,
                exclude: tuple[Held, ...] = (), vocab: int | None = None) -> tuple[dict[str, np.ndarray], str]:
    """ms per layer of each non-attention operator (and `emb`, per step) at these token counts,
    and where they come from: a table of this shape at this TP degree on this GPU, interpolated
    in tokens; else predicted from the GEMM shapes of every table on this GPU, the same shape's
    tables at other TP degrees first (GpuOperatorModel.layer_gemm_ms).
    (Scaling another GPU's table of the shape by the two GPUs' shape predictions was tried: worse,
    4.3% against 3.5% median in benchmarks/sim_profiles.py's leave-one-out.)
    `exclude`: tables on this GPU that are ignored (validation): a shape at every TP degree
    (`ModelKey`) or at one (`(ModelKey, tp)`)."""
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


@dataclass(frozen=True)
class AttentionCalibration:
    """Seconds of one layer's attention = const + per_seq x requests + per_byte x K/V/Q bytes +
    per_flop x FLOPs: the roofline's two terms with this GPU's achieved rates (and the per-call
    and per-request costs a roofline lacks), fitted by non-negative least squares in relative
    error to sim.profile's attention tables."""

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
    A, t = A / t[:, None], np.ones_like(t)  # relative error: a short decode counts as much as a long prefill
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    coef = _nnls(A / norms, t) / norms
    return AttentionCalibration(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), cases=len(y),
                                source=", ".join(names))
