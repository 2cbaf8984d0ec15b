"""Decoded Azure CSVs kept as .npz, keyed by the file's bytes and the reader's source: a whole
trace loads in milliseconds instead of a pandas parse. Only a file that decoded cleanly is
cached, so every error still comes from the reader; a broken cache only costs the parse."""

from __future__ import annotations

import functools
import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np

from varlen.traces import azure, trace
from varlen.traces.azure import read_azure_csv
from varlen.traces.trace import Columns, check_compression, is_gz

#: Decoded traces kept in the cache (each a few hundred KB for a public trace's size).
TRACE_CACHE_KEEP = 16


def trace_cache_dir() -> Path | None:
    """$VARLEN_TRACE_CACHE (a folder; "0" or "off": no cache), else `traces/` in the compiled
    core's cache folder (VARLEN_CACHE_DIR, ~/.cache/varlen)."""
    env = os.environ.get("VARLEN_TRACE_CACHE")
    if env is not None and env.strip().lower() in ("0", "off", "false", "no", ""):
        return None
    if env:
        return Path(env)
    from varlen.compiled import cache_dir

    return cache_dir() / "traces"


@functools.lru_cache(maxsize=1)
def _reader_key() -> bytes:
    # An edit to the reader may change what a file decodes to: an entry names the reader's source.
    src = b"".join(Path(m.__file__).read_bytes() for m in (azure, trace))
    return hashlib.blake2b(src, digest_size=16).digest()


def read_azure_cached(path: Path) -> Columns:
    folder = trace_cache_dir()
    if folder is None:
        return read_azure_csv(path)
    try:
        check_compression(path)  # gzip bytes under a plain name are an error however they were cached
        data = path.read_bytes()
        # The name says how the bytes are read (gzip or not): part of the key, with the content.
        key = hashlib.blake2b(data + (b".gz" if is_gz(path) else b""), digest_size=20, key=_reader_key()).hexdigest()
    except OSError:
        return read_azure_csv(path)  # the reader says why, naming the file
    entry = folder / f"azure-{key}.npz"
    try:
        with np.load(entry, allow_pickle=False) as z:
            arrival, prompt, output = z["arrival"], z["prompt"], z["output"]
        if (arrival.dtype == np.float64 and prompt.dtype == output.dtype == np.int64
                and arrival.ndim == prompt.ndim == output.ndim == 1 and len(arrival) == len(prompt) == len(output)):
            try:
                os.utime(entry)  # recently used: the last to be pruned
            except OSError:
                pass
            return Columns(arrival, prompt, output, np.arange(len(prompt)))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or damaged: read the file and write it anew
    cols = read_azure_csv(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{entry.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, arrival=cols.arrival, prompt=cols.prompt, output=cols.output)
        os.replace(tmp, entry)  # atomic: a reader sees no entry or a whole one
        old = sorted(folder.glob("azure-*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)[TRACE_CACHE_KEEP:]
        for p in old:
            p.unlink(missing_ok=True)
    except OSError:
        pass
    return cols
