"""Paged KV allocation: a pool of fixed-size blocks, reference counts, prefix caching.

Full blocks are registered under a chained hash of their content. Freed blocks stay findable until
reused: content-free ones first, then cached ones least recently freed first (LRU).

Per-block state grows with use, not with the pool: a fleet's replicas are mostly idle or lightly
used, and a pool of ~27k blocks would otherwise cost ~0.85 MB a replica before any request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from mypy_extensions import i64, mypyc_attr

from varlen.kv.base import KVAllocator, KVUsage
from varlen.request import Request


@dataclass(init=False, slots=True)
class Held:
    """What the pool keeps for one holder, in one record: a decode looks it up once a step, not three times."""
    blocks: list[int]  # its block table
    count: i64  # the largest count it asked slots for (num_tokens; i64: read and written per decode per step)
    registered: i64  # how many leading blocks are registered (prefix caching)
    # The pool holding it, None once freed: a request's handle (Request.kv_handle) to this record is read
    # only by that pool and only while the record is in its `held`. (Any: a compiled dataclass cannot
    # name `object`; not compared, so equal records of two pools compare equal.)
    owner: Any = field(compare=False, repr=False)

    def __init__(self, blocks: list[int], registered: i64, owner: object) -> None:
        self.blocks, self.count, self.registered, self.owner = blocks, 0, registered, owner


@mypyc_attr(allow_interpreted_subclasses=True)
class PagedAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, max_model_len)
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks [0, fresh) have been handed out at least once; ref_count covers exactly those.
        self._rc: list[int] = []
        self.fresh = 0
        # Returned blocks without cached content; top = next. The never-used ids lie beneath them
        # (fresh first), so blocks go out in the order of one stack [num_blocks-1, ..., 0] + returns.
        self.free_plain: list[int] = []
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # cached content, least recently freed first
        # Content of each block: only written with prefix caching, so only made with it.
        cells = num_blocks if enable_prefix_caching else 0
        self.block_hash: list[int | None] = [None] * cells
        self.block_tokens: list[tuple[int, ...] | None] = [None] * cells
        self.cached: dict[int, int] = {}  # hash -> block id
        self.held: dict[str, Held] = {}  # per holder: its blocks, count and registered blocks
        self.prefix_hit_blocks = 0
        self.prefix_query_blocks = 0
        # Whether allocate, _record_count and _register_full_blocks are this class's: allocate_decodes and
        # grow_decodes then inline them; and allocate_decodes too: the policy's scan is fused with it.
        cls = type(self)
        own = (cls.allocate is PagedAllocator.allocate and cls._record_count is PagedAllocator._record_count
               and cls._register_full_blocks is PagedAllocator._register_full_blocks)
        self._own_calls = int(own)
        self._own_leading = int(own and cls.allocate_decodes is PagedAllocator.allocate_decodes)
        # Without prefix caching a block has one holder or none: this class then keeps no count per block
        # (a take or free touches no block one by one) and ref_count lists them from the tables. A
        # subclass keeps them written (it may give blocks back its own way: WindowedPagedAllocator).
        self._implicit_rc = int(cls is PagedAllocator and not enable_prefix_caching)

    @property
    def ref_count(self) -> list[int]:
        """Holders of each block handed out so far (blocks [0, fresh)); made on read where not kept."""
        if not self._implicit_rc:
            return self._rc
        rc = [0] * self.fresh
        for h in self.held.values():
            for b in h.blocks:
                rc[b] = 1
        return rc

    @property
    def tables(self) -> Mapping[str, list[int]]:
        """Each holder's block table (read-only; a new mapping each read, of the live tables)."""
        return MappingProxyType({rid: h.blocks for rid, h in self.held.items()})

    @property
    def registered(self) -> Mapping[str, int]:
        """How many leading blocks of each holder are registered (read-only copy)."""
        return MappingProxyType({rid: h.registered for rid, h in self.held.items()})

    @property
    def num_tokens(self) -> Mapping[str, int]:
        return MappingProxyType({rid: h.count for rid, h in self.held.items() if h.count})

    def _record(self, req: Request) -> Held | None:
        """req's record in `held`: through its handle where this pool set it, else by id (then kept as the
        handle, unless another pool's is there)."""
        k = req.kv_handle
        if isinstance(k, Held) and k.owner is self:
            return k
        h = self.held.get(req.req_id)
        if h is not None and k is None:
            req.kv_handle = h
        return h

    def _record_count(self, req_id: str, num_tokens: int) -> None:
        h = self.held[req_id]  # only a holder records a count
        if num_tokens > h.count:
            self.live_tokens += num_tokens - h.count
            h.count = num_tokens

    def _forget_count(self, req_id: str) -> None:
        h = self.held.get(req_id)
        if h is not None:
            self.live_tokens -= h.count
            h.count = 0

    def num_free_plain(self) -> int:
        """Free blocks without cached content: returned ones and never-used ones."""
        return len(self.free_plain) + self.num_blocks - self.fresh

    def free_stack(self) -> list[int]:
        """The free content-free blocks as one stack, top (next handed out) last."""
        return [*range(self.num_blocks - 1, self.fresh - 1, -1), *self.free_plain]

    def _take_plain(self, n: int) -> list[int]:
        """The next n content-free blocks (n <= num_free_plain()), in hand-out order, each held once."""
        got: list[int] = []
        self._take_plain_into(got, n)
        return got

    def _take_plain_into(self, got: list[int], n: int) -> None:
        """_take_plain(n) appended to `got` (a block table grows in place, no list in between)."""
        # The stack's top k as a slice (its int objects moved, not rebuilt); never-used ids counted out in
        # native ints (compiled).
        plain, rc = self.free_plain, self._rc
        counted = not self._implicit_rc
        want: i64 = n
        k: i64 = min(want, len(plain))
        if k:
            start = len(plain) - k
            top = plain[start:]
            del plain[start:]
            top.reverse()
            if counted:
                for b in top:
                    rc[b] = 1
            got += top
        if want > k:
            f: i64 = self.fresh
            end = f + want - k
            j = f
            while j < end:
                got.append(j)
                j += 1
            if counted:
                rc.extend([1] * (want - k))
            self.fresh = end

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
        rid = req.req_id
        rec = self._record(req)
        if rec is not None and -(-num_tokens // self.block_size) <= len(rec.blocks):
            self._record_count(rid, num_tokens)
            if self.enable_prefix_caching:
                self._register_full_blocks(req, num_tokens)
            return True
        hits: list[int] = []
        if rec is None:
            hits = self._hits(req)
            table: list[int] = []
        else:
            table = rec.blocks
        need = -(-num_tokens // self.block_size) - len(table) - len(hits)
        revived = sum(1 for b in hits if self._rc[b] == 0)
        if need > self.num_free_plain() + len(self.free_cached) - revived:
            return False
        if rec is None:
            self.held[rid] = req.kv_handle = Held(table, len(hits), self)
            self.prefix_hit_blocks += len(hits)
            self.prefix_query_blocks += (req.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0
            for b in hits:
                if self._rc[b] == 0:
                    del self.free_cached[b]  # a hit has content, so it is never a plain block
                self._rc[b] += 1
            table.extend(hits)
        if need > 0:
            rc = self._rc
            n = min(need, self.num_free_plain())
            if n:
                self._take_plain_into(table, n)
            for _ in range(need - n):
                b, _ = self.free_cached.popitem(last=False)
                h = self.block_hash[b]
                if h is not None and self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = self.block_tokens[b] = None
                rc[b] = 1
                table.append(b)
        self._record_count(rid, num_tokens)
        self._register_full_blocks(req, num_tokens)
        return True

    def _count_own(self) -> bool:
        """Whether _record_count is PagedAllocator's (_own_calls says so when it is set)."""
        return type(self)._record_count is PagedAllocator._record_count

    def allocate_decodes(self, reqs: list[Request], num: int) -> int:
        if not self._own_calls:
            return KVAllocator.allocate_decodes(self, reqs, num)  # a subclass's own: called as it is
        return self._decodes(reqs, num, False) >> 1

    def _allocate_leading_decodes(self, reqs: list[Request], limit: int) -> tuple[int, bool]:
        if not self._own_leading:
            return KVAllocator._allocate_leading_decodes(self, reqs, limit)
        code = self._decodes(reqs, limit, True)
        return code >> 1, bool(code & 1)

    def _decodes(self, reqs: list[Request], num: int, leading: bool) -> int:
        """allocate_decodes' calls for reqs[:num], stopping at the first that fails or, `leading`, at the
        first request that needs other than one token: 2 * (calls that succeeded) + (1 if one failed)."""
        # allocate() inlined for a decode whose table has room (it only records its count) and, without
        # prefix caching, for one that takes the stack's top block; the live total added once. (i64: this
        # loop runs for every running request at every step; compiled, native ints skip tagged arithmetic.)
        bs: i64 = self.block_size
        held, caching = self.held, self.enable_prefix_caching
        plain, rc = self.free_plain, self._rc
        counted = not self._implicit_rc
        grown: i64 = 0
        n: i64 = num
        p: i64 = 0
        while p < n:
            r = reqs[p]
            c: i64 = r.num_computed_tokens
            if leading and r.num_prompt_tokens + len(r.output_token_ids) - c != 1:
                self.live_tokens += grown
                return 2 * p
            m = c + 1
            k = r.kv_handle
            h = k if isinstance(k, Held) and k.owner is self else held.get(r.req_id)
            if h is None or m > len(h.blocks) * bs:
                if h is None or caching or m > (len(h.blocks) + 1) * bs:
                    self.live_tokens += grown
                    grown = 0
                    if not self.allocate(r, m):
                        return 2 * p + 1
                    p += 1
                    continue
                if plain:
                    b = plain.pop()
                    if counted:
                        rc[b] = 1
                elif self.fresh < self.num_blocks:
                    b = self.fresh
                    self.fresh = b + 1
                    if counted:
                        rc.append(1)
                else:
                    self.live_tokens += grown
                    grown = 0
                    if not self.allocate(r, m):
                        return 2 * p + 1
                    p += 1
                    continue
                h.blocks.append(b)
            had = h.count
            if m > had:
                h.count = m
                grown += m - had
            if caching and min(m, r.num_tokens) // bs > h.registered:
                self._register_full_blocks(r, m)
            p += 1
        self.live_tokens += grown
        return 2 * num

    def next_allocation_event(self, req: Request, num_tokens: int) -> int:
        bs = self.block_size
        h = self._record(req)
        event = max(len(h.blocks) if h is not None else 0, -(-num_tokens // bs)) * bs + 1
        if self.enable_prefix_caching:
            full = max(h.registered if h is not None else 0, num_tokens // bs)
            event = min(event, (full + 1) * bs)
        return event

    def grow_decodes(self, reqs: Sequence[Request], counts: Sequence[int],
                     num_steps: int) -> tuple[int, dict[int, int]] | None:
        if self.enable_prefix_caching:
            return None  # decodes fill blocks that must be registered as they fill: call by call
        rl: list[Request] = reqs if isinstance(reqs, list) else list(reqs)
        cl: list[int] = counts if isinstance(counts, list) else list(counts)
        return self._grow(rl, cl, num_steps)

    def grow_running(self, reqs: list[Request], num_steps: int) -> tuple[int, dict[int, int]] | None:
        """grow_decodes(reqs, [r.num_computed_tokens for r in reqs], num_steps), the counts read off the
        requests: the decode fast-forward's call, with no list of boxed counts built per run."""
        if self.enable_prefix_caching:
            return None
        return self._grow(reqs, None, num_steps)

    def _grow(self, rl: list[Request], cl: list[int] | None, num_steps: int) -> tuple[int, dict[int, int]]:
        """grow_decodes; cl None: each request's count is its num_computed_tokens."""
        # Without prefix caching only takes matter: list them, step then batch order, off the stack, each
        # as one int (step * n + position: ints sort faster than pairs). A record is looked up again
        # where needed (cheaper than keeping a list of them).
        bs: i64 = self.block_size
        n: i64 = len(rl) if cl is None else min(len(rl), len(cl))
        steps: i64 = num_steps
        free: i64 = self.num_free_plain()
        takes: list[int] = []
        held = self.held
        own_counts: bool = bool(self._own_calls) or self._count_own()
        # A decode takes at most one block per bs steps (counts[p] <= its table's slots): when even that
        # many fit, every step succeeds and the counts are recorded in the same pass (_record_count inline).
        sure: bool = own_counts and n * ((steps + bs - 1) // bs) <= free
        grown: i64 = 0
        p: i64 = 0
        while p < n:
            r = rl[p]
            k = r.kv_handle
            h = k if isinstance(k, Held) and k.owner is self else held[r.req_id]
            c: i64 = r.num_computed_tokens if cl is None else cl[p]
            j: i64 = len(h.blocks) * bs - c
            while j < steps:
                takes.append(j * n + p)
                j += bs
            if sure:
                m0 = c + steps
                had0 = h.count
                if m0 > had0:
                    h.count = m0
                    grown += m0 - had0
            p += 1
        if len(takes) > 1:
            takes.sort()
        ok: i64 = steps
        if len(takes) > free:
            ok = takes[free] // n
            del takes[free:]
        changed: dict[int, int] = {}
        if takes:
            reserved: i64 = (self.num_blocks - free) * bs
            got = self._take_plain(len(takes))
            step: i64 = takes[0] // n
            for i in range(len(takes)):
                t: i64 = takes[i]
                js: i64 = t // n
                if js != step:  # a step's entry once, after its last take (takes are in step order)
                    changed[step] = reserved
                    step = js
                r = rl[t - js * n]
                k = r.kv_handle
                h = k if isinstance(k, Held) and k.owner is self else held[r.req_id]
                h.blocks.append(got[i])
                reserved += bs
            changed[step] = reserved
        if sure:
            self.live_tokens += grown
        elif own_counts:
            # _record_count inline, the live total added once.
            p = 0
            while p < n:
                r = rl[p]
                k = r.kv_handle
                h = k if isinstance(k, Held) and k.owner is self else held[r.req_id]
                m: i64 = (r.num_computed_tokens if cl is None else cl[p]) + ok
                had = h.count
                if m > had:
                    h.count = m
                    grown += m - had
                p += 1
            self.live_tokens += grown
        else:
            for q in range(n):
                self._record_count(rl[q].req_id, (rl[q].num_computed_tokens if cl is None else cl[q]) + ok)
        if ok < steps:  # the failing step's calls before the failing one succeeded
            for t2 in takes:
                if t2 // n == ok:
                    q = t2 % n
                    self._record_count(rl[q].req_id, (rl[q].num_computed_tokens if cl is None else cl[q]) + ok + 1)
        return ok, changed

    def decode_steps_fit(self, reqs: Sequence[Request], counts: Sequence[int], num_steps: int) -> int:
        rl: list[Request] = reqs if isinstance(reqs, list) else list(reqs)
        cl: list[int] = counts if isinstance(counts, list) else list(counts)
        return self._steps_fit(rl, cl, num_steps)

    def running_steps_fit(self, reqs: list[Request], num_steps: int) -> int:
        """decode_steps_fit(reqs, [r.num_computed_tokens for r in reqs], num_steps), the counts read off
        the requests (as grow_running)."""
        return self._steps_fit(reqs, None, num_steps)

    def _steps_fit(self, rl: list[Request], cl: list[int] | None, num_steps: int) -> int:
        """decode_steps_fit; cl None: each request's count is its num_computed_tokens."""
        # A decode takes at most one block, when its count passes its table; any free block serves.
        bs: i64 = self.block_size
        n: i64 = len(rl) if cl is None else min(len(rl), len(cl))
        steps: i64 = num_steps
        free: i64 = self._free_blocks()
        held = self.held
        # Counted first: the steps are listed only when they may not all fit.
        num_takes: i64 = 0
        p: i64 = 0
        while p < n:
            r = rl[p]
            k = r.kv_handle
            h = k if isinstance(k, Held) and k.owner is self else held[r.req_id]
            j: i64 = len(h.blocks) * bs - (r.num_computed_tokens if cl is None else cl[p])
            if j < steps:
                num_takes += (steps - j + bs - 1) // bs
            p += 1
        if num_takes <= free:
            return num_steps
        takes = []
        for q in range(n):
            r = rl[q]
            k = r.kv_handle
            g = k if isinstance(k, Held) and k.owner is self else held[r.req_id]
            j2 = len(g.blocks) * bs - (r.num_computed_tokens if cl is None else cl[q])
            while j2 < steps:
                takes.append(j2)
                j2 += bs
        takes.sort()
        return takes[free]

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        # Findable now: a forward writes all new K/V before any attention reads them.
        if not self.enable_prefix_caching:
            return
        bs, rec = self.block_size, self._record(req)
        if rec is None:
            raise KeyError(req.req_id)  # only a holder registers blocks
        table = rec.blocks
        full = min(num_tokens, req.num_tokens) // bs
        start = rec.registered
        if full <= start:
            return
        hashes = req.block_hashes(bs, full)
        for j in range(start, full):
            b, h = table[j], hashes[j]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.block_tokens[b] = tuple(req.token_ids(j * bs, (j + 1) * bs))
                self.cached.setdefault(h, b)
        rec.registered = full

    def free(self, req: Request) -> None:
        if self._implicit_rc:  # this class's _forget_count, inline: one lookup, not two
            h = self.held.pop(req.req_id, None)
            if h is None:
                return
            self.live_tokens -= h.count
            h.count = 0
            h.owner = None
            k0: object = req.kv_handle
            if k0 is h:
                req.kv_handle = None
            table0 = h.blocks
            table0.reverse()  # its one holder gone: back on the stack, nothing counted
            self.free_plain += table0
            return
        self._forget_count(req.req_id)
        h = self.held.pop(req.req_id, None)
        if h is None:
            return
        table = h.blocks
        # The record leaves `held`: no handle to it is read again (another object of this id may hold one).
        h.owner = None
        k: object = req.kv_handle  # (typed: `is` against an Any would make h an Any)
        if k is h:
            req.kv_handle = None
        rc, plain = self._rc, self.free_plain
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
        rc, plain, block_hash = self._rc, self.free_plain, self.block_hash
        caching = self.enable_prefix_caching
        if self._implicit_rc:  # each block's one holder: all of them go to the stack
            plain.extend(reversed(blocks))
            return
        for b in reversed(blocks):  # a prefix's tail is evicted before its head
            c = rc[b] - 1
            rc[b] = c
            if c == 0:
                if not caching or block_hash[b] is None:
                    plain.append(b)
                else:
                    self.free_cached[b] = None
            elif c < 0:
                raise AssertionError(f"block {b} freed more often than it was taken")

    def discard(self, req: Request, num_written: int) -> None:
        # Blocks are registered when allocated for a step, before its forward writes them.
        rec = self._record(req)
        if rec is not None and self.enable_prefix_caching:
            for b in rec.blocks[num_written // self.block_size:]:
                h = self.block_hash[b]
                if h is not None:
                    if self.cached.get(h) == b:
                        del self.cached[h]
                    self.block_hash[b] = self.block_tokens[b] = None
        self.free(req)

    def block_table(self, req: Request) -> Sequence[int]:
        h = self._record(req)
        return h.blocks if h is not None else ()

    def _free_blocks(self) -> int:
        """Blocks a new allocation could take: content-free ones and evictable cached ones."""
        return self.num_free_plain() + len(self.free_cached)

    def usage(self) -> KVUsage:
        return self._usage(self._free_blocks())

    def reserved_slots(self) -> int:
        """usage().reserved_slots, without the KVUsage (the decode fast-forward reads it every step)."""
        return self._reserved(self._free_blocks())
