"""Compiling a C source of the project into a shared library in the varlen cache, once per source,
compiler, flags, CPU and Python (plus what the caller adds to the key); used by torch_paged's
attention kernel and the fused layer kernels."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=gnu11")
LIBS = ("-lm",)


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


def build_cached(source: Path, prefix: str, extra_key: Sequence[str] = (), verbose: bool = False) -> Path:
    """The library built from `source` at VARLEN_CACHE_DIR/<prefix>-<key>/<stem>.so, compiling it
    only when missing; raises RuntimeError naming the compiler or its error output on failure."""
    from varlen.compiled import cache_dir

    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"no working C compiler ({cc}: {err}); install gcc or set CC") from None
    h = hashlib.sha256(source.read_bytes())
    for part in (version, " ".join(CFLAGS + LIBS), _cpu_flags(), *extra_key, sys.version, platform.machine()):
        h.update(part.encode())
    target = cache_dir() / f"{prefix}-{h.hexdigest()[:20]}" / f"{source.stem}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *CFLAGS, str(source), "-o", tmp, *LIBS]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {(run.stderr or run.stdout).strip()[-600:]}")
    os.replace(tmp, target)  # atomic: a concurrent reader sees no library or a whole one
    return target
