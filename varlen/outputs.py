"""What `LLM.generate` and `LLM.submit` return: per prompt a RequestOutput holding its `n` completions,
each with its text (detokenized incrementally as tokens come, cut before a stop string) and, when
asked, per-token logprobs. Shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from varlen.metrics import RequestMetrics
from varlen.request import FinishReason, Request


@dataclass
class Logprob:
    """One token's log-probability under the model (fp32 log-softmax of the logits the sampler saw,
    before temperature or top-k/top-p cuts), its rank (1 = the most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    """One completion of a prompt; while it streams, `finish_reason` and `metrics` are None."""
    index: int  # which of the prompt's n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None  # length | stop | aborted | rejected
    finish_message: str
    stop_reason: str | int | None  # the stop string or stop token id that ended it (None: EOS or no stop)
    logprobs: list[dict[int, Logprob]] | None  # per token: the chosen token first, then the top-k
    cumulative_logprob: float | None
    metrics: RequestMetrics | None
    request_id: str  # the engine request that made it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt's output: `outputs` holds its n completions. `text`, `token_ids`, `finish_reason`,
    `finish_message`, `metrics` and `logprobs` are the first completion's (the only one when n = 1)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def finish_message(self) -> str:
        return self.outputs[0].finish_message

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


class Completion:
    """One engine request's output as its tokens come. The text grows by decoding a short window of
    tokens (the last emitted one and the new ones), so streaming costs O(new tokens) per step, and
    text once shown never changes; bytes of an unfinished character wait for the rest. With stop
    strings, the engine loop calls `check_stop` after each step and a stream holds back the last
    (longest stop - 1) characters, which a stop string may still claim."""

    def __init__(self, request: Request, index: int, decode: Callable[[list[int]], str],
                 token_text: Callable[[int], str]):
        self.request, self.index = request, index
        self._decode, self._token_text = decode, token_text
        self._stops = request.sampling.stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._lock = threading.Lock()
        self._text = ""
        self._ends = [0]  # _ends[i]: the text's length once the first i tokens were read
        self._prefix = self._read = 0  # the decode window: tokens [_prefix, _read) gave the text's tail
        self._cut: int | None = None  # where the stop string starts
        self._stop_string: str | None = None
        self._logprobs: list[dict[int, Logprob]] = []

    def _advance(self, n: int) -> None:
        seen = len(self._ends) - 1
        if n <= seen:
            return
        ids = self.request.output_token_ids
        before = self._decode(ids[self._prefix:self._read])
        full = self._decode(ids[self._prefix:n])
        old = len(self._text)
        if len(full) > len(before) and not full.endswith("\ufffd"):
            self._text += full[len(before):]
            self._prefix, self._read = self._read, n
        self._ends.extend([old] * (n - seen - 1))
        self._ends.append(len(self._text))

    def check_stop(self, r: Request) -> str | None:
        """On the engine loop's thread after a step gave `r` tokens: the message ending it if its text
        now holds a stop string (found where a new one can end: from the last hold-back chars on)."""
        if self._cut is not None or not self._stops:
            return None
        with self._lock:
            start = max(0, len(self._text) - self._hold)
            self._advance(len(r.output_token_ids))
            hits = [(i, s) for s in self._stops if (i := self._text.find(s, start)) >= 0]
            if not hits:
                return None
            self._cut, self._stop_string = min(hits)
        return f"stop string {self._stop_string!r} generated"

    def output(self, r: Request, num_tokens: int, finished: bool) -> CompletionOutput:
        """The completion after its first `num_tokens` tokens; `finished`: the final one."""
        with self._lock:
            self._advance(num_tokens)
            if not finished:
                end = self._ends[num_tokens] - (self._hold if self._stops else 0)
                text = self._text[:max(0, min(end, len(self._text) if self._cut is None else self._cut))]
            elif self._cut is not None:
                text = self._text[:self._cut]
            else:  # what an unfinished character's bytes give, now that no more come
                ids = r.output_token_ids[:num_tokens]
                text = self._text + self._decode(ids[self._prefix:])[len(self._decode(ids[self._prefix:self._read])):]
            logprobs = self._logprob_dicts(r, num_tokens)
        ids = list(r.output_token_ids[:num_tokens])
        reason = r.finish_reason.value if finished and r.finish_reason is not None else None
        stop_reason: str | int | None = None
        if reason == FinishReason.STOP.value:
            stop_reason = self._stop_string if self._stop_string is not None else \
                ids[-1] if ids and ids[-1] in r.sampling.stop_token_ids else None
        return CompletionOutput(
            index=self.index, text=text, token_ids=ids, finish_reason=reason,
            finish_message=r.finish_message if finished else "", stop_reason=stop_reason,
            logprobs=logprobs, cumulative_logprob=None if logprobs is None else
            sum(next(iter(d.values())).logprob for d in logprobs),
            metrics=RequestMetrics.of(r) if finished else None, request_id=r.req_id)

    def _logprob_dicts(self, r: Request, n: int) -> list[dict[int, Logprob]] | None:
        if r.sampling.logprobs is None:
            return None
        have = self._logprobs
        for i in range(len(have), min(n, len(r.output_logprobs), len(r.output_token_ids))):
            chosen, rank, top_ids, top_lps = r.output_logprobs[i]
            tok = r.output_token_ids[i]
            d = {tok: Logprob(chosen, rank, self._token_text(tok))}
            for j, (t, lp) in enumerate(zip(top_ids, top_lps)):
                if t not in d:
                    d[t] = Logprob(lp, j + 1, self._token_text(t))
            have.append(d)
        return have[:n]


def token_text_cache(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """Each token id's own text, decoded once."""
    cache: dict[int, str] = {}

    def text(t: int) -> str:
        s = cache.get(t)
        if s is None:
            s = cache[t] = decode([t])
        return s
    return text


def request_output(request_id: str, prompt: str | None, prompt_token_ids: Any,
                   outputs: list[CompletionOutput]) -> RequestOutput:
    return RequestOutput(request_id, prompt, list(prompt_token_ids), outputs)
