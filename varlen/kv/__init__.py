"""KV allocators: `paged` (blocks, reference counts, prefix caching) and `contiguous` (static reservation)."""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from varlen.kv.base import KVAllocator, KVUsage
from varlen.kv.contiguous import ContiguousAllocator
from varlen.kv.paged import PagedAllocator

__all__ = ["KVAllocator", "KVUsage", "PagedAllocator", "ContiguousAllocator"]
