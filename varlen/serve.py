"""`python -m varlen.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one LLM.

    python -m varlen.serve                                  # the tiny default model on 127.0.0.1:8000
    python -m varlen.serve model.path=/my/hf/folder scheduler=sarathi server.port=9000

Every HTTP request feeds the LLM's one engine loop, so requests from different clients are batched
together (continuous batching); a client that disconnects aborts its request, freeing its KV.
Endpoints: /v1/completions, /v1/chat/completions (streamed as server-sent events or not),
/v1/models, /health. Options: conf/run/serve.yaml (the model, backend, scheduler and allocator
groups and engine.* as `varlen.run`'s, plus server.*)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any, AsyncIterator, Sequence

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError as e:  # the `serve` extra
    raise ImportError(f"varlen.serve needs FastAPI and uvicorn: pip install \"varlen[serve]\" ({e})") from None

from varlen.llm import LLM, CompletionStream
from varlen.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, chat_logprobs,
                                    completion_chunk, completion_logprobs, error_body, finish_reason, new_id, now,
                                    usage)
from varlen.engine_loop import wait_async
from varlen.outputs import RequestOutput


def build_app(llm: LLM, model_name: str, chat_template: str | None = None) -> Any:
    """The FastAPI app serving `llm` as `model_name`; `chat_template`: a Jinja template replacing the
    tokenizer's own."""
    app = FastAPI(title="varlen", docs_url=None, redoc_url=None)
    app.state.llm = llm
    started = now()

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_line(e.errors())), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "varlen", "root": llm.model_path,
                                            "max_model_len": llm.engine.max_model_len}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(f"model {name!r} is not served here; this server serves {model_name!r} (GET /v1/models)",
                           status=404, kind="not_found_error", param="model")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.unsupported()
        sp = body.sampling_params(body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        streams = submit_all(llm, body.prompts(), sp)
        rid, created = new_id("cmpl"), now()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            def chunk(i: int, text: str, reason: str | None, lps: Any, first: bool, offset: int) -> dict:
                return completion_chunk(rid, created, model_name, i, text, reason,
                                        None if lps is None else completion_logprobs(lps, offset, sp.logprobs or 0))
            return await stream_response(streams, request, chunk, rid, created, model_name, "text_completion",
                                         include_usage, StreamingResponse)
        outs = await finished_outputs(streams, request)
        choices = [{"index": i * sp.n + c.index, "text": c.text, "finish_reason": finish_reason(c),
                    "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, 0, sp.logprobs or 0)}
                   for i, o in enumerate(outs) for c in o.outputs]
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": usage_of(outs)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.unsupported()
        ids = chat_prompt(llm, body, chat_template)
        limit = body.limit()
        sp = body.sampling_params(limit if limit is not None else max(1, llm.engine.max_model_len - len(ids)),
                                  body.num_logprobs())
        streams = submit_all(llm, [ids], sp)
        rid, created = new_id("chatcmpl"), now()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            def chunk(i: int, text: str, reason: str | None, lps: Any, first: bool, offset: int) -> dict:
                delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
                return chat_chunk(rid, created, model_name, i, delta, reason,
                                  None if lps is None else chat_logprobs(lps, sp.logprobs or 0))
            return await stream_response(streams, request, chunk, rid, created, model_name, "chat.completion.chunk",
                                         include_usage, StreamingResponse)
        outs = await finished_outputs(streams, request)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": finish_reason(c),
                    "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, sp.logprobs or 0)}
                   for o in outs for c in o.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name, "choices": choices,
                "usage": usage_of(outs)}

    return app


def validation_line(errors: Sequence[Any]) -> str:
    """pydantic's first complaint as one line: where and what (the body's field, not its path)."""
    if not errors:
        return "invalid request"
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    if e.get("type") == "extra_forbidden":
        return f"{where}: unknown field (not an OpenAI API field varlen serves)"
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('msg')}"
    if not where:
        return f"the request body must be a JSON object ({e.get('msg')})"
    return f"{where}: {e.get('msg')}" if where else str(e.get("msg"))


