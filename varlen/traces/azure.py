"""The Azure LLM inference trace format: CSV with TIMESTAMP, ContextTokens, GeneratedTokens."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from varlen.traces.trace import MAX_LENGTH, Columns, check_compression, check_lengths, fail

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _int_column(values: Any, labels: np.ndarray, name: str, path: Path) -> np.ndarray:
    """A CSV column as int64; `labels` are the rows' 0-based data-row index (line = label + 2)."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(values.dtype):  # "true"/"false" would otherwise read as 1/0
        fail(path, int(labels[0]) + 2, f"non-numeric value {str(values.iloc[0]).lower()!r} in column {name}")
    if pd.api.types.is_integer_dtype(values.dtype) and values.dtype.kind == "i":
        ints = values.to_numpy(np.int64)
        big = np.flatnonzero(ints > MAX_LENGTH)
        if len(big):
            fail(path, int(labels[big[0]]) + 2, f"value {int(ints[big[0]])} in column {name} is out of range "
                 f"(more than {MAX_LENGTH} tokens)")
        return ints
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
        fail(path, int(labels[i]) + 2, reason)
    return nums.astype(np.int64)


def read_azure_csv(path: Path) -> Columns:
    import pandas as pd

    check_compression(path)
    try:
        # Blank lines stay as (all-NaN) rows so that a row's label maps to its line; pandas reads .gz by name.
        df = pd.read_csv(path, skip_blank_lines=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        fail(path, 1, "empty file (no header)")
    except UnicodeDecodeError as e:
        fail(path, None, f"not UTF-8 text ({e.reason} at byte {e.start})")
    except (EOFError, OSError) as e:  # a truncated or corrupt .gz
        fail(path, None, f"cannot read the compressed file ({e})")
    except pd.errors.ParserError as e:
        m = re.search(r"line (\d+)", str(e))
        fail(path, int(m.group(1)) if m else None, f"malformed CSV row ({str(e).strip()})")
    by_name = {str(c).strip().lstrip("\ufeff").lower(): c for c in df.columns}
    missing = [c for c in _AZURE_COLUMNS if c.lower() not in by_name]
    if missing:
        fail(path, 1, f"missing column(s) {', '.join(missing)} (header: {', '.join(map(str, df.columns))})")
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
        ts = pd.to_datetime(ts_raw, format="ISO8601", utc=True, errors="coerce")
        nat = ts.isna().to_numpy()
        if nat.any():
            i = int(np.flatnonzero(nat)[0])
            raw = ts_raw.iloc[i]
            what = "missing timestamp" if pd.isna(raw) else f"unparseable timestamp {str(raw)!r}"
            fail(path, int(labels[i]) + 2, what)
        arrival = (ts - ts.min()).dt.total_seconds().to_numpy(np.float64)
    return check_lengths(Columns(arrival, prompt, output, np.arange(len(prompt))), labels + 2, path)
