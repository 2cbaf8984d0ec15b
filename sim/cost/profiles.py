"""The measured operator tables (sim/profiles/, or a user's folder of the same layout): finding,
reading and interpolating them in tokens. Torch- and pandas-free; each table is read once per process."""

from __future__ import annotations

import csv
import functools
import gzip
import io
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike

from sim.cost.hardware import NON_GATED, HardwareSpec, ModelShape


def _shipped() -> Path:
    import sim  # not this file: compiled, it lives in the build cache

    return Path(sim.__file__).resolve().parent / "profiles" / "vidur"


SHIPPED = _shipped()

# The per-layer operators of a table; a layer runs "add" twice.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")
PER_LAYER = {op: (2 if op == "add" else 1) for op in LAYER_OPS}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
ATTENTION_COLUMNS = ("batch_size", "new_tokens", "cached_tokens", "n_head", "n_kv_head", "head_dim", "dtype_bytes",
                     "time_stats.attention.median")
GRID_TOKENS = 16384
HEAD_ROWS = 4096


class ProfileError(ValueError):
    """A profile folder or table that cannot serve a request (missing GPU, bad table)."""


def _read_csv(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """(header, data rows, each row's line in the file); an unreadable table is one line naming where."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise ProfileError(f"{path}: not a readable gzip file ({e}); gzip the CSV or name it .csv") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = data[data.rfind(b"\n", 0, e.start) + 1:e.start].count(b",") + 1
        raise ProfileError(f"{path}: line {line}, column {column}: byte {data[e.start]:#x} is not UTF-8 text") from None
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    rows: list[list[str]] = []
    lines: list[int] = []
    try:
        for row in reader:
            if not row:
                continue
            if header is None:
                header = row
            elif len(row) != len(header):
                what = (f"column {header[len(row)]!r} onward missing" if len(row) < len(header)
                        else f"fields past the last column {header[-1]!r}")
                raise ProfileError(f"{path}: line {reader.line_num}: {len(row)} fields where the header has "
                                   f"{len(header)} ({what})")
            else:
                rows.append(row)
                lines.append(reader.line_num)
    except csv.Error as e:
        raise ProfileError(f"{path}: line {reader.line_num}: {e}") from None
    if header is None:
        raise ProfileError(f"{path}: empty table")
    if not rows:
        raise ProfileError(f"{path}: a header and no rows; a table needs at least one measured row")
    return header, rows, lines


def _columns(path: Path, header: list[str], rows: list[list[str]], lines: list[int],
             names: Iterable[str]) -> dict[str, np.ndarray]:
    idx = {h: i for i, h in enumerate(header)}
    missing = [n for n in names if n not in idx]
    if missing:
        raise ProfileError(f"{path}: missing columns {missing}")
    out = {}
    for n in names:
        col = [r[idx[n]] for r in rows]
        if n == "use_gated_mlp":
            out[n] = np.array([v.strip().lower() == "true" for v in col])
            continue
        try:
            out[n] = np.array(col, dtype=np.float64)
        except ValueError:
            i = next(i for i, v in enumerate(col) if not _is_number(v))
            raise ProfileError(f"{path}: line {lines[i]}, column {n!r}: {col[i]!r} is not a number") from None
    return out


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ModelKey:
    """The shape a compute table was profiled for."""

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
    header, rows, lines = _read_csv(path)
    # Only the GEMMs are required (phi-2 has one layernorm per layer).
    ops = tuple(op for op in (*LAYER_OPS, "emb") if op in GEMMS or f"time_stats.{op}.median" in header)
    cols = _columns(path, header, rows, lines, [*SHAPE_COLUMNS, "num_tokens", "num_tensor_parallel_workers",
                                         *(f"time_stats.{op}.median" for op in ops)])
    shapes = {tuple(cols[c][i] for c in SHAPE_COLUMNS) for i in range(len(rows))}
    if len(shapes) != 1:
        raise ProfileError(f"{path}: {len(shapes)} model shapes in one table")
    h, kv, e, x, vocab, gated = next(iter(shapes))
    by_tp: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    for tp in sorted({int(v) for v in cols["num_tensor_parallel_workers"]}):
        sel = cols["num_tensor_parallel_workers"] == tp
        tokens, inv = np.unique(cols["num_tokens"][sel], return_inverse=True)
        if tokens[0] < 1:
            raise ProfileError(f"{path}: TP {tp}: num_tokens must be >= 1")
        counts = np.bincount(inv)
        times = {op: np.bincount(inv, cols[f"time_stats.{op}.median"][sel]) / counts for op in ops}
        for op, t in times.items():
            if not np.all(np.isfinite(t)) or np.any(t <= 0):
                raise ProfileError(f"{path}: TP {tp}: {op} has non-positive or missing times")
        by_tp[tp] = (tokens, times)
    # Vidur's tables have no head_dim column (theirs is n_embd / n_head).
    hd = _columns(path, header, rows, lines, ["head_dim"])["head_dim"][0] if "head_dim" in header else e // h
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
    header, rows, lines = _read_csv(path)
    cols = _columns(path, header, rows, lines, ["num_workers", "devices_per_node", "size", "max_devices_per_node",
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
    """Every table under the profile folders, later folders first; read when first needed."""

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
            by_root = [(i, name, path) for name, path in self._compute_paths.get(gpu, [])
                       for i, r in enumerate(self.roots) if path.is_relative_to(r)]
            self._compute[gpu] = [read_compute_table(path, gpu, name)
                                  for _, name, path in sorted(by_root, key=lambda x: -x[0])]
        return self._compute[gpu]

    def attention(self, gpu: str) -> list[tuple[Path, dict[str, np.ndarray]]]:
        """sim.profile's attention tables on this GPU: (path, columns)."""
        out = []
        for path in self._attention_paths.get(gpu, []):
            header, rows, lines = _read_csv(path)
            # long_query_min: the profiled backend's second path for long prompts (absent: one path).
            optional = [c for c in ("long_query_min",) if c in header]
            out.append((path, _columns(path, header, rows, lines, (*ATTENTION_COLUMNS, *optional))))
        return out

    def engine_overhead(self, gpu: str) -> tuple[str, dict[str, float]] | None:
        """sim.profile's fitted per-step engine cost on this device (the last one found)."""
        paths = self._overhead_paths.get(gpu, [])
        if not paths:
            return None
        path = paths[-1]
        header, rows, lines = _read_csv(path)
        # ops_scale: the engine's steps over the tables' sum (tables written before it have none: 1), in
        # steps with a prompt chunk and, unless decode_ops_scale says otherwise, in decode-only steps;
        # temperature: the sampling its engine runs used (before it was recorded they sampled at 1).
        # spread_pct / decode_scale_pinned: how steady the fit was (sim.profile's halves of its passes), shown.
        optional = [c for c in ("ops_scale", "decode_ops_scale", "temperature", "spread_pct", "decode_scale_pinned")
                    if c in header]
        cols = _columns(path, header, rows, lines, ["const_ms", "per_seq_ms", "per_prefill_ms", *optional])
        fit = {"ops_scale": 1.0, "temperature": 1.0, **{k: float(v[0]) for k, v in cols.items()}}
        fit.setdefault("decode_ops_scale", fit["ops_scale"])
        for scale in ("ops_scale", "decode_ops_scale"):
            if not fit[scale] > 0:
                raise ProfileError(f"{path}: {scale} must be > 0, got {fit[scale]}")
        return str(path.parent.relative_to(path.parents[2])), fit

    def network(self, node: str) -> dict[str, CollectiveTable]:
        if node not in self._network:
            self._network[node] = {k: read_collective_table(p, node, k)
                                   for k, p in self._network_paths.get(node, {}).items()}
        return self._network[node]


def load_profiles(user: str | os.PathLike | None = None) -> Profiles:
    """The shipped tables, overridden by those under `user` (cost.profiles); cached while files stay the same."""
    if user is None:
        return _load((SHIPPED,), ())
    root = Path(user).expanduser().resolve()
    files = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*.csv*"))) \
        if root.is_dir() else ()
    return _load((SHIPPED, root), files)


@functools.lru_cache(maxsize=8)
def _load(roots: tuple[Path, ...], signature: tuple[Any, ...]) -> Profiles:
    return Profiles(roots)


def interp_tokens(tokens: np.ndarray, ms: np.ndarray, x: ArrayLike) -> np.ndarray:
    """Piecewise-linear in tokens; the first time below (a kernel's floor), per-token beyond."""
    x = np.asarray(x, dtype=np.float64)
    y = np.interp(x, tokens, ms)
    hi = x > tokens[-1]
    if np.any(hi):
        y = np.where(hi, ms[-1] * x / tokens[-1], y)
    return y


def is_gated(cfg: Mapping[str, Any]) -> bool:
    c = dict(cfg.get("text_config", cfg))
    return str(c.get("model_type", "llama")) not in NON_GATED


def table_gpu(hardware: HardwareSpec, profiles: Profiles) -> str | None:
    """The compute-table GPU for a hardware spec, or None where no tables hold it."""
    for name in (hardware.profile_gpu, hardware.name):
        if name and name in profiles.gpus:
            return name
    return None
