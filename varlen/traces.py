"""Request traces for the engine CLI and the simulator: Azure CSV, Mooncake JSONL, synthetic.

Everything here is torch-free and imports only numpy at module level (pandas is imported when a
CSV is read) so that the simulator starts in a fraction of a second.

One entry point, `load_trace(source, ...)`, returns a `Trace`: a list of `TraceRequest` sorted by
arrival, arrivals in seconds relative to the first request, plus a `TraceStats` with what the
options did (dropped, clipped, reordered, rescaled).

Decisions worth knowing:
- Out-of-order timestamps are sorted (stably), not rejected. Merged production logs have small
  inversions that carry no meaning; how many rows were out of order is `stats.num_reordered`.
- Negative or non-integral lengths, a zero prompt length, unparseable timestamps, missing
  columns/fields and invalid JSON are errors (`TraceFormatError`, a ValueError naming the file,
  the 1-based line and the reason). Blank lines are skipped.
- A zero output length is raised to 1 (every step that finishes a prompt samples one token) and
  counted in `stats.num_zero_output`.
- `max_model_len` bounds prompt + output. "clip" keeps the prompt's prefix (so shared prefixes,
  and Mooncake hash ids, survive) and shortens the output; "drop" removes the request.
- The order of options: read -> sort -> over-length policy -> limit -> re-zero -> rescale time.
  So `limit=N` with "drop" returns N requests that fit, and `target_rate` applies to the
  requests actually returned.

Hydra: `load_trace` takes plain keyword arguments, so a config node can build a trace directly:

    trace:
      _target_: varlen.traces.load_trace
      source: azure_conv          # or a path, or "synthetic"
      target_rate: 4.0
      max_model_len: 8192
      over_length: drop
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import zipfile
from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512

# Short names for the public traces shipped in varlen/traces_data (see its README.md).
NAMED_TRACES: dict[str, str] = {
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "mooncake_conv": "mooncake_conversation_trace.jsonl",
}


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # Mooncake: one id per 512-token block of the prompt
    req_id: str | None = None


@dataclass(slots=True)
class TraceStats:
    source: str
    kind: str
    num_read: int = 0  # rows in the file, or requests generated
    num_returned: int = 0
    num_dropped: int = 0  # over max_model_len, over_length="drop"
    num_clipped: int = 0  # over max_model_len, over_length="clip"
    num_prompt_clipped: int = 0  # of the clipped, those whose prompt alone reached max_model_len
    num_reordered: int = 0  # rows whose timestamp was earlier than the previous row's
    num_zero_output: int = 0  # output length 0 raised to 1
    time_scale: float = 1.0  # factor applied to inter-arrival times
    duration_s: float = 0.0
    mean_rate: float = 0.0  # (n - 1) / duration, requests per second
    prompt_mean: float = 0.0
    prompt_p50: float = 0.0
    prompt_p99: float = 0.0
    output_mean: float = 0.0
    output_p50: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> str:
        s = (f"{self.kind} {self.source}: {self.num_returned} requests over {self.duration_s:.1f} s "
             f"({self.mean_rate:.3g} req/s), prompt mean {self.prompt_mean:.0f} / p50 "
             f"{self.prompt_p50:.0f} / p99 {self.prompt_p99:.0f}, output mean "
             f"{self.output_mean:.0f} / p50 {self.output_p50:.0f}")
        extra = [f"{k} {getattr(self, k)}" for k in
                 ("num_dropped", "num_clipped", "num_reordered", "num_zero_output") if getattr(self, k)]
        if self.time_scale != 1.0:
            extra.append(f"time_scale {self.time_scale:.4g}")
        return s + (f" [{', '.join(extra)}]" if extra else "")


@dataclass(slots=True)
class Trace:
    requests: list[TraceRequest]
    stats: TraceStats

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    def columns(self) -> dict[str, np.ndarray]:
        """arrival_s, prompt_len, output_len as arrays (for vectorised analysis)."""
        r = self.requests
        return {
            "arrival_s": np.fromiter((x.arrival_s for x in r), np.float64, len(r)),
            "prompt_len": np.fromiter((x.prompt_len for x in r), np.int64, len(r)),
            "output_len": np.fromiter((x.output_len for x in r), np.int64, len(r)),
        }


class TraceFormatError(ValueError):
    def __init__(self, path: str | os.PathLike, line: int | None, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        where = f"line {line}" if line is not None else "unknown line"
        super().__init__(f"{path}: {where}: {reason}")


def _fail(path: str | os.PathLike, line: int | None, reason: str) -> NoReturn:
    raise TraceFormatError(path, line, reason)


@dataclass(slots=True)
class _Columns:
    """A trace as parallel arrays while options are applied; requests are built once at the end."""

    arrival: np.ndarray  # float64 seconds
    prompt: np.ndarray  # int64
    output: np.ndarray  # int64
    row: np.ndarray  # index of the request in its source, for req_id
    hash_ids: list[tuple[int, ...] | None] | None = None

    def take(self, idx: np.ndarray) -> _Columns:
        h = None if self.hash_ids is None else [self.hash_ids[i] for i in idx.tolist()]
        return _Columns(self.arrival[idx], self.prompt[idx], self.output[idx], self.row[idx], h)


def _sort_by_arrival(c: _Columns) -> tuple[_Columns, int]:
    descents = int(np.count_nonzero(np.diff(c.arrival) < 0))
    if descents:
        c = c.take(np.argsort(c.arrival, kind="stable"))
    if len(c.arrival):
        c.arrival = c.arrival - c.arrival[0]
    return c, descents


# ---------------------------------------------------------------------------------------------
# Readers


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# Longer than any model's context, and small enough that prompt + output never overflows int64.
MAX_LENGTH = 2**31 - 1


def _int_column(values: Any, labels: np.ndarray, name: str, path: Path) -> np.ndarray:
    """A CSV column as int64; `labels` are the rows' 0-based data-row index (line = label + 2)."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(values.dtype):  # "true"/"false" would otherwise read as 1/0
        _fail(path, int(labels[0]) + 2, f"non-numeric value {str(values.iloc[0]).lower()!r} in column {name}")
    if pd.api.types.is_integer_dtype(values.dtype) and values.dtype.kind == "i":
        ints = values.to_numpy(np.int64)
        big = np.flatnonzero(ints > MAX_LENGTH)
        if len(big):
            _fail(path, int(labels[big[0]]) + 2, f"value {int(ints[big[0]])} in column {name} is out of range "
                  f"(more than {MAX_LENGTH} tokens)")
        return ints
    # Only a column with a problem (or blank lines) gets here: the C parser did not type it int64.
    raw_values = values.astype(object)
    is_bool = np.fromiter((isinstance(v, (bool, np.bool_)) for v in raw_values), bool, len(raw_values))
    nums = pd.to_numeric(values.where(~is_bool, None) if is_bool.any() else values, errors="coerce")
    nums = nums.to_numpy(np.float64)
    bad = ~np.isfinite(nums) | (nums != np.floor(nums)) | (np.abs(nums) > MAX_LENGTH)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raw = values.iloc[i]
        raw = "" if raw is None or (isinstance(raw, float) and np.isnan(raw)) else str(raw).strip()
        reason = (f"missing value in column {name}" if raw == "" else
                  f"non-numeric value {raw!r} in column {name}" if not np.isfinite(nums[i]) else
                  f"non-integer value {raw!r} in column {name}" if nums[i] != np.floor(nums[i]) else
                  f"value {raw} in column {name} is out of range (more than {MAX_LENGTH} tokens)")
        _fail(path, int(labels[i]) + 2, reason)
    return nums.astype(np.int64)


