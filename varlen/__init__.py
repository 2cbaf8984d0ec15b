"""varlen: batched LLM inference on flat varlen batches, with pluggable attention backends,
scheduler policies and KV allocators.

`LLM` (which needs torch) is imported lazily, so the scheduling core and the simulator run
where torch is not installed.
"""

import sys
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

from varlen.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from varlen import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'varlen' has no attribute {name!r}")
