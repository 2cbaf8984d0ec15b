"""Builds the mypyc-compiled scheduling core (see varlen/compiled.py for how it is used).

    python -m varlen.compile [--force] [--status]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from varlen.compiled import MODULES, PACKAGES, ROOT, build_dir, status


def build(force: bool = False) -> Path:
    """Compile MODULES with mypyc into build_dir(); returns it. Raises with the reason on failure."""
    target = build_dir()
    if (target / "COMPLETE").is_file() and not force:
        return target
    try:
        import mypyc  # noqa: F401
    except ImportError:
        raise RuntimeError('mypyc is not installed: pip install -e ".[fast]" (or pip install mypy)') from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="varlen-mypyc-") as tmp:
        work = Path(tmp)
        for rel in MODULES:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, work / rel)
        for pkg in PACKAGES:  # empty package markers, parents included: module names come from the folders
            parts = pkg.split(".")
            for i in range(1, len(parts) + 1):
                (work.joinpath(*parts[:i]) / "__init__.py").touch()
        # Imports from outside MODULES (numpy, hydra, ...) are taken as untyped.
        cmd = [sys.executable, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=skip", *MODULES]
        print(f"compiling {len(MODULES)} modules with mypyc (about a minute) ...", file=sys.stderr, flush=True)
        run = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"mypyc failed ({' '.join(cmd)}):\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        for so in work.rglob("*.so"):
            if "build" in so.relative_to(work).parts:
                continue  # setuptools' intermediate copies
            rel = so.relative_to(work)
            # The runtime library alone on sys.path: a folder holding varlen/ would shadow the real package.
            dest = staging / ("lib" if len(rel.parts) == 1 else "pkgs") / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, dest)
        (staging / "COMPLETE").write_text(" ".join(MODULES) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a reader sees no build or a whole one
    prune(keep=KEEP_BUILDS)
    return target


#: Builds kept in the cache (each ~2 MB), the most recently used: switching branches or VARLEN_CORE groups reuses them.
KEEP_BUILDS = 8


def prune(keep: int) -> None:
    """Delete all but the `keep` most recently used builds (built, or loaded by an import: compiled.mark_used)."""
    builds = sorted(build_dir().parent.glob("core-*/COMPLETE"), key=lambda p: p.stat().st_mtime, reverse=True)
    for done in builds[keep:]:
        shutil.rmtree(done.parent, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description="Build (or report) the mypyc-compiled scheduling core.")
    p.add_argument("--status", action="store_true", help="only say which core an import gets")
    p.add_argument("--force", action="store_true", help="rebuild even if a build of these sources exists")
    args = p.parse_args()
    if not args.status:
        try:
            print(f"built: {build(args.force)}")
        except RuntimeError as err:
            raise SystemExit(f"error: {err}") from None
        print("an import gets: " + subprocess.run(
            [sys.executable, "-c", "import varlen.compiled as c; print(c.status())"],
            capture_output=True, text=True, check=True).stdout.strip())
    else:
        print(status())


if __name__ == "__main__":
    main()
