"""The OpenAI-compatible server driven by the official `openai` client on 127.0.0.1 (an ephemeral
port): streamed text equals non-streamed text, chat through the model's template, concurrent clients
batched on one engine loop each get their alone result, a client leaving mid-stream aborts its
request and frees its KV, stop / n / logprobs through the API, bad requests answered 400."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from varlen import LLM, SamplingParams
from varlen.engine import Executor

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client")
pytest.importorskip("fastapi", reason="varlen.serve needs the serve extra (fastapi, uvicorn)")

from varlen.serve import ServerThread, build_app  # noqa: E402

GREEDY = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
PROMPTS = ["Hello world! Once upon a time", "The quick brown fox", "def forward(self, x):", "Pack my box"]


def wait_for(condition, what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


class GateExecutor(Executor):
    """Steps only while `open` is set: a test holds the engine at a chosen point."""

    def __init__(self, inner: Executor):
        self.inner, self.open = inner, threading.Event()
        self.open.set()
        self.budget: int | None = None  # steps to run before closing the gate; None again once closed
        self.rows = getattr(inner, "rows", None)

    def execute(self, scheduled, kv):
        if self.budget is not None:
            if self.budget == 0:
                self.open.clear()
                self.budget = None
            else:
                self.budget -= 1
        assert self.open.wait(60), "the test never opened the gate"
        return self.inner.execute(scheduled, kv)

    def release(self, req):
        self.inner.release(req)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"], block_size=4, max_model_len=128, max_num_batched_tokens=64,
              max_num_seqs=16)
    llm.engine.executor = GateExecutor(llm.engine.executor)
    return llm


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(build_app(llm, "tiny-test")) as srv:
        wait_for(lambda: srv.server.started, "uvicorn started")
        assert httpx.get(f"{srv.url}/health").status_code == 200
        yield srv


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def assert_idle(llm: LLM) -> None:
    wait_for(lambda: not llm.engine.requests and llm.engine.kv.usage().live_tokens == 0, "the engine idle")
    assert llm.engine.kv.usage().reserved_slots == 0


def alone(llm: LLM, prompt, max_tokens: int = 20) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].text


def test_models_lists_the_served_model(client, llm):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-test"] and models[0].max_model_len == 128


def test_streamed_completion_equals_the_non_streamed_one(client, llm):
    full = client.completions.create(model="tiny-test", prompt=PROMPTS[0], **GREEDY)
    chunks = list(client.completions.create(model="tiny-test", prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text == alone(llm, PROMPTS[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    assert full.usage.prompt_tokens == len(llm.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids)
    # a chunk for each step with new tokens, whatever their text (logprobs=0 lists each chunk's tokens)
    chunks = list(client.completions.create(model="tiny-test", prompt=PROMPTS[0], stream=True, logprobs=0, **GREEDY))
    assert all(c.choices[0].logprobs.tokens for c in chunks)
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 20


def test_a_chunk_goes_out_for_new_tokens_whose_text_is_held_back(server, llm):
    gate = llm.engine.executor
    gate.budget = 1  # the prefill step gives the first token, then the engine waits
    body = {"model": "tiny-test", "prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "stop": "\x00" * 50, "logprobs": 0}  # never matched: holds back all the text
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: {"))
            first = json.loads(next(lines).removeprefix("data: "))["choices"][0]
            assert first["text"] == "" and len(first["logprobs"]["tokens"]) == 1 and first["finish_reason"] is None
            wait_for(lambda: gate.budget is None, "the engine waiting at its gate")  # else it would close it after
            gate.open.set()
            rest = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines]
    finally:
        gate.budget = None
        gate.open.set()
    want = alone(llm, PROMPTS[3], max_tokens=10)
    assert rest[-1]["finish_reason"] == "length" and rest[-1]["text"] == want  # all held back to the end
    assert sum(len(c["logprobs"]["tokens"]) for c in [first, *rest]) == 10


def test_chat_applies_the_template_streamed_or_not(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    full = client.chat.completions.create(model="tiny-test", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny-test", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids.endswith("<|assistant|>") and "<|user|>Hello world!" in ids
    assert full.choices[0].message.content == alone(llm, llm.tokenizer(ids, add_special_tokens=False).input_ids)


def test_concurrent_clients_are_batched_on_one_loop_and_each_gets_its_alone_result(server, llm):
    want = [alone(llm, p) for p in PROMPTS]
    gate = llm.engine.executor
    gate.open.clear()  # hold the engine until every client's request is queued
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            if i % 2:
                chunks = c.completions.create(model="tiny-test", prompt=PROMPTS[i], stream=True, **GREEDY)
                results[i] = "".join(ch.choices[0].text for ch in chunks)
            else:
                results[i] = c.completions.create(model="tiny-test", prompt=PROMPTS[i], **GREEDY).choices[0].text
        except BaseException as err:  # shown by the assertion below
            errors.append(err)

    workers = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    try:
        for w in workers:
            w.start()
        wait_for(lambda: len(llm.loop._live) == len(PROMPTS), "every client's request queued")
        ids = {s.request_id for s in llm.loop._live.values()}
    finally:
        gate.open.set()
    for w in workers:
        w.join(600)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == want
    assert any(len(ids & set(s.req_ids)) == len(PROMPTS) for s in llm.engine.steps), "one batch held every client"
    assert_idle(llm)


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_kv(server, llm):
    gate = llm.engine.executor
    body = {"model": "tiny-test", "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            gate.open.clear()  # the engine waits at its next step: the request is mid-generation
            [stream] = llm.loop._live.values()
            req = stream.request
            used = llm.engine.kv.usage().live_tokens
            assert used > 0 and not req.is_finished
        # the connection is closed here
    try:
        wait_for(lambda: llm.loop._aborts or req.is_finished, "the server asking for the abort")
    finally:
        gate.open.set()
    wait_for(lambda: req.is_finished, "the request ending")
    assert req.finish_reason.value == "aborted" and req.finish_message == "the client disconnected"
    assert 0 < len(req.output_token_ids) < 100
    assert_idle(llm)


def test_a_client_leaving_a_non_streamed_request_aborts_it(server, llm):
    gate = llm.engine.executor
    gate.budget = 1  # one step (the prefill), then the engine waits: the response cannot be ready
    body = {"model": "tiny-test", "prompt": PROMPTS[0], "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
        [stream] = llm.loop._live.values()
        req = stream.request
        wait_for(lambda: llm.loop._aborts, "the server asking for the abort")
        wait_for(lambda: gate.budget is None, "the engine waiting at its gate")
    finally:
        gate.budget = None
        gate.open.set()
    wait_for(lambda: req.is_finished, "the request ending")
    assert req.finish_reason.value == "aborted" and req.finish_message == "the client disconnected"
    assert len(req.output_token_ids) < 50
    assert_idle(llm)


def test_stop_n_and_logprobs_through_the_api(client, llm):
    text = alone(llm, PROMPTS[2])
    stop = text[5:7]
    got = client.completions.create(model="tiny-test", prompt=PROMPTS[2], stop=["\x00", stop], **GREEDY)
    assert got.choices[0].text == text[:text.index(stop)] and got.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny-test", prompt=PROMPTS[2], stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == got.choices[0].text

    sampled = dict(max_tokens=10, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    many = client.completions.create(model="tiny-test", prompt=[PROMPTS[0], PROMPTS[1]], n=2, logprobs=2, **sampled)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and many.usage.completion_tokens == 40
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=2, ignore_eos=True),
                        use_tqdm=False)
    assert [c.text for c in many.choices] == [c.text for o in outs for c in o.outputs]
    for c in many.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
        assert "".join(lp.tokens) == c.text and all(x <= 0 for x in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)

    chat = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 20
    assert all(t.top_logprobs[0].logprob == t.logprob and len(t.top_logprobs) == 3 for t in content)  # greedy
    assert_idle(llm)


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens=0: must be an integer >= 1"),
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature=-1.0: must be a finite number >= 0"),
    ({"prompt": "Hi", "n": 0}, 400, "n=0: must be an integer >= 1"),
    ({"prompt": "Hi", "logprobs": 50}, 400, "logprobs=50: must be None or an integer in [0, 20]"),
    ({"prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty=0.5: not supported by varlen"),
    ({"prompt": "Hi", "echo": True}, 400, "echo=true: not supported by varlen"),
    ({"prompt": "Hi", "temprature": 0}, 400, "temprature: unknown field"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt token 2 is 1000000: token ids are integers in [0, "),
    ({"prompt": "Hi " * 200}, 400, "longer than max_model_len (128 tokens)"),
    ({"prompt": "Hi", "stream": True, "max_tokens": -3}, 400, "max_tokens=-3"),
    ({"prompt": [1] * 200, "stream": True}, 400, "longer than max_model_len (128 tokens)"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here; this server serves 'tiny-test'"),
])
def test_bad_requests_get_one_clear_error_in_openais_shape(server, llm, body, status, message):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-test", **body}, timeout=600)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert message in err["message"] and "\n" not in err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["code"] == status
    assert_idle(llm)


def test_a_body_that_is_not_a_json_object_is_a_400(server):
    for content in (b"{not json", b"[1, 2]"):
        resp = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and "request body" in resp.json()["error"]["message"]
