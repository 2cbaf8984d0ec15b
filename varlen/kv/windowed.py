"""Sliding-window KV: a paged allocator that gives back the blocks every layer's window has passed.

Freed block ids stay in the table (backends mask keys outside the window); `live_tokens` still
counts released positions, since the fast-forward relies on each decode adding one.
"""

from __future__ import annotations

from typing import Sequence

from varlen.kv.paged import PagedAllocator
from varlen.request import Request


class WindowedPagedAllocator(PagedAllocator):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, sliding_window: int | None = None):
        """sliding_window: the widest window of the model's layers (every layer must have one)."""
        super().__init__(num_blocks, block_size, max_model_len, enable_prefix_caching)
        if sliding_window is None or int(sliding_window) < 1:
            raise ValueError(f"allocator sliding_window must be a positive number of positions (the model's "
                             f"widest window, e.g. 4096 for Mistral-7B-v0.1), got {sliding_window!r}")
        self.sliding_window = int(sliding_window)
        self.released: dict[str, int] = {}  # per request: how many leading blocks were given back

    def allocate(self, req: Request, num_tokens: int) -> bool:
        if req.req_id in self.held:
            # Before taking blocks, so the room freed serves this very step.
            self._release_passed(req, min(req.num_computed_tokens, num_tokens - 1))
        return super().allocate(req, num_tokens)

    def _release_passed(self, req: Request, first_query: int) -> None:
        bs, rid = self.block_size, req.req_id
        h = self.held[rid]
        table = h.blocks
        keep_from = first_query - self.sliding_window + 1  # the oldest position any layer still reads
        k = min(max(keep_from, 0) // bs, len(table))
        if self.enable_prefix_caching:
            k = min(k, h.registered)  # (always true: those blocks filled in earlier steps)
        done = self.released.get(rid, 0)
        if k <= done:
            return
        self._release(table[done:k])
        self.released[rid] = k

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        # allocate(req, m) runs at num_computed_tokens = m - 1: block `done` goes once m - W >= (done + 1) * bs.
        event = super().next_allocation_event(req, num_tokens)
        if req.req_id in self.held:
            free_at = (self.released.get(req.req_id, 0) + 1) * self.block_size + self.sliding_window
            event = min(event, max(free_at, num_tokens + 1))
        return event

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        return None  # the bulk path knows nothing of freeing: the caller makes the calls

    def decode_steps_fit(self, reqs: Sequence[Request], counts: Sequence[int], num_steps: int) -> int:
        # Releases only add free blocks before a step takes one: the paged count is a lower bound.
        return super().decode_steps_fit(reqs, counts, num_steps)

    def free(self, req: Request) -> None:
        done = self.released.pop(req.req_id, 0)
        h = self.held.get(req.req_id)
        if done and h is not None:
            del h.blocks[:done]  # already given back
        super().free(req)
