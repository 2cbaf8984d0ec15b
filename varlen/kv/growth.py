"""The allocator's optional decode-growth protocol (interpreted: mypyc cannot build a runtime-checkable Protocol)."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from varlen.request import Request


@runtime_checkable
class DecodeGrowth(Protocol):
    """Optional, for the decode fast-forward: an allocator with both methods is asked only the calls that matter."""

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        """The smallest m > num_tokens for which `allocate(req, m)` may do more than record m (take or
        register a block, fail or raise): decode calls in between may be skipped."""

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        """allocate(reqs[p], counts[p] + j + 1) for steps j < num_steps until one fails: (steps that
        succeeded, {step: reserved slots after it} where changed); None: not offered."""
