"""varlen: batched LLM inference on flat varlen batches, with pluggable attention backends,
scheduler policies and KV allocators.

`LLM` (which needs torch) is imported lazily, so the scheduling core and the simulator run
where torch is not installed.
"""

import sys
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built


def _mount_source_configs() -> None:
    """The configs are the package `varlen.conf`: a wheel ships them as varlen/conf, the source
    tree (and an editable install) keeps them in ../conf. Mounted by path, so that a folder named
    conf/ in the working directory can never stand in for them."""
    here = Path(__file__).parent
    conf = here.parent / "conf"
    if "varlen.conf" in sys.modules or (here / "conf").is_dir() or not (conf / "__init__.py").is_file():
        return
    spec = spec_from_file_location("varlen.conf", conf / "__init__.py", submodule_search_locations=[str(conf)])
    assert spec is not None and spec.loader is not None
    module = module_from_spec(spec)
    sys.modules["varlen.conf"] = module
    spec.loader.exec_module(module)
    setattr(sys.modules[__name__], "conf", module)  # as an import of the submodule would


_mount_source_configs()


class _SiblingsFirst:
    """An editable install's finder comes after the working directory, so a bare folder named like
    a sibling package there (a user's sim/, no __init__.py) would hide it; as in a wheel install,
    the sibling next to varlen wins over such a folder. A user's regular package still wins."""

    NAMES = ("backends", "schedulers", "sim")
    root = str(Path(__file__).parent.parent)

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name not in cls.NAMES:
            return None
        spec = PathFinder.find_spec(name)
        if spec is not None and spec.origin is not None:
            return spec
        return PathFinder.find_spec(name, [cls.root]) or spec


if not any(getattr(f, "__qualname__", "") == "_SiblingsFirst" for f in sys.meta_path):  # once, if re-imported
    sys.meta_path.insert(sys.meta_path.index(PathFinder) if PathFinder in sys.meta_path else 0, _SiblingsFirst)

from varlen.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from varlen import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'varlen' has no attribute {name!r}")
