"""Requests from a trace (or a prompt file), shared by `varlen.run` and the simulator. No torch."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.traces import Trace, load_trace, synth_prompt_tokens


def trace_requests(trace: Trace, vocab_size: int, sampling: SamplingParams, offline: bool = False,
                   token_ids: bool = True) -> list[Request]:
    """One Request per trace entry: prompt tokens synthesised from the trace (identical Mooncake
    hash ids give identical blocks), max_tokens = the trace's output length.

    token_ids=False gives zero-filled prompts: enough for a simulation without prefix caching,
    and far cheaper than synthesising millions of tokens.
    """
    reqs = []
    # Zero prompts: read-only views of one array (prompts are never written), and one
    # SamplingParams per output length: a whole trace loads in a fraction of a second.
    zeros = np.zeros(0 if token_ids else max((tr.prompt_len for tr in trace.requests), default=0), dtype=np.int64)
    zeros.flags.writeable = False
    params: dict[int, SamplingParams] = {}
    for i, tr in enumerate(trace.requests):
        prompt = synth_prompt_tokens(tr, vocab_size) if token_ids else zeros[:tr.prompt_len]
        sp = params.get(tr.output_len)
        if sp is None:
            sp = params[tr.output_len] = dataclasses.replace(sampling, max_tokens=tr.output_len)
        reqs.append(Request(tr.req_id or str(i), prompt, sp, arrival=0.0 if offline else tr.arrival_s,
                            expected_output_len=tr.output_len))
    return reqs


def load_workload(cfg: Mapping[str, Any]) -> tuple[Trace | None, dict[str, Any]]:
    """Split a workload config into the trace (None for a prompt file) and the driver options."""
    cfg = dict(cfg)
    options = {k: cfg.pop(k) for k in ("replay", "path", "max_tokens") if k in cfg}
    if options.get("replay", "offline") not in ("offline", "arrivals"):
        raise ValueError(f"workload.replay must be 'offline' or 'arrivals', got {options['replay']!r}")
    if "path" in options:  # a prompt file
        return None, options
    return load_trace(**cfg), options
