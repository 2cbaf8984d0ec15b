"""The allocator's optional decode-growth protocol (interpreted: mypyc cannot build a runtime-checkable Protocol)."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from varlen.request import Request


@runtime_checkable
class DecodeGrowth(Protocol):
    """Optional, for the simulator's decode fast-forward (sim/fast_forward.py): an allocator with
    both methods is asked only the calls that matter; without them, every call is made."""

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        """For `req`, holding slots for `num_tokens` and growing one token at a time (a decode):
        the smallest m > num_tokens for which `allocate(req, m)` may do more than record m (take
        a block, register a full block, fail or raise); calls in between may be skipped."""

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        """At step j < num_steps, allocate(reqs[p], counts[p] + j + 1) for each p, until one fails:
        (steps whose calls all succeeded, {step: reserved slots after it} where changed); None: not offered."""
