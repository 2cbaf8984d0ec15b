"""Contiguous reservation: one run of consecutive blocks per request, sized at admission
(`max`, `pow2` or `oracle` length), as early serving systems did.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator, KVUsage
from varlen.request import Request

RESERVATIONS = ("max", "pow2", "oracle")  # how long a run a request reserves


@mypyc_attr(allow_interpreted_subclasses=True)
class ContiguousAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, reservation: str = "max"):
        super().__init__(num_blocks, block_size, max_model_len)
        if reservation not in RESERVATIONS:
            raise ValueError(f"unknown reservation {reservation!r}; choose one of {RESERVATIONS}")
        self.reservation = reservation
        self.extents: list[tuple[int, int]] = [(0, num_blocks)]  # free runs (start, length), sorted
        self.runs: dict[str, tuple[int, int]] = {}
        self.free_blocks = num_blocks  # sum of the extents' lengths, kept as it changes: usage() runs every step

    def reserve_tokens(self, req: Request) -> int:
        # Capped by the pool, or every `max` reservation would be too long to fit.
        longest = self.max_request_tokens()
        if self.reservation == "max":
            n = longest
        else:
            out = req.expected_output_len if self.reservation == "oracle" and req.expected_output_len \
                else req.sampling.max_tokens
            n = min(req.num_prompt_tokens + out, longest)
            if self.reservation == "pow2":
                n = min(1 << max(0, n - 1).bit_length(), longest)
        return max(n, req.num_tokens)  # a resumed request never gets less than it already has

    def allocate(self, req: Request, num_tokens: int) -> bool:
        run = self.runs.get(req.req_id)
        if run is None:
            want = -(-self.reserve_tokens(req) // self.block_size)
            for i, (start, length) in enumerate(self.extents):  # first fit
                if length >= want:
                    self.extents[i:i + 1] = [(start + want, length - want)] if length > want else []
                    run = self.runs[req.req_id] = (start, want)
                    self.free_blocks -= want
                    break
            else:
                return False
        if -(-num_tokens // self.block_size) > run[1]:
            raise ValueError(f"request {req.req_id!r} needs {num_tokens} tokens but reserved "
                             f"{run[1] * self.block_size} ({self.reservation} policy)")
        self._record_count(req.req_id, num_tokens)
        return True

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        # The run was reserved at admission; only a count past its end does more (it raises).
        run = self.runs.get(req.req_id)
        return run[1] * self.block_size + 1 if run else num_tokens + 1

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        return None  # no bulk form: next_allocation_event already skips every call but the last

    def free(self, req: Request) -> None:
        run = self.runs.pop(req.req_id, None)
        self._forget_count(req.req_id)
        if run is None:
            return
        self.free_blocks += run[1]
        i = bisect.bisect(self.extents, run)
        self.extents.insert(i, run)
        # Merge with neighbours so external fragmentation is only what really is.
        if i + 1 < len(self.extents) and self.extents[i][0] + self.extents[i][1] == self.extents[i + 1][0]:
            self.extents[i:i + 2] = [(self.extents[i][0], self.extents[i][1] + self.extents[i + 1][1])]
        if i > 0 and self.extents[i - 1][0] + self.extents[i - 1][1] == self.extents[i][0]:
            self.extents[i - 1:i + 1] = [(self.extents[i - 1][0], self.extents[i - 1][1] + self.extents[i][1])]

    def block_table(self, req: Request) -> Sequence[int]:
        run = self.runs.get(req.req_id)
        return range(run[0], run[0] + run[1]) if run else ()

    def usage(self) -> KVUsage:
        return self._usage(self.free_blocks)
