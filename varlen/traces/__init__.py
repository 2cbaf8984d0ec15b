"""Request traces: Azure CSV, Mooncake JSONL, or generated; `load_trace` is the entry point.
Torch-free, and pandas only to read a CSV, so that the simulator starts in a fraction of a second."""

from varlen.traces.load import NAMED_TRACES, default_traces_dir, load_trace, named_trace_path, resolve_trace
from varlen.traces.cache import TRACE_CACHE_KEEP, trace_cache_dir
from varlen.traces.mooncake import MOONCAKE_BLOCK_TOKENS
from varlen.traces.synthetic import LengthDist, SyntheticTrace
from varlen.traces.tokens import synth_prompt_tokens
from varlen.traces.trace import MAX_LENGTH, Trace, TraceFormatError, TraceRequest, TraceStats

__all__ = [
    "MAX_LENGTH", "MOONCAKE_BLOCK_TOKENS", "NAMED_TRACES", "TRACE_CACHE_KEEP", "LengthDist", "SyntheticTrace",
    "Trace", "TraceFormatError", "TraceRequest", "TraceStats", "default_traces_dir", "load_trace",
    "named_trace_path", "resolve_trace", "synth_prompt_tokens", "trace_cache_dir",
]
