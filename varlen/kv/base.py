"""The KV allocator plug point: hands out KV slots to requests as block tables, whatever the
strategy, so attention backends never care which allocator is in use. No torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

from mypy_extensions import mypyc_attr

from varlen.request import Request

#: What DecodeGrowth's methods (varlen/kv/growth.py) promise about (varlen/promises.py).
ALLOCATION_PROMISE_BEHAVIOUR = ("allocate", "free", "match_prefix", "usage")


@dataclass(init=False, slots=True)
class KVUsage:
    live_tokens: int  # tokens requests have asked slots for (a shared block counts once per holder)
    reserved_slots: int  # slots in blocks held by some request (internal fragmentation = reserved - live)
    free_slots: int  # slots a new allocation could take (includes evictable prefix-cache blocks)
    total_slots: int

    def __init__(self, live_tokens: int, reserved_slots: int, free_slots: int, total_slots: int) -> None:
        self.live_tokens, self.reserved_slots, self.free_slots, self.total_slots = live_tokens, reserved_slots, free_slots, total_slots

    @property
    def utilization(self) -> float:
        return (self.total_slots - self.free_slots) / self.total_slots if self.total_slots else 0.0


@mypyc_attr(allow_interpreted_subclasses=True)
class KVAllocator(ABC):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len or num_blocks * block_size
        self._counts: dict[str, int] = {}  # num_tokens' store (a subclass may keep counts its own way)
        self.live_tokens = 0  # their sum, kept as it changes: usage() runs every step

    @property
    def num_tokens(self) -> Mapping[str, int]:
        """Per holder, the largest count it asked slots for (read-only: _record_count writes it)."""
        return MappingProxyType(self._counts)

    def _record_count(self, req_id: str, num_tokens: int) -> None:
        """A holder asked for `num_tokens` slots: remember its largest count."""
        had = self._counts.get(req_id, 0)
        if num_tokens > had:
            self._counts[req_id] = num_tokens
            self.live_tokens += num_tokens - had

    def _forget_count(self, req_id: str) -> None:
        self.live_tokens -= self._counts.pop(req_id, 0)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def match_prefix(self, req: Request) -> int:
        """Tokens of `req` already in the cache (whole blocks, never its last token); no side effect."""
        return 0

    @abstractmethod
    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s first `num_tokens` positions have slots. All or nothing: False if no room."""

    @abstractmethod
    def free(self, req: Request) -> None:
        """Give back every block `req` holds (finished, aborted or preempted)."""

    def discard(self, req: Request, num_written: int) -> None:
        """free(), after a failed step: blocks holding `req`'s tokens from `num_written` on must not be
        offered again by content. The default suits an allocator with no content cache."""
        self.free(req)

    @abstractmethod
    def block_table(self, req: Request) -> Sequence[int]:
        """The block ids holding `req`'s tokens, in order."""

    @abstractmethod
    def usage(self) -> KVUsage: ...

    def _usage(self, free_blocks: int) -> KVUsage:
        """usage() of a pool of whole blocks with `free_blocks` of them free."""
        bs = self.block_size
        return KVUsage(self.live_tokens, self._reserved(free_blocks), free_blocks * bs, self.num_blocks * bs)

    def _reserved(self, free_blocks: int) -> int:
        """usage().reserved_slots of a pool of whole blocks with `free_blocks` of them free."""
        return (self.num_blocks - free_blocks) * self.block_size

    def allocate_decodes(self, reqs: list[Request], num: int) -> int:
        """allocate(r, r.num_computed_tokens + 1) for reqs[0], reqs[1], ... in order, up to `num` of them,
        stopping at the first that fails: how many succeeded (a policy scheduling its decodes)."""
        for p in range(num):
            r = reqs[p]
            if not self.allocate(r, r.num_computed_tokens + 1):
                return p
        return num

    def _allocate_leading_decodes(self, reqs: list[Request], limit: int) -> tuple[int, bool]:
        """allocate_decodes(reqs, n) for the n <= limit leading requests that each need one token (a policy's
        leading decodes): (how many succeeded, whether one failed). PagedAllocator fuses the two passes."""
        n = 0
        while n < limit:
            r = reqs[n]
            if r.num_prompt_tokens + len(r.output_token_ids) - r.num_computed_tokens != 1:
                break
            n += 1
        got = self.allocate_decodes(reqs, n) if n else 0
        return got, got < n

    def decode_steps_fit(self, reqs: Sequence[Request], counts: Sequence[int], num_steps: int) -> int:
        """How many of the next `num_steps` decode steps of `reqs` (allocate(reqs[p], counts[p] + j + 1)
        for step j) certainly succeed, asked without side effects; 0 when the allocator cannot tell."""
        return 0

    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) this pool can ever hold on its own."""
        return min(self.capacity_tokens, self.max_model_len)

