"""varlen: batched LLM inference on flat varlen batches, with pluggable attention backends,
scheduler policies and KV allocators.

`LLM` (which needs torch) is imported lazily, so the scheduling core and the simulator run
where torch is not installed.
"""

from varlen.compiled import package_path

__path__ = package_path(__name__, __path__)  # the compiled core's modules first, when built

from varlen.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from varlen import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'varlen' has no attribute {name!r}")
