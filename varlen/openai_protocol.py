"""The OpenAI API's request bodies (pydantic) and response bodies (dicts) that `varlen.serve` speaks:
completions and chat completions, streamed or not. Fields varlen does not implement are refused
with a 400 naming them when set to anything but their no-op value, never silently ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from varlen.outputs import CompletionOutput, Logprob
from varlen.sampling_params import SamplingParams


class APIError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | None = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share; unknown fields are refused (a typo would otherwise do nothing)."""
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = 1
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at their no-op values (what clients such as vLLM's benchmark send).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> None:
        for name, noop in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            if v is not None and v != noop:
                raise APIError(f"{name}={v}: not supported by varlen (only {noop}, no penalty)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias: not supported by varlen", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only with stream=true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's settings; a bad value is a 400 naming it (SamplingParams' own check)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
                n=self.n, logprobs=logprobs)
        except ValueError as e:
            raise APIError(str(e).removeprefix("SamplingParams "), param=str(e).split()[1].split("=")[0]) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # 0..5 in OpenAI's API; varlen takes up to 20
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise APIError("echo=true: not supported by varlen (the response holds the completion only)",
                           param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of}: not supported by varlen (only best_of = n)", param="best_of")
        if self.suffix:
            raise APIError("suffix: not supported by varlen", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or a batch: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty: give text or token ids", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: the chat template may read them
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str | None:
        """The content as text: a string, or text parts joined (other parts, e.g. images, refused)."""
        c = self.content
        if c is None or isinstance(c, str):
            return c
        parts = []
        for part in c:
            if part.get("type") != "text":
                raise APIError(f"message content part of type {part.get('type')!r}: varlen serves text only",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context's end
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.tools:
            raise APIError("tools: not supported by varlen", param="tools")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError("response_format: not supported by varlen (plain text only)", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs: only with logprobs=true", param="top_logprobs")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(out: CompletionOutput) -> str | None:
    """OpenAI's reasons are stop and length; an aborted request is reported by the server as an error."""
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def top_k(d: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens of a position (the chosen one among them if it is one), best first."""
    items = list(d.values())
    return items[1:] if len(items) > k else sorted(items, key=lambda lp: lp.rank)


def completion_logprobs(lps: list[dict[int, Logprob]], offset: int, k: int) -> dict[str, Any]:
    """The completions API's logprobs: per token its text, logprob and the top-k (text → logprob)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    at = offset
    for d in lps:
        chosen = next(iter(d.values()))
        tokens.append(chosen.decoded_token)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in top_k(d, k)} or None)
        offsets.append(at)
        at += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(lp: Logprob) -> dict[str, Any]:
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}

    content = []
    for d in lps:
        items = list(d.values())
        content.append({**entry(items[0]), "top_logprobs": [entry(lp) for lp in top_k(d, k)]})
    return {"content": content}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, reason: str | None,
                     logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any], reason: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def now() -> int:
    return int(time.time())

