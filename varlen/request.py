"""A request's life: waiting → running → (preempted → waiting) → finished, with a reason.

Plain data, no torch: the simulator runs the same objects.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from varlen.sampling_params import SamplingParams, _integer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"
    REJECTED = "rejected"


@dataclass(init=False, slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int] | np.ndarray  # an int array is fine (traces), never mutated
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    prompt: str | None = None
    expected_output_len: int | None = None  # known to traces and the `oracle` reservation only

    output_token_ids: list[int] = field(default_factory=list)
    # With sampling.logprobs = k, per output token: (its logprob, its rank, the top-k ids, their logprobs).
    output_logprobs: list[tuple[float, int, list[int], list[float]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    finish_message: str = ""
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_prefix_hit_tokens: int = 0  # of those, reused from the prefix cache at the last admission
    num_preemptions: int = 0

    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    # Where the engine streams this request's token times (Engine.stream_token_times decides, per request)
    # they stay out of token_times: these four are what TTFT, TPOT and the longest gap need.
    streams_token_times: bool = field(default=False, repr=False)
    num_token_times: int = field(default=0, repr=False)
    first_token_time: float = field(default=0.0, repr=False)
    last_token_time: float = field(default=0.0, repr=False)
    max_token_gap: float = field(default=float("-inf"), repr=False)
    finish_time: float | None = None
    _hashes: list[int] = field(default_factory=list, repr=False)
    # Opaque to all but the KV allocator that set it: its record of this request, reached without a lookup
    # by id. That allocator clears it when it frees the request; any other reads None or a record not its own.
    kv_handle: Any = field(default=None, repr=False)  # (Any: a compiled dataclass cannot name `object`)
    # len(prompt_token_ids), kept: read every step, and len() of an array is slow.
    num_prompt_tokens: int = field(init=False, repr=False)

    def __init__(self, req_id: object, prompt_token_ids: list[int] | np.ndarray, sampling: object = None,
                 arrival: object = 0.0, priority: object = 0, prompt: str | None = None,
                 expected_output_len: object = None) -> None:
        """One-line ValueError for a field of the wrong kind; bad prompt ids are the engine's to reject."""
        if not isinstance(req_id, str):
            raise ValueError(f"request id {req_id!r}: must be a string")
        p = _integer(priority)
        if p is None:
            raise ValueError(f"request {req_id!r}: priority={priority!r}: must be an integer (lower runs first)")
        n = None if expected_output_len is None else _integer(expected_output_len)
        if expected_output_len is not None and (n is None or n < 0):
            raise ValueError(f"request {req_id!r}: expected_output_len={expected_output_len!r}: must be None or an "
                             f"integer >= 0")
        if type(arrival) is float:  # nan and inf pass: the engine rejects them, with the reason
            t = arrival
        elif isinstance(arrival, (bool, np.bool_)) or not isinstance(arrival, numbers.Real):
            raise ValueError(f"request {req_id!r}: arrival={arrival!r}: must be a time in seconds (0 = now)")
        else:
            t = float(arrival)
        if sampling is None:
            sp = SamplingParams()
        elif isinstance(sampling, SamplingParams):
            sp = sampling
        else:
            raise ValueError(f"request {req_id!r}: sampling={sampling!r}: must be a SamplingParams")
        self.req_id, self.prompt_token_ids, self.sampling = req_id, prompt_token_ids, sp
        self.arrival, self.priority, self.prompt, self.expected_output_len = t, p, prompt, n
        self.output_token_ids = []
        self.output_logprobs = []
        self.status = Status.WAITING
        self.finish_reason = None
        self.finish_message = ""
        self.num_computed_tokens = self.num_prefix_hit_tokens = self.num_preemptions = 0
        self.first_scheduled = None
        self.token_times = []
        self.streams_token_times = False
        self.num_token_times = 0
        self.first_token_time = self.last_token_time = 0.0
        self.max_token_gap = float("-inf")
        self.finish_time = None
        self._hashes = []
        self.kv_handle = None
        self.num_prompt_tokens = len(prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to be computed before the next sample (the whole prompt, a rest of it, or 1)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self, start: int = 0, end: int | None = None) -> Sequence[int] | np.ndarray:
        """Tokens [start, end) of prompt + output (a list, or an array slice for array prompts)."""
        end = self.num_tokens if end is None else end
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[max(0, start - p):end - p]]

    def block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Chained content hashes of the first `num_blocks` full blocks (equal hashes: equal prefixes)."""
        hashes = self._hashes
        if len(hashes) < num_blocks:
            toks = np.asarray(self.token_ids(0, num_blocks * block_size), dtype=np.int64)
            parent = hashes[-1] if hashes else 0
            for j in range(len(hashes), num_blocks):
                parent = hash((parent, toks[j * block_size:(j + 1) * block_size].tobytes()))
                hashes.append(parent)
        return hashes[:num_blocks]

    def finish(self, reason: FinishReason, now: float, message: str = "") -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_message = message
        self.finish_time = now

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: its blocks are gone, everything will be computed again."""
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions += 1
        self.kv_handle = None  # its blocks were freed; no record of them may be reached from here