_GZIP_MAGIC = b"\x1f\x8b"


def _is_gz(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _check_compression(path: Path) -> None:
    """gzip bytes under a plain name would be read as (undecodable) text."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head == _GZIP_MAGIC and not _is_gz(path):
        _fail(path, 1, f"gzip-compressed data in a file named {path.suffix}; name it {path.name}.gz "
              "(read as gzip) or decompress it")
    if _is_gz(path) and head != _GZIP_MAGIC:
        _fail(path, 1, "named .gz but not gzip-compressed; rename it without .gz")


def _read_azure_csv(path: Path) -> _Columns:
    import pandas as pd

    _check_compression(path)
    try:
        # Blank lines stay as (all-NaN) rows, so a row's label maps to its line number.
        # .csv.gz: pandas decompresses by the name.
        df = pd.read_csv(path, skip_blank_lines=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        _fail(path, 1, "empty file (no header)")
    except UnicodeDecodeError as e:
        _fail(path, None, f"not UTF-8 text ({e.reason} at byte {e.start})")
    except (EOFError, OSError) as e:  # a truncated or corrupt .gz
        _fail(path, None, f"cannot read the compressed file ({e})")
    except pd.errors.ParserError as e:
        m = re.search(r"line (\d+)", str(e))
        _fail(path, int(m.group(1)) if m else None, f"malformed CSV row ({str(e).strip()})")
    by_name = {str(c).strip().lstrip("\ufeff").lower(): c for c in df.columns}
    missing = [c for c in _AZURE_COLUMNS if c.lower() not in by_name]
    if missing:
        _fail(path, 1, f"missing column(s) {', '.join(missing)} (header: {', '.join(map(str, df.columns))})")
    df = df[[by_name[c.lower()] for c in _AZURE_COLUMNS]]
    df.columns = list(_AZURE_COLUMNS)
    blank = df.isna().all(axis=1)
    if blank.any():
        df = df[~blank]
    labels = df.index.to_numpy()

    prompt = _int_column(df["ContextTokens"], labels, "ContextTokens", path)
    output = _int_column(df["GeneratedTokens"], labels, "GeneratedTokens", path)

    ts_raw = df["TIMESTAMP"]
    if pd.api.types.is_numeric_dtype(ts_raw.dtype) and ts_raw.notna().all():
        arrival = ts_raw.to_numpy(np.float64)  # plain seconds, as some derived traces use
    else:
        # ISO8601 covers the 2023 (naive, 7 fractional digits) and 2024 (+00:00) formats.
        ts = pd.to_datetime(ts_raw, format="ISO8601", utc=True, errors="coerce")
        nat = ts.isna().to_numpy()
        if nat.any():
            i = int(np.flatnonzero(nat)[0])
            raw = ts_raw.iloc[i]
            what = "missing timestamp" if pd.isna(raw) else f"unparseable timestamp {str(raw)!r}"
            _fail(path, int(labels[i]) + 2, what)
        arrival = (ts - ts.min()).dt.total_seconds().to_numpy(np.float64)
    return _check_lengths(_Columns(arrival, prompt, output, np.arange(len(prompt))), labels + 2, path)


#: Decoded traces kept in the cache (each a few hundred KB for a public trace's size).
TRACE_CACHE_KEEP = 16


def trace_cache_dir() -> Path | None:
    """Where decoded CSV traces are kept: $VARLEN_TRACE_CACHE (a folder; "0" or "off": no cache),
    else `traces/` in the compiled core's cache folder (VARLEN_CACHE_DIR, ~/.cache/varlen)."""
    env = os.environ.get("VARLEN_TRACE_CACHE")
    if env is not None and env.strip().lower() in ("0", "off", "false", "no", ""):
        return None
    if env:
        return Path(env)
    from varlen.compiled import cache_dir

    return cache_dir() / "traces"


@functools.lru_cache(maxsize=1)
def _reader_key() -> bytes:
    # Any edit to this module may change what a file decodes to: a cache entry names its source.
    return hashlib.blake2b(Path(__file__).read_bytes(), digest_size=16).digest()


def _read_azure_cached(path: Path) -> _Columns:
    """_read_azure_csv, through a cache of the decoded columns keyed by the file's bytes and this
    reader's source: a whole trace loads in milliseconds instead of a pandas parse (~0.2 s, plus
    pandas' import). Only a file that decoded without error is cached, so every error still
    comes from the reader with its line; the options (sort, clip, limit, rate) apply after, as
    for a fresh read. A missing, unreadable or unwritable cache only costs the parse."""
    folder = trace_cache_dir()
    if folder is None:
        return _read_azure_csv(path)
    try:
        _check_compression(path)  # gzip bytes under a plain name are an error however they were cached
        data = path.read_bytes()
        # The name says how the bytes are read (gzip or not): part of the key, with the content.
        key = hashlib.blake2b(data + (b".gz" if _is_gz(path) else b""), digest_size=20, key=_reader_key()).hexdigest()
    except OSError:
        return _read_azure_csv(path)  # the reader says why, naming the file
    entry = folder / f"azure-{key}.npz"
    try:
        with np.load(entry, allow_pickle=False) as z:
            arrival, prompt, output = z["arrival"], z["prompt"], z["output"]
        if (arrival.dtype == np.float64 and prompt.dtype == output.dtype == np.int64
                and arrival.ndim == prompt.ndim == output.ndim == 1 and len(arrival) == len(prompt) == len(output)):
            try:
                os.utime(entry)  # recently used: the last to be pruned
            except OSError:
                pass
            return _Columns(arrival, prompt, output, np.arange(len(prompt)))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or damaged: read the file and write it anew
    cols = _read_azure_csv(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{entry.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, arrival=cols.arrival, prompt=cols.prompt, output=cols.output)
        os.replace(tmp, entry)  # atomic: a reader sees no entry or a whole one
        old = sorted(folder.glob("azure-*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)[TRACE_CACHE_KEEP:]
        for p in old:
            p.unlink(missing_ok=True)
    except OSError:
        pass
    return cols


def _read_mooncake_jsonl(path: Path) -> _Columns:
    import codecs
    import gzip

    _check_compression(path)
    data = path.read_bytes()
    if _is_gz(path):
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError) as e:
            _fail(path, None, f"cannot read the compressed file ({e})")
    if data.startswith(codecs.BOM_UTF8):  # written by some Windows tools; not part of the JSON
        data = data[len(codecs.BOM_UTF8):]
    lines = data.split(b"\n")
    nonblank = [i for i, s in enumerate(lines) if s.strip()]
    try:
        # One C-level parse of the whole file; only on failure do we walk lines to find which.
        objs = json.loads(b"[" + b",".join(lines[i] for i in nonblank) + b"]")
    except (json.JSONDecodeError, UnicodeDecodeError):
        for i in nonblank:
            try:
                json.loads(lines[i])
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                _fail(path, i + 1, f"invalid JSON ({getattr(e, 'msg', e)})")
        _fail(path, None, "invalid JSON")
    n = len(objs)
    ts = np.empty(n, np.float64)
    prompt = np.empty(n, np.int64)
    output = np.empty(n, np.int64)
    hashes: list[tuple[int, ...] | None] = []
    for k, obj in enumerate(objs):
        line = nonblank[k] + 1
        if not isinstance(obj, dict):
            _fail(path, line, f"expected a JSON object, got {type(obj).__name__}")
        try:
            t, i, o = obj["timestamp"], obj["input_length"], obj["output_length"]
        except KeyError as e:
            _fail(path, line, f"missing field {e.args[0]!r}")
        for name, v in (("timestamp", t), ("input_length", i), ("output_length", o)):
            if type(v) is not int and not (type(v) is float and math.isfinite(v)):
                _fail(path, line, f"non-numeric {name} {v!r}")
        for name, v in (("input_length", i), ("output_length", o)):
            if v != int(v):
                _fail(path, line, f"non-integer {name} {v!r}")
            if abs(v) > MAX_LENGTH:
                _fail(path, line, f"{name} {v!r} is out of range (more than {MAX_LENGTH} tokens)")
        try:
            ts[k] = t
        except OverflowError:
            _fail(path, line, f"timestamp {t!r} is out of range")
        prompt[k], output[k] = i, o
        h = obj.get("hash_ids")
        if h is None:
            hashes.append(None)
        elif isinstance(h, list) and all(type(x) is int for x in h):
            if not all(_HASH_MIN <= x <= _M64 for x in h):
                x = next(x for x in h if not _HASH_MIN <= x <= _M64)
                _fail(path, line, f"hash id {x} is out of range (64-bit ids: -2**63 to 2**64 - 1)")
            hashes.append(tuple(h))
        else:
            _fail(path, line, "hash_ids must be a list of integers")
    cols = _Columns(ts / 1000.0, prompt, output, np.arange(n), hashes)  # Mooncake timestamps are ms
    return _check_lengths(cols, np.asarray(nonblank) + 1, path)


def _check_lengths(c: _Columns, lines: np.ndarray, path: Path) -> _Columns:
    for name, arr, lo in (("prompt length", c.prompt, 1), ("output length", c.output, 0)):
        bad = arr < lo
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            what = "negative" if arr[i] < 0 else "zero"
            _fail(path, int(lines[i]), f"{what} {name} {int(arr[i])}")
    return c


# ---------------------------------------------------------------------------------------------
# Synthetic workloads


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token counts.

    kind: "fixed" (value), "uniform" (low..high inclusive), "lognormal" (mean of the lengths and
    sigma of their log), or "empirical" (resampled from the matching column of another trace,
    `source` being anything `load_trace` accepts). Samples are rounded and clipped to [min, max].

    `parse` accepts an int (fixed), a LengthDist, a mapping with these fields, or a compact
    string: "512", "fixed:512", "uniform:128:2048", "lognormal:1000:0.8", "empirical:azure_conv".
    """

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1
    mean: float = 0.0
    sigma: float = 1.0
    source: str | None = None
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal", "empirical"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.value < 0:
            raise ValueError(f"fixed length must be >= 0, got {self.value}")
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError(f"uniform needs 0 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs mean > 0 and sigma >= 0, got {self.mean}, {self.sigma}")
        if self.kind == "empirical" and not self.source:
            raise ValueError("empirical length distribution needs a source trace")

    @classmethod
    def parse(cls, spec: int | str | Mapping[str, Any] | LengthDist) -> LengthDist:
        if isinstance(spec, LengthDist):
            return spec
        if isinstance(spec, (int, np.integer)):
            return cls("fixed", value=int(spec))
        if isinstance(spec, Mapping):
            return cls(**dict(spec))
        if isinstance(spec, str):
            s = spec.strip()
            if s.isdigit():
                return cls("fixed", value=int(s))
            kind, _, rest = s.partition(":")
            try:
                if kind == "empirical":
                    return cls("empirical", source=rest)
                args = [a for a in rest.split(":") if a]
                if kind == "fixed":
                    return cls("fixed", value=int(args[0]))
                if kind == "uniform":
                    return cls("uniform", low=int(args[0]), high=int(args[1]))
                if kind == "lognormal":
                    mx = int(args[2]) if len(args) > 2 else None
                    return cls("lognormal", mean=float(args[0]), sigma=float(args[1]), max=mx)
            except (IndexError, ValueError) as e:
                raise ValueError(f"bad length distribution {spec!r}: {e}") from None
        raise ValueError(f"bad length distribution {spec!r}")

    def sample(self, rng: np.random.Generator, n: int, column: str = "prompt",
               index: np.ndarray | None = None) -> np.ndarray:
        """n samples; `column` ("prompt"/"output") picks the empirical column, `index` the rows."""
        if self.kind == "fixed":
            x = np.full(n, self.value, np.float64)
        elif self.kind == "uniform":
            x = rng.integers(self.low, self.high + 1, n).astype(np.float64)
        elif self.kind == "lognormal":
            # mu chosen so that the lengths (not their logs) have the requested mean.
            mu = math.log(self.mean) - self.sigma**2 / 2
            x = np.rint(rng.lognormal(mu, self.sigma, n))
        else:
            values = _empirical_columns(self.source)[0 if column == "prompt" else 1]
            if index is None:
                index = rng.integers(0, len(values), n)
            x = values[index].astype(np.float64)
        hi = np.inf if self.max is None else self.max
        return np.clip(x, self.min, hi).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _empirical_columns(source: str) -> tuple[np.ndarray, np.ndarray]:
    if source == "synthetic":
        raise ValueError("an empirical length distribution needs a file trace, not 'synthetic'")
    t = load_trace(source)
    c = t.columns()
    if not len(t):
        raise ValueError(f"empirical source {source!r} is empty")
    return c["prompt_len"], c["output_len"]


def _synthesize(num_requests: int, rate: float, arrival: str, cv: float,
                prompt_len: Any, output_len: Any, seed: int) -> _Columns:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    # Independent streams, so that changing a length distribution leaves arrivals unchanged.
    r_arr, r_prompt, r_out = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    n = num_requests
    if arrival == "poisson":
        gaps = r_arr.exponential(1.0 / rate, max(n - 1, 0))
    elif arrival == "gamma":
        if not cv > 0:
            raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
        # Shape 1/cv^2 gives inter-arrival CV = cv at mean 1/rate; cv > 1 is burstier than Poisson.
        shape = 1.0 / cv**2
        gaps = r_arr.gamma(shape, 1.0 / (rate * shape), max(n - 1, 0))
    else:
        raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])[:n]
    pd_, od = LengthDist.parse(prompt_len), LengthDist.parse(output_len)
    joint = None
    if pd_.kind == od.kind == "empirical" and pd_.source == od.source:
        # Same source for both: resample whole rows, keeping the prompt/output correlation.
        joint = r_prompt.integers(0, len(_empirical_columns(pd_.source)[0]), n)
    prompt = pd_.sample(r_prompt, n, "prompt", joint)
    output = od.sample(r_out, n, "output", joint)
    if n and prompt.min() < 1:
        raise ValueError("synthetic prompt lengths must be >= 1 (set min >= 1)")
    return _Columns(arrivals, prompt, output, np.arange(n))


# ---------------------------------------------------------------------------------------------
# Entry point


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
    source: str | os.PathLike = "synthetic",
    *,
    kind: str | None = None,
    time_scale: float | None = None,
    target_rate: float | None = None,
    limit: int | None = None,
    max_model_len: int | None = None,
    over_length: str = "clip",
    seed: int = 0,
    num_requests: int = 1000,
    rate: float = 1.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    prompt_len: int | str | Mapping[str, Any] = 512,
    output_len: int | str | Mapping[str, Any] = 128,
) -> Trace:
    """Load or generate a trace.

    source: "synthetic", a name in NAMED_TRACES ("azure_conv", "azure_code", "mooncake_conv"), or
    a path; kind ("azure", "mooncake", "synthetic") overrides the guess from the file suffix.

    time_scale multiplies inter-arrival times (0.5 = twice the rate); target_rate instead picks
    the factor that makes (n - 1) / duration equal it. limit keeps the first requests (after
    over-length dropping). max_model_len with over_length "clip" or "drop" bounds prompt + output.

    Synthetic only: num_requests, rate (req/s), arrival ("poisson", or "gamma" with cv = the
    inter-arrival coefficient of variation), prompt_len / output_len (see LengthDist.parse), seed.
    """
    if time_scale is not None and target_rate is not None:
        raise ValueError("give time_scale or target_rate, not both")
    if over_length not in ("clip", "drop"):
        raise ValueError(f"over_length must be 'clip' or 'drop', got {over_length!r}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")

    kind, path = resolve_trace(source, kind)
    if kind == "synthetic":
        cols = _synthesize(num_requests, rate, arrival, cv, prompt_len, output_len, seed)
    elif kind == "azure":
        cols = _read_azure_cached(path)
    else:
        cols = _read_mooncake_jsonl(path)
    stats = TraceStats(source=str(path or "synthetic"), kind=kind, num_read=len(cols.prompt))
    cols, stats.num_reordered = _sort_by_arrival(cols)

    zero = cols.output == 0
    if zero.any():
        cols.output = np.maximum(cols.output, 1)

    over = (cols.prompt + cols.output > max_model_len) if max_model_len else np.zeros(len(cols.prompt), bool)
    keep = np.flatnonzero(~over) if over_length == "drop" else np.arange(len(cols.prompt))
    if limit is not None:
        keep = keep[:limit]
    # Requests past the last one kept were never looked at; they count as neither dropped nor kept.
    scanned = len(over)
    if limit is not None and len(keep) == limit:
        scanned = int(keep[-1]) + 1 if limit else 0
    if over_length == "drop":
        stats.num_dropped = int(np.count_nonzero(over[:scanned]))
    stats.num_zero_output = int(np.count_nonzero(zero[:scanned]))
    cols = cols.take(keep)
    if max_model_len and over_length == "clip":
        _clip(cols, max_model_len, stats)

    if len(cols.arrival):
        cols.arrival = cols.arrival - cols.arrival[0]
    scale = 1.0
    if time_scale is not None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        scale = float(time_scale)
    elif target_rate is not None:
        if not target_rate > 0:
            raise ValueError(f"target_rate must be > 0, got {target_rate}")
        n, dur = len(cols.arrival), float(cols.arrival[-1]) if len(cols.arrival) else 0.0
        if n < 2 or dur <= 0:
            raise ValueError("target_rate needs at least two requests with distinct arrivals")
        scale = ((n - 1) / dur) / target_rate
    if scale != 1.0:
        cols.arrival = cols.arrival * scale
    stats.time_scale = scale
    _fill_stats(stats, cols)
    return Trace(_to_requests(cols, kind), stats)


def _clip(c: _Columns, max_model_len: int, stats: TraceStats) -> None:
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


def _fill_stats(s: TraceStats, c: _Columns) -> None:
    n = len(c.prompt)
    s.num_returned = n
    if not n:
        return
    s.duration_s = float(c.arrival[-1])
    s.mean_rate = (n - 1) / s.duration_s if s.duration_s > 0 else 0.0
    s.prompt_mean = float(c.prompt.mean())
    s.prompt_p50, s.prompt_p99 = (float(x) for x in np.percentile(c.prompt, [50, 99]))
    s.output_mean = float(c.output.mean())
    s.output_p50 = float(np.median(c.output))


def _to_requests(c: _Columns, kind: str) -> list[TraceRequest]:
    rows = [str(r) for r in c.row.tolist()]
    hashes = c.hash_ids if c.hash_ids is not None else [None] * len(rows)
    return list(map(TraceRequest, c.arrival.tolist(), c.prompt.tolist(), c.output.tolist(), hashes, rows))


# ---------------------------------------------------------------------------------------------
# Prompt content

_M64 = (1 << 64) - 1
_HASH_MIN = -(1 << 63)
_GOLDEN = 0x9E3779B97F4A7C15
_DOMAIN_BLOCK = 0x426C6F636B  # separates hash-id block content from per-request content
_DOMAIN_REQUEST = 0x52657175


def _mix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (same function as _mix on arrays)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps modulo 2**64, which is what the hash wants.
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stream(keys: np.ndarray, start: int, length: int) -> np.ndarray:
    """Token words for positions start..start+length of each key: shape [len(keys), length]."""
    pos = np.arange(start, start + length, dtype=np.uint64) + np.uint64(1)
    return _mix(keys[:, None] + pos[None, :] * np.uint64(_GOLDEN))


def _request_key(req: TraceRequest, seed: int) -> int:
    ident = req.req_id if req.req_id is not None else repr((req.arrival_s, req.prompt_len, req.output_len))
    # blake2b rather than hash(): str hashes are salted per process and must not be.
    digest = int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8).digest(), "little")
    return _mix_int(digest ^ _mix_int(seed ^ _DOMAIN_REQUEST))


def synth_prompt_tokens(req: TraceRequest, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                        seed: int = 0) -> np.ndarray:
    """Deterministic prompt token ids (int64, length req.prompt_len, values in [0, vocab_size)).

    With hash ids, block j of the prompt is a function of (hash_ids[j], seed) only, so requests
    sharing hash-id prefixes share token prefixes (and hit a prefix cache). Positions past the
    hash-id blocks, and whole prompts without hash ids, come from a per-request stream keyed by
    req_id (or, without one, by arrival and lengths), so distinct requests do not share content.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n = int(req.prompt_len)
    parts: list[np.ndarray] = []
    if req.hash_ids:
        nb = min(len(req.hash_ids), -(-n // block_tokens))
        base = np.uint64(_mix_int(seed ^ _DOMAIN_BLOCK))
        # Ids as 64-bit words: signed and unsigned ids of the same bits are the same block.
        keys = _mix(np.asarray([h & _M64 for h in req.hash_ids[:nb]], dtype=np.uint64) ^ base)
        parts.append(_stream(keys, 0, block_tokens).ravel()[:n])
    have = sum(len(p) for p in parts)
    if have < n:
        key = np.asarray([_request_key(req, seed)], dtype=np.uint64)
        parts.append(_stream(key, have, n - have).ravel())
    words = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    return (words % np.uint64(vocab_size)).astype(np.int64)
