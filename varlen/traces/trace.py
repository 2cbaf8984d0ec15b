"""A trace's types, its columns while options apply, and the checks every reader shares."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, NoReturn

import numpy as np

# Longer than any model's context, and small enough that prompt + output never overflows int64.
MAX_LENGTH = 2**31 - 1


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
    num_dropped: int = 0
    num_clipped: int = 0
    num_prompt_clipped: int = 0  # of the clipped, those whose prompt alone reached max_model_len
    num_reordered: int = 0  # rows earlier than the row before: sorted, not rejected
    num_zero_output: int = 0
    time_scale: float = 1.0
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


def fail(path: str | os.PathLike, line: int | None, reason: str) -> NoReturn:
    raise TraceFormatError(path, line, reason)


@dataclass(slots=True)
class Columns:
    """A trace as parallel arrays while options are applied; requests are built once at the end."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    row: np.ndarray  # index of the request in its source, for req_id
    hash_ids: list[tuple[int, ...] | None] | None = None

    def take(self, idx: np.ndarray) -> Columns:
        h = None if self.hash_ids is None else [self.hash_ids[i] for i in idx.tolist()]
        return Columns(self.arrival[idx], self.prompt[idx], self.output[idx], self.row[idx], h)


def check_lengths(c: Columns, lines: np.ndarray, path: Path) -> Columns:
    for name, arr, lo in (("prompt length", c.prompt, 1), ("output length", c.output, 0)):
        bad = arr < lo
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            what = "negative" if arr[i] < 0 else "zero"
            fail(path, int(lines[i]), f"{what} {name} {int(arr[i])}")
    return c


_GZIP_MAGIC = b"\x1f\x8b"


def is_gz(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def check_compression(path: Path) -> None:
    """gzip bytes under a plain name would be read as (undecodable) text."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head == _GZIP_MAGIC and not is_gz(path):
        fail(path, 1, f"gzip-compressed data in a file named {path.suffix}; name it {path.name}.gz "
             "(read as gzip) or decompress it")
    if is_gz(path) and head != _GZIP_MAGIC:
        fail(path, 1, "named .gz but not gzip-compressed; rename it without .gz")