def submit_all(llm: LLM, prompts: Sequence[Any], sp: Any) -> list[CompletionStream]:
    """Each prompt on the engine loop; a prompt the API cannot take is a 400 (the ones before it aborted)."""
    streams: list[CompletionStream] = []
    try:
        for p in prompts:
            streams.append(llm.submit(p, sp))
    except ValueError as e:
        for s in streams:
            s.abort("the request was refused")
        raise APIError(str(e), param="prompt") from None
    return streams


def chat_prompt(llm: LLM, body: ChatCompletionRequest, template: str | None) -> list[int]:
    tok = llm.tokenizer
    if template is None and tok.chat_template is None:
        raise APIError("this model's tokenizer has no chat template: use /v1/completions, or start the server "
                       "with server.chat_template=PATH (a Jinja file)")
    messages = []
    for m in body.messages:
        extra = m.model_extra or {}
        messages.append({**extra, "role": m.role, "content": m.text()})
    try:
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=body.add_generation_prompt)
    except Exception as e:  # a template's own error (e.g. raise_exception on a bad role order)
        raise APIError(f"the chat template refused the messages: {type(e).__name__}: {e}", param="messages") from None
    return tok(text, add_special_tokens=False).input_ids


def refusal(outs: list[RequestOutput]) -> APIError | None:
    """A request the engine rejected is the caller's (400); one a failed step aborted is the server's (500)."""
    for o in outs:
        for c in o.outputs:
            if c.finish_reason == "rejected":
                return APIError(c.finish_message)
            if c.finish_reason == "aborted":
                return APIError(f"the request was aborted: {c.finish_message}", status=500, kind="server_error")
    return None


def usage_of(outs: list[RequestOutput]) -> dict[str, int]:
    return usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs))


async def until_disconnect(request: Any) -> None:
    """Returns when the client has gone (the body was read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def finished_outputs(streams: list[CompletionStream], request: Any) -> list[RequestOutput]:
    """Every stream's final output; a client that disconnects first aborts them (their KV freed)."""
    engine_streams = [s for cs in streams for s in cs.streams]

    async def all_done() -> None:
        async for _ in wait_async(engine_streams):
            pass

    done, gone = asyncio.ensure_future(all_done()), asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not done.done():
            for s in streams:
                s.abort("the client disconnected")
            done.cancel()
        gone.cancel()
    if not done.done() or done.cancelled():
        raise APIError("the client disconnected", status=499)
    outs = [s.result() for s in streams]
    problem = refusal(outs)
    if problem is not None:
        raise problem
    return outs


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_response(streams: list[CompletionStream], request: Any, chunk: Any, rid: str, created: int,
                          model: str, kind: str, include_usage: bool, response_class: Any) -> Any:
    """Server-sent events: a chunk per completion each time it has new tokens or ends, then the usage (if
    asked) and `data: [DONE]`. The headers go once a first token is out, so a rejected request is
    still a 400; a client that disconnects aborts the requests (the generator is closed)."""
    engine_streams = [s for cs in streams for s in cs.streams]
    news = wait_async(engine_streams)
    n = len(streams[0].streams)
    try:
        async for _ in news:
            if any(tokens or done for tokens, done in (s.state() for s in engine_streams)):
                break
        if all(s.done() for s in engine_streams):
            problem = refusal([s.result() for s in streams])
            if problem is not None and problem.status == 400:
                raise problem
    except BaseException:
        await news.aclose()
        for s in streams:
            s.abort("the client disconnected")
        raise

    async def events() -> AsyncIterator[str]:
        sent_text = [[0] * n for _ in streams]
        sent_tokens = [[0] * n for _ in streams]
        ended = [[False] * n for _ in streams]
        try:
            while True:
                for i, cs in enumerate(streams):
                    out = cs._snapshot()
                    for c in out.outputs:
                        j = c.index
                        # A chunk per step with new tokens, even if their text is held back or empty
                        # (as vLLM's): clients time tokens by chunks.
                        if ended[i][j] or (len(c.token_ids) == sent_tokens[i][j] and not c.finished):
                            continue
                        if c.finish_reason in ("aborted", "rejected"):
                            yield sse(error_body(f"the request ended {c.finish_reason}: {c.finish_message}",
                                                 "server_error", None, 500))
                            ended[i][j] = True
                            continue
                        lps = None if c.logprobs is None else c.logprobs[sent_tokens[i][j]:]
                        yield sse(chunk(i * n + j, c.text[sent_text[i][j]:], finish_reason(c), lps,
                                        sent_tokens[i][j] == 0 and sent_text[i][j] == 0, sent_text[i][j]))
                        sent_text[i][j], sent_tokens[i][j] = len(c.text), len(c.token_ids)
                        ended[i][j] = c.finished
                if all(all(e) for e in ended):
                    break
                try:
                    await news.__anext__()
                except StopAsyncIteration:
                    pass
            if include_usage:
                outs = [cs.result() for cs in streams]
                yield sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                           "usage": usage_of(outs)})
            yield "data: [DONE]\n\n"
        finally:  # closed early: the client went away
            await news.aclose()
            for cs in streams:
                if not cs.done():
                    cs.abort("the client disconnected")

    return response_class(events(), media_type="text/event-stream")


