"""The Mooncake trace format: JSONL of timestamp (ms), input_length, output_length, hash_ids."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from varlen.traces.trace import MAX_LENGTH, Columns, check_compression, check_lengths, fail, is_gz

MOONCAKE_BLOCK_TOKENS = 512
_HASH_MIN, _HASH_MAX = -(1 << 63), (1 << 64) - 1


def read_mooncake_jsonl(path: Path) -> Columns:
    import codecs
    import gzip

    check_compression(path)
    data = path.read_bytes()
    if is_gz(path):
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError) as e:
            fail(path, None, f"cannot read the compressed file ({e})")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    lines = data.split(b"\n")
    nonblank = [i for i, s in enumerate(lines) if s.strip()]
    try:
        # One C-level parse of the whole file; only on failure is each line parsed to name the bad one.
        objs = json.loads(b"[" + b",".join(lines[i] for i in nonblank) + b"]")
    except (json.JSONDecodeError, UnicodeDecodeError):
        for i in nonblank:
            try:
                json.loads(lines[i])
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                fail(path, i + 1, f"invalid JSON ({getattr(e, 'msg', e)})")
        fail(path, None, "invalid JSON")
    n = len(objs)
    ts = np.empty(n, np.float64)
    prompt = np.empty(n, np.int64)
    output = np.empty(n, np.int64)
    hashes: list[tuple[int, ...] | None] = []
    for k, obj in enumerate(objs):
        line = nonblank[k] + 1
        if not isinstance(obj, dict):
            fail(path, line, f"expected a JSON object, got {type(obj).__name__}")
        try:
            t, i, o = obj["timestamp"], obj["input_length"], obj["output_length"]
        except KeyError as e:
            fail(path, line, f"missing field {e.args[0]!r}")
        for name, v in (("timestamp", t), ("input_length", i), ("output_length", o)):
            if type(v) is not int and not (type(v) is float and math.isfinite(v)):
                fail(path, line, f"non-numeric {name} {v!r}")
        for name, v in (("input_length", i), ("output_length", o)):
            if v != int(v):
                fail(path, line, f"non-integer {name} {v!r}")
            if abs(v) > MAX_LENGTH:
                fail(path, line, f"{name} {v!r} is out of range (more than {MAX_LENGTH} tokens)")
        try:
            ts[k] = t
        except OverflowError:
            fail(path, line, f"timestamp {t!r} is out of range")
        prompt[k], output[k] = i, o
        h = obj.get("hash_ids")
        if h is None:
            hashes.append(None)
        elif isinstance(h, list) and all(type(x) is int for x in h):
            if not all(_HASH_MIN <= x <= _HASH_MAX for x in h):
                x = next(x for x in h if not _HASH_MIN <= x <= _HASH_MAX)
                fail(path, line, f"hash id {x} is out of range (64-bit ids: -2**63 to 2**64 - 1)")
            hashes.append(tuple(h))
        else:
            fail(path, line, "hash_ids must be a list of integers")
    cols = Columns(ts / 1000.0, prompt, output, np.arange(n), hashes)  # Mooncake timestamps are ms
    return check_lengths(cols, np.asarray(nonblank) + 1, path)
