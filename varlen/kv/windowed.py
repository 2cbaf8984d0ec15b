"""Sliding-window KV: a paged allocator that gives back the blocks every layer's window has passed.

A layer with a sliding window of W reads, for a query at position p, the keys p-W+1 .. p only. So
when every layer is windowed (Mistral, Gemma 3 text configs whose layers all slide), a request's
K/V older than the widest window is dead: a step whose first new token is at position c reads
nothing before c - W + 1, nor does any later step. This allocator frees the blocks wholly before
that point, at the request's next `allocate`, so a long generation holds about W / block_size + 1
blocks instead of one per block_size tokens. If any layer attends to the whole context, nothing
may be freed early: the model runner refuses this allocator for such a model (and for a window
smaller than the model's), so freeing can never change a logit.

A freed block's entry stays in the request's block table (positions keep their index) and may
name a block that now holds another request's K/V; backends never let keys outside a layer's
window count (see `AttentionBackend.forward`). Blocks with cached prefix content stay findable
until reused, as any freed block. The decode fast-forward stays exact: `next_allocation_event`
names the counts at which a block is freed, and the bulk `grow_decodes` is not offered.
`usage().live_tokens` keeps counting what requests asked slots for, released positions included
(the fast-forward's step log relies on each decode adding one); `reserved_slots` is what they hold.
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
        if req.req_id in self.tables:
            # Before taking blocks, so the room freed serves this very step. The earliest query of
            # this step is at num_computed_tokens (never past num_tokens - 1).
            self._release_passed(req, min(req.num_computed_tokens, num_tokens - 1))
        return super().allocate(req, num_tokens)

    def _release_passed(self, req: Request, first_query: int) -> None:
        bs, rid = self.block_size, req.req_id
        table = self.tables[rid]
        keep_from = first_query - self.sliding_window + 1  # the oldest position any layer still reads
        k = min(max(keep_from, 0) // bs, len(table))
        if self.enable_prefix_caching:
            k = min(k, self.registered.get(rid, 0))  # (always true: those blocks filled in earlier steps)
        done = self.released.get(rid, 0)
        if k <= done:
            return
        self._release(table[done:k])
        self.released[rid] = k

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        # A decode's call allocate(req, m) runs with num_computed_tokens = m - 1, and frees block
        # `done` once m - 1 - W + 1 >= (done + 1) * block_size.
        event = super().next_allocation_event(req, num_tokens)
        if req.req_id in self.tables:
            free_at = (self.released.get(req.req_id, 0) + 1) * self.block_size + self.sliding_window
            event = min(event, max(free_at, num_tokens + 1))
        return event

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        return None  # the bulk path knows nothing of freeing: the caller makes the calls

    def free(self, req: Request) -> None:
        done = self.released.pop(req.req_id, 0)
        table = self.tables.get(req.req_id)
        if done and table is not None:
            del table[:done]  # already given back
        super().free(req)
