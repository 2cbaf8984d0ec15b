"""Requests from a workload config (a trace or a prompt file), for `varlen.run` and `sim.run`."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from varlen.request import Request
from varlen.sampling_params import SamplingParams
from varlen.traces import SyntheticTrace, Trace, load_trace, synth_prompt_tokens

#: The commands' own knobs (replay: varlen.run; token_ids: sim.run; path, max_tokens: a prompt file).
COMMAND_KEYS = ("replay", "token_ids", "path", "max_tokens")
TRACE_KEYS = {"source", "kind", "limit", "rate", "time_scale", "max_model_len", "over_length"}
SYNTHETIC_KEYS = {f.name for f in dataclasses.fields(SyntheticTrace)} - {"requests", "rate"}
RENAMED = {"target_rate": "rate", "num_requests": "limit"}


def trace_requests(trace: Trace, vocab_size: int, sampling: SamplingParams, offline: bool = False,
                   token_ids: bool = True) -> list[Request]:
    """One Request per trace entry, max_tokens its output length. token_ids=False: zero prompts,
    enough for a simulation without prefix caching and far cheaper than synthesised tokens."""
    reqs = []
    # Views of one read-only zero array, one SamplingParams per output length: a whole trace loads fast.
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
    """(trace or None for a prompt file, the commands' options). `limit` requests at `rate` req/s:
    generated so for a synthetic source; a recorded trace's first `limit`, rescaled to `rate`."""
    cfg = dict(cfg)
    options = {k: cfg.pop(k) for k in COMMAND_KEYS if k in cfg}
    if options.get("replay", "offline") not in ("offline", "arrivals"):
        raise ValueError(f"workload.replay must be 'offline' or 'arrivals', got {options['replay']!r}")
    if "path" in options:
        return None, options
    for old, new in RENAMED.items():
        if old in cfg:
            raise ValueError(f"workload.{old} was renamed to workload.{new}")
    source = name = cfg.pop("source", "synthetic")
    if str(source) == "synthetic" or cfg.get("kind") == "synthetic":
        cfg.pop("kind", None)
        spec = {k: cfg.pop(k) for k in SYNTHETIC_KEYS if k in cfg}
        for knob, field in (("limit", "requests"), ("rate", "rate")):
            if cfg.get(knob) is not None:
                spec[field] = cfg.pop(knob)
        source = SyntheticTrace(**spec)
    unknown = sorted(set(cfg) - TRACE_KEYS)
    if unknown:
        fix = "it is for source=synthetic" if unknown[0] in SYNTHETIC_KEYS else "remove it"
        raise ValueError(f"workload.{unknown[0]} is not a setting of workload source {name!r}; {fix}")
    return load_trace(source, **cfg), options