def prompt_problem(ids: object, vocab_size: int) -> str:
    """One line naming the first bad token id for a model of `vocab_size` tokens ("" if none): each an
    integer (never a bool or float, which int() would truncate) in [0, vocab_size)."""
    want = f"token ids are integers in [0, {vocab_size})"
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            return f"prompt token ids have shape {ids.shape}: give one flat sequence; {want}"
        if ids.dtype.kind not in "iu":
            return f"prompt token ids have dtype {ids.dtype}: {want}"
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        return f"prompt token {int(bad[0])} is {int(ids[bad[0]])}: {want}" if bad.size else ""
    if not isinstance(ids, (list, tuple)):
        return f"prompt is {type(ids).__name__}, not a list of token ids"
    for i, t in enumerate(ids):
        if type(t) is not int and (isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))):
            return f"prompt token {i} is {t!r} ({type(t).__name__}): {want}"
        if not 0 <= t < vocab_size:
            return f"prompt token {i} is {t}: {want}"
    return ""


#: results_columns' answer: each list one field of every request, in order.
Columns = tuple[list["FinishReason | None"], list[str], list[str], list[float], list["float | None"],
                list["float | None"], list[int], list[int], list[int], list[int], list[int], list[list[float]],
                list[int], list[float], list[float], list[float]]


def results_columns(reqs: list[Any]) -> Columns | None:
    """The fields RequestResults.add keeps, read off every request in one pass (compiled: native reads,
    where a getter per field and request costs ~10x more): finish_reason, req_id, finish_message, arrival,
    first_scheduled, finish_time, num_prompt_tokens, num_output_tokens, num_preemptions,
    num_prefix_hit_tokens, priority, token_times, num_token_times, first_token_time, last_token_time,
    max_token_gap. None where one is not exactly a Request (a subclass's properties are read as they are)."""
    reasons: list[FinishReason | None] = []
    ids: list[str] = []
    messages: list[str] = []
    arrival: list[float] = []
    scheduled: list[float | None] = []
    finish: list[float | None] = []
    prompt: list[int] = []
    output: list[int] = []
    preemptions: list[int] = []
    hits: list[int] = []
    priority: list[int] = []
    times: list[list[float]] = []
    streamed: list[int] = []
    first: list[float] = []
    last: list[float] = []
    longest: list[float] = []
    for o in reqs:
        if type(o) is not Request:
            return None
        r: Request = o
        reasons.append(r.finish_reason)
        ids.append(r.req_id)
        messages.append(r.finish_message)
        arrival.append(r.arrival)
        scheduled.append(r.first_scheduled)
        finish.append(r.finish_time)
        prompt.append(r.num_prompt_tokens)
        output.append(len(r.output_token_ids))
        preemptions.append(r.num_preemptions)
        hits.append(r.num_prefix_hit_tokens)
        priority.append(r.priority)
        times.append(r.token_times)
        streamed.append(r.num_token_times)
        first.append(r.first_token_time)
        last.append(r.last_token_time)
        longest.append(r.max_token_gap)
    return (reasons, ids, messages, arrival, scheduled, finish, prompt, output, preemptions, hits, priority, times,
            streamed, first, last, longest)
