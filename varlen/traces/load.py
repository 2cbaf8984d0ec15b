"""`load_trace`: read or generate, then sort -> over-length policy -> limit -> re-zero -> rescale:
`limit=N` with "drop" returns N requests that fit, and `rate` applies to those returned."""

from __future__ import annotations

import functools
import os
from importlib.resources import files
from pathlib import Path

import numpy as np

from varlen.metrics import median, percentiles
from varlen.traces.cache import read_azure_cached
from varlen.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake_jsonl
from varlen.traces.synthetic import SyntheticTrace
from varlen.traces.trace import Columns, Trace, TraceRequest, TraceStats

NAMED_TRACES: dict[str, str] = {
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "mooncake_conv": "mooncake_conversation_trace.jsonl",
}


def default_traces_dir() -> Path:
    """$VARLEN_TRACES_DIR, else the public traces shipped with the package (varlen/traces_data)."""
    env = os.environ.get("VARLEN_TRACES_DIR")
    return Path(env) if env else Path(str(files("varlen").joinpath("traces_data")))


def named_trace_path(name: str) -> Path:
    """Where a name in NAMED_TRACES lies: the file in default_traces_dir(), or its .gz (as shipped)."""
    plain = default_traces_dir() / NAMED_TRACES[name]
    gz = plain.with_name(plain.name + ".gz")
    return gz if not plain.is_file() and gz.is_file() else plain


def resolve_trace(source: str | os.PathLike, kind: str | None = None) -> tuple[str, Path | None]:
    """(kind, path) for a source: "synthetic", a name in NAMED_TRACES, or a file path."""
    s = str(source)
    if s == "synthetic" or kind == "synthetic":
        return "synthetic", None
    path = named_trace_path(s) if s in NAMED_TRACES else Path(s)
    if path.is_dir():
        raise ValueError(f"trace {s!r} is a directory; give a trace file (.csv, .jsonl, or either with .gz)")
    if not path.is_file():
        raise FileNotFoundError(f"trace {s!r} not found at {path}")
    if kind is None:
        suffixes = [x.lower() for x in path.suffixes]
        if suffixes[-1:] == [".gz"]:
            suffixes.pop()
        suffix = suffixes[-1] if suffixes else ""
        kind = "azure" if suffix == ".csv" else "mooncake" if suffix in (".jsonl", ".json") else None
        if kind is None:
            raise ValueError(f"{path}: cannot tell the trace kind from the name (.csv, .jsonl, or either "
                             "with .gz); pass kind= (workload.kind=azure|mooncake)")
    if kind not in ("azure", "mooncake"):
        raise ValueError(f"unknown trace kind {kind!r} (azure, mooncake, synthetic)")
    return kind, path


