"""A CPU backend that attends over the paged KV cache in place: no per-step copy of any context.

One call per layer covers the whole varlen batch (prefills, chunks, decodes; causal,
bottom-right aligned; GQA): a small C kernel (backends/csrc/paged_attention.c, OpenMP over
(request, KV head, query tile) units, online softmax block by block) reads each request's K/V
blocks where they lie, through its block table. It runs fp32 and bf16; fp16 goes to the fallback.

The kernel is plain C loaded with ctypes, not a torch extension: it builds in about a second with
the system C compiler (a torch extension needs ~30 s of C++ against torch's headers, plus ninja).
It is built at first use, not at import, into the varlen cache (VARLEN_CACHE_DIR or
~/.cache/varlen, `paged-attn-<hash>`), the hash covering its source, the compiler and its flags,
the CPU's instruction sets (it is built for this CPU) and the torch/Python build, so a build is
never used stale. `python -m backends.torch_paged` builds it ahead (scripts/setup.sh does).
Without a C compiler, or if the build fails, a warning says why and the backend runs
`torch_sdpa`'s code instead: correct, with its copies. VARLEN_PAGED_KERNEL=0 forces that fallback.

Batch invariance: every query row is computed by one thread, in a fixed order, from its own
request's data only, so the kernel is batch-invariant as it stands; the fallback is torch_sdpa's
invariant mode. `batch_invariant=True` therefore costs nothing here beyond the model's tiled GEMMs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.base import AttentionBackend, AttentionMetadata, write_kv
from varlen.batch import ForwardBatch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11")
_ELEM = {torch.float32: 4, torch.bfloat16: 2}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"


def build_key(compiler_version: str) -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (compiler_version, " ".join(CFLAGS), _cpu_flags(), torch.__version__, sys.version, platform.machine()):
        h.update(part.encode())
    return h.hexdigest()[:20]


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (once per key); returns the shared library. Raises on failure."""
    from varlen.compiled import cache_dir

    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"no working C compiler ({cc}: {err}); install gcc or set CC") from None
    target = cache_dir() / f"paged-attn-{build_key(version)}" / "paged_attention.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *CFLAGS, str(SOURCE), "-o", tmp]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {(run.stderr or run.stdout).strip()[-600:]}")
    os.replace(tmp, target)  # atomic: a concurrent reader sees no library or a whole one
    return target


_kernel: Any = None  # the loaded library, False once it failed (warned once per process)


def load_kernel() -> Any:
    """The ctypes library, building it if needed; None (after one warning) if it cannot be had."""
    global _kernel
    if _kernel is None:
        if os.environ.get("VARLEN_PAGED_KERNEL", "1") == "0":
            _kernel = False
        else:
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.varlen_paged_attention
                fn.restype = ctypes.c_int
                i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, ptr, ptr, i32, ptr, i64, ptr, i32,
                               i32, i32, i32, i32, ctypes.c_float, i32]
                lib.varlen_paged_attention_tile.restype = ctypes.c_int
                _kernel = lib
            except (RuntimeError, OSError) as err:
                warnings.warn(f"torch_paged: the C kernel is unavailable ({str(err).splitlines()[0][:300]}); "
                              f"running torch_sdpa's gather-then-SDPA code instead (correct, slower)",
                              RuntimeWarning, stacklevel=3)
                _kernel = False
    return _kernel or None


def work_units(batch: ForwardBatch, tile: int) -> np.ndarray:
    """[U, 3] int32 (request, first query row, end query row): every request's new tokens in tiles
    of `tile` rows, heaviest first (rows x keys), so dynamic scheduling ends with the small ones."""
    q_lens = batch.query_lens.astype(np.int64)
    tiles = -(-q_lens // tile)
    seq = np.repeat(np.arange(batch.num_seqs), tiles)
    first = (np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * tile
    end = np.minimum(first + tile, q_lens[seq])
    keys = batch.seq_lens[seq].astype(np.int64) - q_lens[seq] + end  # keys seen by the tile's last row
    units = np.stack([seq, first, end], axis=1).astype(np.int32)
    return np.ascontiguousarray(units[np.argsort(-(end - first) * keys, kind="stable")])


@dataclass
class PagedMetadata(AttentionMetadata):
    arrays: tuple[np.ndarray, ...] = ()  # kept alive: the kernel reads them through raw pointers
    pointers: tuple[int, ...] = ()  # query_start_loc, seq_lens, block_tables, units
    bt_stride: int = 0
    num_units: int = 0
    fallback: Any = None  # torch_sdpa's metadata when the kernel is not used


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"
    devices = ("cpu",)

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant
        self._sdpa: Any = None

    def _fallback(self) -> Any:
        from backends.torch_sdpa import TorchSdpaBackend

        if self._sdpa is None:
            self._sdpa = TorchSdpaBackend()
        self._sdpa.batch_invariant = self.batch_invariant
        return self._sdpa

    @property
    def uses_kernel(self) -> bool:
        """Builds (or finds) the kernel; False when the backend runs on the fallback."""
        return load_kernel() is not None

    def prepare(self, batch: ForwardBatch, device: torch.device | str) -> PagedMetadata:
        slots = torch.from_numpy(batch.slot_mapping).to(device)
        lib = load_kernel()
        if lib is None:
            return PagedMetadata(slot_mapping=slots, batch=batch, fallback=self._fallback().prepare(batch, device))
        qsl = np.ascontiguousarray(batch.query_start_loc, dtype=np.int32)
        lens = np.ascontiguousarray(batch.seq_lens, dtype=np.int32)
        tables = np.ascontiguousarray(batch.block_tables, dtype=np.int32)
        units = work_units(batch, lib.varlen_paged_attention_tile())
        arrays = (qsl, lens, tables, units)
        return PagedMetadata(slot_mapping=slots, batch=batch, arrays=arrays,
                             pointers=tuple(a.ctypes.data for a in arrays), bt_stride=tables.shape[1],
                             num_units=units.shape[0])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: PagedMetadata, scale: float) -> torch.Tensor:
        elem = _ELEM.get(kv_cache.dtype)
        if meta.fallback is not None or elem is None or q.dtype != kv_cache.dtype:
            if meta.fallback is None:
                meta.fallback = self._fallback().prepare(meta.batch, q.device)
            return self._fallback().forward(q, k, v, kv_cache, meta.fallback, scale)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not kv_cache.is_contiguous():
            raise ValueError("torch_paged needs a contiguous KV cache (allocate it with allocate_kv_cache)")
        if q.stride(-1) != 1:
            q = q.contiguous()
        n, hq, d = q.shape
        hkv = kv_cache.shape[-2]
        out = torch.empty((n, hq, d), dtype=q.dtype)
        qsl, lens, tables, units = meta.pointers
        rc = load_kernel().varlen_paged_attention(
            q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(),
            elem, qsl, lens, meta.batch.num_seqs, tables, meta.bt_stride, units, meta.num_units, hq, hkv, d,
            kv_cache.shape[2], scale, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("torch_paged: the attention kernel could not allocate its scratch memory")
        return out


if __name__ == "__main__":  # build ahead of first use (scripts/setup.sh)
    try:
        print(f"built: {build(verbose=True)}")
    except RuntimeError as err:
        print(f"WARNING: {err}", file=sys.stderr)
        sys.exit(1)
