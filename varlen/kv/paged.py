"""Paged KV allocation: a pool of fixed-size blocks, reference counts, prefix caching.

Full blocks are registered under a chained hash of their content. Freed blocks stay findable until
reused: content-free ones first, then cached ones least recently freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from mypy_extensions import mypyc_attr

from varlen.kv.base import KVAllocator, KVUsage
from varlen.request import Request


#: num_blocks -> the block ids from last to first, a new pool's free stack: a fleet's pools copy one
#: tuple's int objects instead of each making num_blocks new ones (time and memory per replica).
_FREE_STACKS: dict[int, tuple[int, ...]] = {}


@mypyc_attr(allow_interpreted_subclasses=True)
class PagedAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, max_model_len)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        ids = _FREE_STACKS.get(num_blocks)
        if ids is None:
            if len(_FREE_STACKS) >= 8:  # a few pool sizes a process: bounded
                _FREE_STACKS.clear()
            ids = _FREE_STACKS[num_blocks] = tuple(range(num_blocks - 1, -1, -1))
        self.free_plain: list[int] = list(ids)  # no cached content; top = next
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # cached content, least recently freed first
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.tables: dict[str, list[int]] = {}
        self.registered: dict[str, int] = {}  # how many leading blocks of a request are registered
        self.prefix_hit_blocks = 0
        self.prefix_query_blocks = 0

    def _hits(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        # Never the last token: its logits are needed, so it must be computed.
        hashes = req.block_hashes(bs, (req.num_tokens - 1) // bs)
        hits = []
        for j, h in enumerate(hashes):
            bid = self.cached.get(h)
            if bid is None or self.block_tokens[bid] != tuple(req.token_ids(j * bs, (j + 1) * bs)):
                break
            hits.append(bid)
        return hits

    def match_prefix(self, req: Request) -> int:
        return len(self._hits(req)) * self.block_size

    def allocate(self, req: Request, num_tokens: int) -> bool:
        table = self.tables.get(req.req_id)
        if table is not None and -(-num_tokens // self.block_size) <= len(table):
            self._record_count(req.req_id, num_tokens)
            if self.enable_prefix_caching:
                self._register_full_blocks(req, num_tokens)
            return True
        hits: list[int] = []
        if table is None:
            hits = self._hits(req)
            table = []
        need = -(-num_tokens // self.block_size) - len(table) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        if need > len(self.free_plain) + len(self.free_cached) - revived:
            return False
        if req.req_id not in self.tables:
            self.tables[req.req_id] = table
            self.registered[req.req_id] = len(hits)
            self.prefix_hit_blocks += len(hits)
            self.prefix_query_blocks += (req.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0
            for b in hits:
                if self.ref_count[b] == 0:
                    del self.free_cached[b]  # a hit has content, so it is never a plain block
                self.ref_count[b] += 1
            table.extend(hits)
        if need > 0:
            rc, plain = self.ref_count, self.free_plain
            n = min(need, len(plain))
            if n:
                got = plain[-n:]
                del plain[-n:]
                got.reverse()
                for b in got:
                    rc[b] = 1
                table += got
            for _ in range(need - n):
                b, _ = self.free_cached.popitem(last=False)
                h = self.block_hash[b]
                if h is not None and self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = self.block_tokens[b] = None
                rc[b] = 1
                table.append(b)
        self._record_count(req.req_id, num_tokens)
        self._register_full_blocks(req, num_tokens)
        return True

    def allocate_decodes(self, reqs: list[Request], num: int) -> int:
        cls = type(self)
        if (cls.allocate is not PagedAllocator.allocate or cls._record_count is not KVAllocator._record_count
                or cls._register_full_blocks is not PagedAllocator._register_full_blocks):
            return KVAllocator.allocate_decodes(self, reqs, num)  # a subclass's own: called as it is
        # allocate() inlined for a decode whose table has room (it only records its count) and, without
        # prefix caching, for one that takes the stack's top block.
        bs, tables, counts, caching = self.block_size, self.tables, self.num_tokens, self.enable_prefix_caching
        plain, rc = self.free_plain, self.ref_count
        for p in range(num):
            r = reqs[p]
            rid = r.req_id
            m = r.num_computed_tokens + 1
            table = tables.get(rid)
            if table is None or m > len(table) * bs:
                if table is None or caching or not plain or m > (len(table) + 1) * bs:
                    if not self.allocate(r, m):
                        return p
                    continue
                b = plain.pop()
                rc[b] = 1
                table.append(b)
            had = counts.get(rid, 0)
            if m > had:
                counts[rid] = m
                self.live_tokens += m - had
            if caching:
                self._register_full_blocks(r, m)
        return num

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        bs = self.block_size
        held = max(len(self.tables.get(req.req_id, ())), -(-num_tokens // bs))
        event = held * bs + 1
        if self.enable_prefix_caching:
            full = max(self.registered.get(req.req_id, 0), num_tokens // bs)
            event = min(event, (full + 1) * bs)
        return event

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        if self.enable_prefix_caching:
            return None  # decodes fill blocks that must be registered as they fill: call by call
        # Without prefix caching only takes matter: list them, step then batch order, off the stack.
        bs, tables, plain = self.block_size, self.tables, self.free_plain
        takes = []
        for p, (r, c) in enumerate(zip(reqs, counts)):
            j = len(tables[r.req_id]) * bs - c
            while j < num_steps:
                takes.append((j, p))
                j += bs
        takes.sort()
        ok = num_steps
        if len(takes) > len(plain):
            ok = takes[len(plain)][0]
            del takes[len(plain):]
        changed: dict[int, int] = {}
        if takes:
            got = plain[-len(takes):]
            del plain[-len(takes):]
            got.reverse()
            rc = self.ref_count
            reserved = (self.num_blocks - len(plain) - len(got)) * bs
            for (j, p), b in zip(takes, got):
                tables[reqs[p].req_id].append(b)
                rc[b] = 1
                reserved += bs
                changed[j] = reserved
        if type(self)._record_count is KVAllocator._record_count:
            # _record_count inline: one lookup and store a request, the live total added once.
            recorded, grown = self.num_tokens, 0
            for r, c in zip(reqs, counts):
                rid = r.req_id
                m = c + ok
                had = recorded.get(rid, 0)
                if m > had:
                    recorded[rid] = m
                    grown += m - had
            self.live_tokens += grown
        else:
            for p, r in enumerate(reqs):
                self._record_count(r.req_id, counts[p] + ok)
        for j, p in takes:
            if j == ok:
                self._record_count(reqs[p].req_id, counts[p] + ok + 1)
        return ok, changed

    def decode_steps_fit(self, reqs: Sequence[Request], counts: Sequence[int], num_steps: int) -> int:
        # A decode takes at most one block, when its count passes its table; any free block serves.
        bs, tables = self.block_size, self.tables
        takes = []
        for r, c in zip(reqs, counts):
            j = len(tables[r.req_id]) * bs - c
            while j < num_steps:
                takes.append(j)
                j += bs
        free = len(self.free_plain) + len(self.free_cached)
        if len(takes) <= free:
            return num_steps
        takes.sort()
        return takes[free]

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        # Findable now: a forward writes all new K/V before any attention reads them.
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, self.tables[req.req_id]
        full = min(num_tokens, req.num_tokens) // bs
        start = self.registered[req.req_id]
        if full <= start:
            return
        hashes = req.block_hashes(bs, full)
        for j in range(start, full):
            b, h = table[j], hashes[j]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.block_tokens[b] = tuple(req.token_ids(j * bs, (j + 1) * bs))
                self.cached.setdefault(h, b)
        self.registered[req.req_id] = full

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.req_id, None)
        self._forget_count(req.req_id)
        self.registered.pop(req.req_id, None)
        if table is None:
            return
        rc, plain = self.ref_count, self.free_plain
        if not self.enable_prefix_caching:
            for b in table:
                if rc[b] != 1:
                    raise AssertionError(f"block {b} has {rc[b]} holders without prefix caching")
                rc[b] = 0
            table.reverse()
            plain += table
            return
        self._release(table)

    def _release(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a block nobody holds goes to the stack, or the LRU if cached."""
        rc, plain, block_hash = self.ref_count, self.free_plain, self.block_hash
        for b in reversed(blocks):  # a prefix's tail is evicted before its head
            c = rc[b] - 1
            rc[b] = c
            if c == 0:
                if block_hash[b] is None:
                    plain.append(b)
                else:
                    self.free_cached[b] = None
            elif c < 0:
                raise AssertionError(f"block {b} freed more often than it was taken")

    def discard(self, req: Request, num_written: int) -> None:
        # Blocks are registered when allocated for a step, before its forward writes them.
        table = self.tables.get(req.req_id)
        if table is not None and self.enable_prefix_caching:
            for b in table[num_written // self.block_size:]:
                h = self.block_hash[b]
                if h is not None:
                    if self.cached.get(h) == b:
                        del self.cached[h]
                    self.block_hash[b] = self.block_tokens[b] = None
        self.free(req)

    def block_table(self, req: Request) -> Sequence[int]:
        return self.tables.get(req.req_id, ())

    def usage(self) -> KVUsage:
        return self._usage(len(self.free_plain) + len(self.free_cached))
