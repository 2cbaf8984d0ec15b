"""The scheduling core compiled with mypyc: the same source, run as C extension modules.

    python -m varlen.compile           # build (needs `pip install -e ".[fast]"` and a C compiler)
    python -m varlen.compile --status  # which core an import gets, and why

Optional: without a matching build the pure-Python modules run with the same results. Builds are
cached by a hash of the sources; VARLEN_PURE=1 forces pure Python, VARLEN_CORE=engine,policies
compiles only those groups, VARLEN_CACHE_DIR moves the cache. Rules for compiled code:
- a class users may subclass carries @mypyc_attr(allow_interpreted_subclasses=True);
- a compiled class subclasses only compiled groups' classes (NEEDS);
- fields are type-checked on assignment: convert numpy numbers in the constructor;
- a dataclass built every step gets `init=False` and a written __init__;
- long loops call varlen.interrupt.poll() (compiled code never sees Ctrl-C otherwise).
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

#: The modules each group compiles: the code a simulation step runs.
GROUPS: dict[str, tuple[str, ...]] = {
    "engine": ("varlen/request.py", "varlen/sampling_params.py", "varlen/clock.py", "varlen/steplog.py",
               "varlen/engine.py"),
    "policies": ("varlen/scheduler_api.py", "schedulers/chunked.py", "schedulers/continuous.py",
                 "schedulers/static.py", "schedulers/priority.py", "schedulers/vllm_v0.py", "schedulers/sarathi.py"),
    "allocators": ("varlen/kv/base.py", "varlen/kv/paged.py", "varlen/kv/contiguous.py"),
    "simulator": ("sim/simulator.py", "sim/executor.py", "sim/fast_forward.py"),
    "cost": ("sim/cost/base.py", "sim/cost/roofline.py", "sim/cost/fitted.py", "sim/cost/replay.py",
             "sim/cost/measured.py", "sim/cost/communication.py", "sim/cost/hardware.py"),
}
#: Groups another group's classes subclass (FastForwardEngine(Engine)), so must be compiled with it.
NEEDS: dict[str, tuple[str, ...]] = {"simulator": ("engine",)}
#: The groups compiled when VARLEN_CORE is unset: each gains >= 10% (benchmarks/compiled_core.py).
DEFAULT_GROUPS: tuple[str, ...] = tuple(GROUPS)


def core_groups(spec: str | None = None) -> tuple[str, ...]:
    """The groups named by `spec` (VARLEN_CORE's syntax; default: the variable, else DEFAULT_GROUPS)."""
    spec = os.environ.get("VARLEN_CORE", "") if spec is None else spec
    if not spec.strip():
        return DEFAULT_GROUPS
    names = tuple(g for g in GROUPS if g in {s.strip() for s in spec.split(",")})
    unknown = {s.strip() for s in spec.split(",")} - set(GROUPS)
    if unknown:
        raise ValueError(f"VARLEN_CORE={spec}: unknown group(s) {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    for g in names:
        missing = [n for n in NEEDS.get(g, ()) if n not in names]
        if missing:
            raise ValueError(f"VARLEN_CORE={spec}: group {g!r} subclasses {missing}'s classes; add {','.join(missing)}")
    return names


#: Shipped plug-ins kept interpreted on purpose, and why (tests/engine/test_compiled_core.py).
INTERPRETED: dict[str, str] = {
    "schedulers/sjf.py": "compiled, the whole Azure trace took no less CPU (its base classes are compiled)",
    "varlen/kv/windowed.py": "only models with a sliding window use it; a subclass of the compiled PagedAllocator",
    "sim/routers.py": "called once per arrival, not per step",
}
#: The compiled modules, in GROUPS order.
MODULES = tuple(rel for g in core_groups() for rel in GROUPS[g])
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


def mark_used(build: Path) -> None:
    """Stamp a build as just used: pruning (varlen.compile.prune) keeps the most recently used builds, so
    other checkouts' builds never evict the one a checkout keeps running."""
    try:
        os.utime(build / "COMPLETE")
    except OSError:  # a read-only cache: pruning then goes by build time
        pass


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
                    mark_used(d)
                    sys.path.append(str(d / "lib"))
                    sys.meta_path.insert(0, _OwnAbcCaches())
                    part = "" if set(MODULES) == {m for g in GROUPS.values() for m in g} else f"groups {','.join(core_groups())}, "
                    _state = (d, f"compiled ({part}{d})")
                else:
                    _state = (None, "pure Python (no compiled build of these sources: "
                                    "`python -m varlen.compile` makes one)")
    return _state


#: The compiled modules' dotted names.
MODULE_NAMES = frozenset(".".join(Path(rel).with_suffix("").parts) for rel in MODULES)


class _OwnAbcCaches:
    """Needed: mypyc skips ABCMeta.__new__, so compiled classes share abc.ABC's isinstance caches
    and answers leak between them; this finder gives each class its own once its module ran."""

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
        # All loaded so far: a compiled module imports the others of its build past the finders.
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