class ServerThread:
    """Serves `app` with uvicorn on a thread (tests, benchmarks, notebooks); the socket is bound
    before it starts, so `port` is known (0: an ephemeral one) and a taken port fails here."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="varlen-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error naming the address and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}): choose another server.port "
                      f"(0: any free one) or server.host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main() -> None:
    import hydra

    import varlen.cli  # noqa: F401  (registers the config's resolvers)
    from varlen.registry import conf_dir

    @hydra.main(config_path=str(conf_dir("run")), config_name="serve", version_base="1.3")
    def _main(cfg: Any) -> None:
        from varlen.attention_api import BackendUnavailable
        from varlen.cli import errors_to_exit, fail, interrupted

        try:
            serve(cfg)
        except errors_to_exit((BackendUnavailable, OSError)) as err:
            fail(str(err))
        except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
            interrupted("stopped serving")

    from varlen.cli import run_cli

    run_cli(_main)


def serve(cfg: Any) -> None:
    """Load the model as `varlen.run` does, then serve until Ctrl-C."""
    from pathlib import Path

    import torch
    from omegaconf import OmegaConf

    from varlen.cli import SettingError, check_missing, number
    from varlen.settings import CLI_NAMES, check_cli_settings

    check_missing(cfg)
    number(cfg, "server.port", low=0, high=65535, integer=True)
    settings = check_cli_settings(cfg)
    template = cfg.server.chat_template
    if template is not None:
        path = Path(str(template))
        if not path.is_file():
            raise SettingError(f"server.chat_template={template!r}: no such file; give a Jinja chat template file")
        template = path.read_text(encoding="utf-8")
    sock = bind(str(cfg.server.host), int(cfg.server.port))  # before the model: a taken port fails at once
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    e = cfg.engine

    def group(name: str) -> dict:
        return OmegaConf.to_container(cfg[name], resolve=False)  # type: ignore[return-value]

    llm = LLM(model=cfg.model.path, backend=group("backend"), scheduler=group("scheduler"),
              allocator=group("allocator"), block_size=e.block_size, num_blocks=e.num_blocks,
              kv_cache_memory=e.kv_cache_memory, max_model_len=e.max_model_len, dtype=e.dtype, device=e.device,
              seed=e.seed, linear_kernel=settings.linear_kernel, setting_names=CLI_NAMES)
    name = cfg.server.served_model_name or str(cfg.model.path)
    app = build_app(llm, name, template)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name!r} ({llm.model_path}) at http://{shown}:{port}/v1 (completions, chat/completions, "
          f"models; /health) | backend {llm.backend.name} | scheduler {llm.engine.policy.name} | allocator "
          f"{type(llm.engine.kv).__name__} | max_model_len {llm.engine.max_model_len} | Ctrl-C stops", flush=True)
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level=cfg.server.log_level, access_log=False)).run(sockets=[sock])


if __name__ == "__main__":
    main()
