"""Decoded Azure CSVs kept as .npz, keyed by the file's bytes and the reader's source: milliseconds
instead of a pandas parse. Only clean decodes are cached, so every error comes from the reader. An
entry holds a digest of its arrays keyed by its name: one whose arrays do not match (damaged, or
another file's columns put in its place) is never used; the source is read again, saying so."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

from varlen.traces import azure, trace
from varlen.traces.azure import read_azure_csv
from varlen.traces.trace import Columns, check_compression, is_gz

TRACE_CACHE_KEEP = 16  # entries, a few hundred KB each for a public trace


def trace_cache_dir() -> Path | None:
    """$VARLEN_TRACE_CACHE ("off": none), else traces/ in varlen's cache folder (~/.cache/varlen)."""
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
    src = b"".join(Path(m.__file__).read_bytes() for m in (azure, trace, sys.modules[__name__]))
    return hashlib.blake2b(src, digest_size=16).digest()


def _digest(key: str, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """The entry's arrays hashed under its key: the same columns under another file's name do not match."""
    h = hashlib.blake2b(key.encode(), digest_size=20)
    for a in (arrival, prompt, output):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(h.digest(), np.uint8)


def read_azure_cached(path: Path) -> Columns:
    folder = trace_cache_dir()
    if folder is None:
        return read_azure_csv(path)
    try:
        check_compression(path)  # gzip bytes under a plain name are an error however they were cached
        data = path.read_bytes()  # the name says how they are read (gzip or not): part of the key
        key = hashlib.blake2b(data + (b".gz" if is_gz(path) else b""), digest_size=20, key=_reader_key()).hexdigest()
    except OSError:
        return read_azure_csv(path)
    entry = folder / f"azure-{key}.npz"
    try:
        with np.load(entry, allow_pickle=False) as z:
            arrival, prompt, output = z["arrival"], z["prompt"], z["output"]
            stored = z["digest"] if "digest" in z.files else None
        if stored is None or not np.array_equal(stored, _digest(key, arrival, prompt, output)):
            print(f"trace cache: {entry} does not match its digest (damaged or replaced); reading {path} again",
                  file=sys.stderr)
        elif (arrival.dtype == np.float64 and prompt.dtype == output.dtype == np.int64
                and arrival.ndim == prompt.ndim == output.ndim == 1 and len(arrival) == len(prompt) == len(output)):
            try:
                os.utime(entry)
            except OSError:
                pass
            return Columns(arrival, prompt, output, np.arange(len(prompt)))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # missing or damaged: written anew
    cols = read_azure_csv(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{entry.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, arrival=cols.arrival, prompt=cols.prompt, output=cols.output,
                     digest=_digest(key, cols.arrival, cols.prompt, cols.output))
        os.replace(tmp, entry)  # atomic: a reader sees no entry or a whole one
        old = sorted(folder.glob("azure-*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)[TRACE_CACHE_KEEP:]
        for p in old:
            p.unlink(missing_ok=True)
    except OSError:
        pass
    return cols
