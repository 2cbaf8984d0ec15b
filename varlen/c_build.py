"""Compiling a C source of the project into a shared library in the varlen cache, once per source,
shared headers, compiler, flags, CPU and Python (plus what the caller adds to the key); used by
torch_paged's attention kernel and the fused layer kernels. The headers both include (vec_exp.h)
lie in INCLUDE_DIR, which every build has on its include path."""

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
INCLUDE_DIR = Path(__file__).with_name("csrc")


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


def headers() -> list[Path]:
    """The shared headers (INCLUDE_DIR/*.h), in a fixed order."""
    return sorted(INCLUDE_DIR.glob("*.h"))


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"no working C compiler ({cc}: {err}); install gcc or set CC") from None


def library_path(source: Path, prefix: str, extra_key: Sequence[str] = ()) -> Path:
    """Where build_cached keeps the library built from `source` as things are now: a changed source,
    shared header, compiler, flag, CPU or Python gives another path (and so a fresh build)."""
    from varlen.compiled import cache_dir

    h = hashlib.sha256(source.read_bytes())
    # Every shared header, included or not: a needless rebuild costs seconds, a stale library wrong numbers.
    for header in headers():
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    for part in (_compiler_version(_compiler()), " ".join(CFLAGS + LIBS), _cpu_flags(), *extra_key, sys.version,
                 platform.machine()):
        h.update(part.encode())
    return cache_dir() / f"{prefix}-{h.hexdigest()[:20]}" / f"{source.stem}.so"


def build_cached(source: Path, prefix: str, extra_key: Sequence[str] = (), verbose: bool = False) -> Path:
    """The library built from `source` at library_path(...), compiling it only when missing; raises
    RuntimeError naming the compiler or its error output on failure."""
    target = library_path(source, prefix, extra_key)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [_compiler(), *CFLAGS, f"-I{INCLUDE_DIR}", str(source), "-o", tmp, *LIBS]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {(run.stderr or run.stdout).strip()[-600:]}")
    os.replace(tmp, target)  # atomic: a concurrent reader sees no library or a whole one
    return target
