"""The scheduling core compiled with mypyc: the very same source, run as C extension modules.

The simulator spends its time in the engine loop, the policies and the allocators, which are
plain typed Python. mypyc compiles those modules as they are (no second implementation to keep
in step), which makes a simulation about 2x faster. The build is optional: without it,
or when it does not match the sources, the pure-Python modules run, with the same results
(tests/engine/test_compiled_core.py compares the two).

    python -m varlen.compile           # build (needs `pip install -e ".[fast]"` and a C compiler)
    python -m varlen.compile --status  # which core an import gets, and why

A build lives in a cache folder named by a hash of the compiled sources and the Python build, so
editing any core module makes the build unused (never stale) until it is rebuilt.
VARLEN_PURE=1 forces the pure-Python core; VARLEN_CACHE_DIR moves the cache (default
$XDG_CACHE_HOME/varlen or ~/.cache/varlen).

Each package of the core (PACKAGES, from MODULES) calls `package_path` from its __init__ so that
its modules are looked up in the build folder first. Either every core module
is compiled or none is: compiled modules call each other's classes natively, and would reject
pure-Python instances of them.
"""

from __future__ import annotations

import abc
import hashlib
import importlib.abc
import importlib.machinery
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the folder holding the varlen, schedulers and sim packages

#: The compiled modules: the hot ones, which a simulation step runs (everything else, such as
#: configuration, trace loading and reports, stays Python). Classes meant to be subclassed
#: (policies, allocators, executors, cost models) allow interpreted subclasses, so user code plugs
#: in as before.
MODULES = (
    # the engine loop and the types it touches every step
    "varlen/request.py", "varlen/sampling_params.py", "varlen/clock.py", "varlen/steplog.py", "varlen/engine.py",
    # the policies
    "varlen/scheduler_api.py", "schedulers/chunked.py", "schedulers/continuous.py", "schedulers/static.py",
    "schedulers/priority.py", "schedulers/vllm_v0.py", "schedulers/sarathi.py",
    # the allocators
    "varlen/kv/base.py", "varlen/kv/paged.py", "varlen/kv/contiguous.py",
    # the simulator's event loop, its executor and the decode fast-forward
    "sim/simulator.py", "sim/executor.py", "sim/fast_forward.py",
    # the cost models' step-time code, and the shapes it reads (compiled, its arithmetic stays on
    # native floats and ints: read from an uncompiled class, each value is an object, and the
    # whole formula boxed)
    "sim/cost/base.py", "sim/cost/roofline.py", "sim/cost/fitted.py", "sim/cost/replay.py", "sim/cost/measured.py",
    "sim/cost/communication.py", "sim/cost/hardware.py",
)
#: The packages holding them (each calls `package_path` from its __init__), derived from MODULES.
PACKAGES = tuple(sorted({".".join(Path(rel).parent.parts) for rel in MODULES}))


def build_key() -> str:
    """Names the build of these exact sources for this exact Python."""
    h = hashlib.sha256(f"{sys.version}|{sys.platform}|{platform.machine()}".encode())
    for rel in MODULES:
        h.update(rel.encode())
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()[:20]


def cache_dir() -> Path:
    base = os.environ.get("VARLEN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "varlen"
    return Path(base)


def build_dir() -> Path:
    return cache_dir() / f"core-{build_key()}"


_state: tuple[Path | None, str] | None = None  # (active build folder, why), decided once per process


def _decide() -> tuple[Path | None, str]:
    global _state
    if _state is None:
        if os.environ.get("VARLEN_PURE", "") not in ("", "0"):
            _state = (None, "pure Python (VARLEN_PURE is set)")
        else:
            try:
                d = build_dir()
            except OSError as e:  # a source not readable: an unusual install, run what is there
                _state = (None, f"pure Python (cannot hash the core's sources: {e})")
            else:
                if (d / "COMPLETE").is_file():
                    sys.path.append(str(d / "lib"))  # the modules' shared runtime library (top level)
                    sys.meta_path.insert(0, _OwnAbcCaches())
                    _state = (d, f"compiled ({d})")
                else:
                    _state = (None, "pure Python (no compiled build of these sources: "
                                    "`python -m varlen.compile` makes one)")
    return _state


#: The compiled modules' dotted names.
MODULE_NAMES = frozenset(".".join(Path(rel).with_suffix("").parts) for rel in MODULES)


class _OwnAbcCaches:
    """Gives each class of a compiled module its own ABC caches. mypyc builds a class without
    ABCMeta.__new__, so a compiled class inherits its base's `_abc_impl` (ultimately abc.ABC's):
    the caches of isinstance/issubclass are then shared, and one answer leaks into another (after
    issubclass(PagedAllocator, KVAllocator), issubclass(PagedAllocator, SchedulerPolicy) was True).
    A meta-path finder wraps the compiled modules' loader and, once a module has run, initialises
    each class as ABCMeta would have (abc._abc_init)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in MODULE_NAMES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            spec.loader = _AbcInitLoader(spec.loader)
        return spec


class _AbcInitLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        # Every compiled module loaded so far: a compiled module imports others of its build
        # without the finders, so they are seen here, after the import that loaded them.
        for name in MODULE_NAMES & sys.modules.keys():
            for obj in list(vars(sys.modules[name]).values()):
                if isinstance(obj, abc.ABCMeta) and obj.__module__ == name and any(
                        getattr(base, "_abc_impl", None) is obj._abc_impl for base in obj.__mro__[1:]):
                    abc._abc_init(obj)  # type: ignore[attr-defined]


def package_path(package: str, path: list[str]) -> list[str]:
    """A core package's __path__, with the build's folder for it first when the build is used."""
    d, _ = _decide()
    if d is None:
        return path
    return [str(d.joinpath("pkgs", *package.split("."))), *path]


def status() -> str:
    """Which core this process runs: 'compiled (folder)' or 'pure Python (why)'."""
    return _decide()[1]


def is_compiled() -> bool:
    return _decide()[0] is not None
