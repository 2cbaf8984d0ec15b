"""steps.csv: one row per step of each replica. Without token-level output it is written as the
run goes: each replica's step log hands its folded entries to a sink appending their rows to that
replica's part file; write_outputs joins the parts in replica order under one header (with
token-level output, the kept logs go through the same sinks at the end). The rows are those
step_table + pandas write, byte for byte (integers stay integers even where a replica ran no step)."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path
from typing import Callable

from varlen.steplog import DecodeRun, StepRecord

COLUMNS = ["replica", "step", "start", "duration", "num_seqs", "num_new_tokens", "num_cached_tokens", "num_decodes",
           "num_preempted", "kv_reserved_slots", "kv_live_tokens", "num_waiting"]
DETAIL = ["req_ids", "new_tokens", "cached_tokens"]


def part_path(out: Path, replica: int) -> Path:
    return out / f".steps-{replica}.csv.part"


def sink(out: Path, part: int, detail: bool, replica: int | None = None) -> Callable[[list[StepRecord | DecodeRun]], None]:
    """A StepLog sink appending the rows of replica `replica` (default: `part`) to part file `part`
    (created empty now)."""
    path = part_path(out, part)
    replica = part if replica is None else replica
    path.write_text("")

    def write(entries: list[StepRecord | DecodeRun]) -> None:
        rows = []
        for e in entries:
            for s in ([e.record(i) for i in range(len(e))] if isinstance(e, DecodeRun) else [e]):
                new = s.new_tokens
                row = [replica, s.step, s.start, s.duration, len(s.req_ids), sum(new), sum(s.cached_tokens),
                       sum(1 for n in new if n == 1), s.num_preempted, s.kv_reserved_slots, s.kv_live_tokens,
                       s.num_waiting]
                if detail:
                    row += [" ".join(s.req_ids), " ".join(map(str, new)), " ".join(map(str, s.cached_tokens))]
                rows.append(row)
        with open(path, "a", newline="") as f:
            csv.writer(f, lineterminator=os.linesep).writerows(rows)

    return write


def join(out: Path, replicas: int, detail: bool, path: Path) -> None:
    """The header, then each replica's part (removed), into `path`."""
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator=os.linesep).writerow(COLUMNS + (DETAIL if detail else []))
        for k in range(replicas):
            part = part_path(out, k)
            with open(part, newline="") as src:
                shutil.copyfileobj(src, f)
            part.unlink()
