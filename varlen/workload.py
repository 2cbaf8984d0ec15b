"""Requests from a workload config (a trace or a prompt file), for `varlen.run` and `sim.run`."""

from __future__ import annotations

import dataclasses
from itertools import repeat
from typing import Any, Mapping, Sequence, overload

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
                   token_ids: bool = True, lazy: bool = False) -> "list[Request] | TraceRequests":
    """One Request per trace entry, max_tokens its output length. token_ids=False: zero prompts,
    enough for a simulation without prefix caching and far cheaper than synthesised tokens.
    lazy: a TraceRequests, each request built when it is first read (a simulation's arrivals)."""
    reqs = TraceRequests(trace, vocab_size, sampling, offline, token_ids)
    return reqs if lazy else [reqs.build(i) for i in range(len(reqs))]


class TraceRequests(Sequence[Request]):
    """A trace's requests as columns, each Request built when first read and kept until `release`d:
    a simulation that releases ended requests (sim/release.py) holds those in flight, not every
    request of the trace. Reads as a sequence of the Requests trace_requests would build."""

    def __init__(self, trace: Trace, vocab_size: int, sampling: SamplingParams, offline: bool = False,
                 token_ids: bool = True) -> None:
        rows = trace.requests
        n = len(rows)
        #: Each request's arrival (s), in the trace's order.
        self.arrivals = np.zeros(n) if offline else np.fromiter((r.arrival_s for r in rows), np.float64, n)
        self._prompt = np.fromiter((r.prompt_len for r in rows), np.int64, n)
        self._output = np.fromiter((r.output_len for r in rows), np.int64, n)
        self._ids = [r.req_id or str(i) for i, r in enumerate(rows)]
        self._rows = rows if token_ids else None  # synthesised prompts read the rows (Mooncake's hash ids)
        self._vocab_size, self._sampling = vocab_size, sampling
        # Views of one read-only zero array, one SamplingParams per output length: a whole trace loads fast.
        self._zeros = np.zeros(0 if token_ids else int(self._prompt.max(initial=0)), dtype=np.int64)
        self._zeros.flags.writeable = False
        # The columns read item by item as Python numbers (memoryviews: no copy), as each request is built.
        self._arrival_s, self._prompt_lens, self._output_lens = map(memoryview, (self.arrivals, self._prompt,
                                                                                self._output))
        self._params: dict[int, SamplingParams] = {}
        self._views: dict[int, np.ndarray] = {}  # prompt length -> its zero prompt (token_ids=False), shared
        self._made: dict[int, Request] = {}
        self._released = bytearray(n)  # 1: released
        self._placeholder: Request | None = None

    def __len__(self) -> int:
        return len(self._ids)

    def build(self, i: int) -> Request:
        """Request `i`, newly built (not kept)."""
        out = self._output_lens[i]
        sp = self._params.get(out)
        if sp is None:
            sp = self._params[out] = dataclasses.replace(self._sampling, max_tokens=out)
        return Request(self._ids[i], self._prompt_of(i, self._prompt_lens[i]), sp, self._arrival_s[i], 0, None, out)

    def _prompt_of(self, i: int, length: int) -> Any:
        rows = self._rows
        if rows is not None:
            return synth_prompt_tokens(rows[i], self._vocab_size)
        view = self._views.get(length)
        if view is None:
            view = self._views[length] = self._zeros[:length]
        return view

    def _span(self, start: int, stop: int) -> list[Request]:
        """self[start:stop]: the requests not built yet built in one pass, their columns read at once."""
        made, released, params, ids = self._made, self._released, self._params, self._ids
        out: list[Request] = []
        arrivals = self.arrivals[start:stop].tolist()
        prompts = self._prompt[start:stop].tolist()
        outputs = self._output[start:stop].tolist()
        n = stop - start
        if self._rows is None and not released[start:stop].count(1) and \
                not any(map(made.__contains__, range(start, stop))):
            # Arrivals in order: none built or released yet, so all made at once, by no bytecode per request.
            views = self._views
            for length in set(prompts).difference(views):
                views[length] = self._zeros[:length]
            for o in set(outputs).difference(params):
                params[o] = dataclasses.replace(self._sampling, max_tokens=o)
            out = list(map(Request, ids[start:stop], map(views.__getitem__, prompts), map(params.__getitem__, outputs),
                           arrivals, repeat(0, n), repeat(None, n), outputs))
            made.update(zip(range(start, stop), out))
            return out
        for j in range(n):
            i = start + j
            r = made.get(i)
            if r is None:
                if released[i]:
                    assert self._placeholder is not None
                    r = self._placeholder
                else:
                    o = outputs[j]
                    sp = params.get(o)
                    if sp is None:
                        sp = params[o] = dataclasses.replace(self._sampling, max_tokens=o)
                    r = made[i] = Request(ids[i], self._prompt_of(i, prompts[j]), sp, arrivals[j], 0, None, o)
            out.append(r)
        return out

    @overload
    def __getitem__(self, i: int) -> Request: ...

    @overload
    def __getitem__(self, i: slice) -> list[Request]: ...

    def __getitem__(self, i: int | slice) -> Request | list[Request]:
        if type(i) is int:
            r = self._made.get(i)  # a request in flight: read twice or more
            if r is not None:
                return r
            if 0 <= i < len(self._released) and not self._released[i]:  # an arrival: built now
                r = self._made[i] = self.build(i)
                return r
        elif isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return self._span(start, max(start, stop))
            return [self[j] for j in range(start, stop, step)]
        n = len(self._ids)
        if not -n <= i < n:
            raise IndexError(f"request {i} out of range ({n} requests)")
        i = int(i) % n
        r = self._made.get(i)
        if r is None:
            if self._released[i]:
                assert self._placeholder is not None
                return self._placeholder
            r = self._made[i] = self.build(i)
        return r

    def read(self, positions: list[int]) -> list[Request]:
        """self[p] for each of `positions`: those in flight read at once."""
        get = self._made.get
        return [get(p) or self[p] for p in positions]

    def release(self, i: int, placeholder: Request) -> None:
        """Request `i` dropped (its figures are kept elsewhere); reads of it give `placeholder` from now on."""
        self.release_all([i], placeholder)

    def release_all(self, positions: list[int], placeholder: Request) -> None:
        """release(p, placeholder) for each of `positions` (0 <= p < len(self))."""
        pop, released = self._made.pop, self._released
        for p in positions:
            pop(p, None)
            released[p] = 1
        self._placeholder = placeholder


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
