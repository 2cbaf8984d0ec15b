"""KV allocators: `paged` (blocks, reference counts, prefix caching) and `contiguous` (static reservation)."""

from varlen.kv.base import KVAllocator, KVUsage
from varlen.kv.contiguous import ContiguousAllocator
from varlen.kv.paged import PagedAllocator

__all__ = ["KVAllocator", "KVUsage", "PagedAllocator", "ContiguousAllocator"]