def load_trace(
    source: str | os.PathLike | SyntheticTrace = "synthetic",
    *,
    kind: str | None = None,
    time_scale: float | None = None,
    rate: float | None = None,
    limit: int | None = None,
    max_model_len: int | None = None,
    over_length: str = "clip",
) -> Trace:
    """source: a `SyntheticTrace`, a name in NAMED_TRACES or a path (kind: "azure" or "mooncake").
    time_scale multiplies inter-arrival times, or `rate` picks it; max_model_len bounds prompt + output
    ("clip" keeps the prompt's prefix, "drop" the request)."""
    if time_scale is not None and rate is not None:
        raise ValueError("give time_scale or rate, not both")
    if over_length not in ("clip", "drop"):
        raise ValueError(f"over_length must be 'clip' or 'drop', got {over_length!r}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")

    if isinstance(source, SyntheticTrace):
        kind, path, cols = "synthetic", None, source.generate(_empirical_columns)
    else:
        kind, path = resolve_trace(source, kind)
        cols = (SyntheticTrace().generate(_empirical_columns) if kind == "synthetic" else
                read_azure_cached(path) if kind == "azure" else read_mooncake_jsonl(path))
    stats = TraceStats(source=str(path or "synthetic"), kind=kind, num_read=len(cols.prompt))
    cols, stats.num_reordered = _sort_by_arrival(cols)

    zero = cols.output == 0  # raised to 1: the step that finishes a prompt samples a token
    if zero.any():
        cols.output = np.maximum(cols.output, 1)

    over = (cols.prompt + cols.output > max_model_len) if max_model_len else np.zeros(len(cols.prompt), bool)
    keep = np.flatnonzero(~over) if over_length == "drop" else np.arange(len(cols.prompt))
    if limit is not None:
        keep = keep[:limit]
    # Requests past the last one kept were never looked at: neither dropped nor kept.
    scanned = len(over)
    if limit is not None and len(keep) == limit:
        scanned = int(keep[-1]) + 1 if limit else 0
    if over_length == "drop":
        stats.num_dropped = int(np.count_nonzero(over[:scanned]))
    stats.num_zero_output = int(np.count_nonzero(zero[:scanned]))
    cols = cols.take(keep)
    thinned = kind == "synthetic" and over_length == "drop" and 0 < len(keep) < scanned
    if max_model_len and over_length == "clip":
        _clip(cols, max_model_len, stats)

    if len(cols.arrival):
        cols.arrival = cols.arrival - cols.arrival[0]
    scale = 1.0
    if time_scale is not None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        scale = float(time_scale)
    elif rate is not None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        n, dur = len(cols.arrival), float(cols.arrival[-1]) if len(cols.arrival) else 0.0
        if n < 2 or dur <= 0:
            raise ValueError("rate needs at least two requests with distinct arrivals")
        scale = ((n - 1) / dur) / rate
    elif thinned:
        # Dropping thins the generated arrivals (rate x the share kept); time runs that much faster, so the
        # requests kept arrive at the rate the generator was asked for, as the same kind of process.
        scale = len(keep) / scanned
    if scale != 1.0:
        cols.arrival = cols.arrival * scale
    stats.time_scale = scale
    _fill_stats(stats, cols)
    return Trace(_to_requests(cols, kind), stats)


@functools.lru_cache(maxsize=8)
def _empirical_columns(source: str) -> tuple[np.ndarray, np.ndarray]:
    if source == "synthetic":
        raise ValueError("an empirical length distribution needs a file trace, not 'synthetic'")
    t = load_trace(source)
    if not len(t):
        raise ValueError(f"empirical source {source!r} is empty")
    c = t.columns()
    return c["prompt_len"], c["output_len"]


def _sort_by_arrival(c: Columns) -> tuple[Columns, int]:
    descents = int(np.count_nonzero(np.diff(c.arrival) < 0))
    if descents:
        c = c.take(np.argsort(c.arrival, kind="stable"))
    if len(c.arrival):
        c.arrival = c.arrival - c.arrival[0]
    return c, descents


def _clip(c: Columns, max_model_len: int, stats: TraceStats) -> None:
    over = c.prompt + c.output > max_model_len
    if not over.any():
        return
    long_prompt = c.prompt >= max_model_len
    stats.num_clipped = int(np.count_nonzero(over))
    stats.num_prompt_clipped = int(np.count_nonzero(long_prompt))
    c.prompt = np.minimum(c.prompt, max_model_len - 1)  # leave room for at least one output token
    c.output = np.minimum(c.output, max_model_len - c.prompt)
    if c.hash_ids is not None and long_prompt.any():
        nblocks = -(-c.prompt // MOONCAKE_BLOCK_TOKENS)
        for i in np.flatnonzero(long_prompt).tolist():
            h = c.hash_ids[i]
            if h is not None:
                c.hash_ids[i] = h[: int(nblocks[i])]


def _fill_stats(s: TraceStats, c: Columns) -> None:
    n = len(c.prompt)
    s.num_returned = n
    if not n:
        return
    s.duration_s = float(c.arrival[-1])
    s.mean_rate = (n - 1) / s.duration_s if s.duration_s > 0 else 0.0
    s.prompt_mean = float(c.prompt.mean())
    s.prompt_p50, s.prompt_p99 = percentiles(c.prompt, (50, 99))
    s.output_mean = float(c.output.mean())
    s.output_p50 = median(c.output)


def _to_requests(c: Columns, kind: str) -> list[TraceRequest]:
    rows = [str(r) for r in c.row.tolist()]
    hashes = c.hash_ids if c.hash_ids is not None else [None] * len(rows)
    return list(map(TraceRequest, c.arrival.tolist(), c.prompt.tolist(), c.output.tolist(), hashes, rows))
