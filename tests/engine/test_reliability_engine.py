"""No input poisons the engine (issue 11, engine and API side).

A bad prompt or sampling value ends its own request `rejected` (naming the request and the value)
while the others run; a step that raises (a failing executor, Ctrl-C) aborts its requests with the
error's message and leaves queues and KV consistent, so the next call works and is not served a
stale prefix cache; timestamps of a request are ordered; bad engine settings are one clear line
(API ValueError, CLI exit 2); a long-lived LLM does not grow.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from schedulers import ChunkedPolicy
from sim.fast_forward import FastForwardEngine, FastForwardExecutor
from varlen import LLM, SamplingParams, registry
from varlen.clock import SimClock, WallClock
from varlen.engine import Engine, Executor
from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.request import Request
from varlen.settings import check_engine_settings

VOCAB = 512  # the tiny model's
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (9, 17, 5)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


def make_llm(model_dir, **kw):
    kw = dict(dict(block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4), **kw)
    return LLM(model_dir, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    """One LLM shared by the tests that must leave it usable (each checks it is idle after)."""
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_idle(engine: Engine) -> None:
    """Nothing left anywhere: no queued or running request, no KV held, no executor row."""
    assert not engine.policy.waiting and not engine.policy.running and not engine.requests
    usage = engine.kv.usage()
    assert usage.live_tokens == 0 and usage.reserved_slots == 0
    rows = getattr(engine.executor, "rows", None)
    assert not rows


class FailingExecutor(Executor):
    """Wraps an executor; its call number `fail_at` raises `error` (before the inner one runs)."""

    def __init__(self, inner: Executor, fail_at: int, error: BaseException):
        self.inner, self.fail_at, self.error, self.calls = inner, fail_at, error, 0
        self.rows = getattr(inner, "rows", None)

    def execute(self, scheduled, kv):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.inner.execute(scheduled, kv)

    def release(self, req):
        self.inner.release(req)


# -- bad requests: rejected, the others finish ------------------------------------------------
BAD_TOKENS = [VOCAB, -1, 10**30, 1.5, 2.0, True, np.float32(3), np.bool_(True), None, "7"]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_bad_token_id_is_rejected_and_the_others_finish(llm, expected, bad):
    outs = llm.generate([PROMPTS[0], [5, bad, 6], PROMPTS[1], PROMPTS[2]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "length", "length"]
    msg = outs[1].finish_message
    assert msg.startswith(f"request {outs[1].request_id!r}: prompt token 1 is {bad!r}"), msg
    assert msg.endswith(f"token ids are integers in [0, {VOCAB})") and "\n" not in msg
    assert [o.token_ids for o in outs[:1] + outs[2:]] == expected
    assert_idle(llm.engine)


def test_bad_prompt_arrays_are_rejected(llm, expected):
    outs = llm.generate([np.array([3, 4.5]), np.array([3, VOCAB]), np.array(PROMPTS[0], dtype=np.uint16)], GREEDY)
    assert [o.finish_reason for o in outs] == ["rejected", "rejected", "length"]
    assert "dtype float64" in outs[0].finish_message and f"token 1 is {VOCAB}" in outs[1].finish_message
    assert outs[2].token_ids == expected[0]


def test_malformed_prompts_raise_before_anything_runs(llm):
    for bad in ([PROMPTS[0], 5], [PROMPTS[0], b"ab"], [PROMPTS[0], {"a": 1}]):
        with pytest.raises(ValueError, match="prompt 1 is a .*: give text"):
            llm.generate(bad, GREEDY)
    with pytest.raises(ValueError, match=r"sampling_params\[1\] is a dict"):
        llm.generate(PROMPTS[:2], [GREEDY, {"max_tokens": 3}])
    assert_idle(llm.engine)


BAD_SAMPLING = [("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", True), ("temperature", math.nan),
                ("temperature", math.inf), ("temperature", -0.5), ("temperature", "1"), ("top_p", math.nan),
                ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("seed", -1), ("seed", 2**64),
                ("seed", 1.0), ("stop_token_ids", "12"), ("stop_token_ids", [1.5]), ("stop_token_ids", [-3]),
                ("ignore_eos", "false")]


@pytest.mark.parametrize("field,value", BAD_SAMPLING, ids=repr)
def test_bad_sampling_params_raise_one_line(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"SamplingParams {field}={value!r}: ") and "\n" not in msg


# Values of a field's own type (so even the compiled class accepts them) that are out of range.
bad_field_values = st.one_of(
    st.tuples(st.just("temperature"), st.one_of(st.just(math.nan), st.just(math.inf), st.floats(max_value=-1e-9))),
    st.tuples(st.just("top_p"), st.one_of(st.just(math.nan), st.just(-math.inf), st.floats(max_value=0.0),
                                          st.floats(min_value=1.0, exclude_min=True))),
    st.tuples(st.just("top_k"), st.integers(max_value=-1)),
    st.tuples(st.just("max_tokens"), st.integers(max_value=0)),
    st.tuples(st.just("seed"), st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64))),
    st.tuples(st.just("stop_token_ids"), st.lists(st.integers(max_value=-1), min_size=1, max_size=3).map(tuple)),
)


def stub_engine(policy="chunked", allocator="paged", clock=None, executor=None, engine=Engine):
    cls = registry.target("scheduler", policy)
    pol = cls(max_num_seqs=4, max_num_batched_tokens=16 if cls.chunked_prefill else 64)
    kv = PagedAllocator(40, 4, 64) if allocator == "paged" else ContiguousAllocator(40, 4, 64)
    clock = SimClock() if clock is None else clock
    return engine(pol, kv, executor or StubExecutor(clock), clock=clock, max_model_len=64, eos_token_id=1,
                  vocab_size=VOCAB)


class StubExecutor(Executor):
    """A stand-in model: token 7 for every sample; moves a simulated clock by 1 ms a step."""

    def __init__(self, clock=None):
        self.clock = clock

    def execute(self, scheduled, kv):
        if isinstance(self.clock, SimClock):
            self.clock.advance(1e-3)
        return [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in scheduled]


@given(bad=bad_field_values, position=st.integers(0, 2))
def test_out_of_range_sampling_set_after_construction_is_rejected(bad, position):
    field, value = bad
    eng = stub_engine()
    reqs = [Request(str(i), [3 + i] * 5, SamplingParams(max_tokens=3)) for i in range(3)]
    sp = SamplingParams(max_tokens=3)
    setattr(sp, field, value)  # plain fields: nothing stops a caller doing this
    reqs[position].sampling = sp
    eng.run(reqs)
    for i, r in enumerate(reqs):
        if i == position:
            assert r.finish_reason.value == "rejected"
            assert r.finish_message.startswith(f"request '{i}': sampling {field}=") and "\n" not in r.finish_message
        else:
            assert r.finish_reason.value == "length" and r.output_token_ids == [7, 7, 7]
    assert_idle(eng)


bad_tokens = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.booleans(),
                       st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=2),
                       st.integers(0, VOCAB - 1).map(float))


@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), bad=bad_tokens, data=st.data())
def test_any_bad_token_anywhere_rejects_only_its_request(prompt, bad, data):
    at = data.draw(st.integers(0, len(prompt)), label="at")
    bad_prompt = prompt[:at] + [bad] + prompt[at:]
    eng = stub_engine()
    reqs = [Request("ok", prompt, SamplingParams(max_tokens=2)),
            Request("bad", bad_prompt, SamplingParams(max_tokens=2))]
    eng.run(reqs)
    assert reqs[0].finish_reason.value == "length"
    assert reqs[1].finish_reason.value == "rejected"
    assert reqs[1].finish_message.startswith(f"request 'bad': prompt token {at} is ")
    assert_idle(eng)


def test_stop_ids_outside_the_vocabulary_are_rejected(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, stop_token_ids=[VOCAB + 5]))[0]
    assert out.finish_reason == "rejected" and f"{VOCAB + 5} is outside the vocabulary" in out.finish_message


# -- a step that raises: its requests aborted, engine consistent, next call right ------------
def test_failing_forward_aborts_and_the_next_call_is_correct(model_dir):
    # The first step (every prompt's prefill) fails in the middle of the model: the prefix cache
    # had registered those blocks for the step, so the same prompts again would hit blocks whose
    # KV was never written if the failed step's blocks stayed findable.
    llm = make_llm(model_dir, max_num_batched_tokens=64)
    expected = [o.token_ids for o in make_llm(model_dir).generate(PROMPTS, GREEDY)]
    real_forward, calls = llm.backend.forward, []

    def forward(*args, **kw):
        calls.append(1)
        if len(calls) == 2:  # the second layer of the first step
            raise RuntimeError("injected attention failure")
        return real_forward(*args, **kw)

    llm.backend.forward = forward
    with pytest.raises(RuntimeError, match="injected attention failure") as e:
        llm.generate(PROMPTS, GREEDY)
    assert any("3 requests ended aborted" in n for n in e.value.__notes__)
    assert_idle(llm.engine)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_failing_executor_aborts_its_step_and_the_rest_of_the_run(model_dir, fail_at):
    llm = make_llm(model_dir)
    inner = llm.engine.executor
    llm.engine.executor = FailingExecutor(inner, fail_at, RuntimeError("device lost"))
    reqs = llm.make_requests(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.run(reqs)
    assert all(r.finish_reason.value == "aborted" for r in reqs)
    in_step = [r for r in reqs if r.finish_message.startswith(f"step {fail_at - 1} failed: RuntimeError: device lost")]
    rest = [r for r in reqs if r.finish_message == "the run stopped: RuntimeError: device lost"]
    assert in_step and len(in_step) + len(rest) == len(reqs)
    assert_idle(llm.engine)
    llm.engine.executor = inner
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    assert {r for s in llm.engine.steps for r in s.req_ids} == {o.request_id for o in outs}


@given(policy=st.sampled_from(registry.names("scheduler")), allocator=st.sampled_from(["paged", "contiguous"]),
       fail_at=st.integers(1, 12), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6))
def test_a_failure_at_any_step_leaves_the_engine_consistent(policy, allocator, fail_at, lengths):
    eng = stub_engine(policy, allocator)
    stub = eng.executor
    eng.executor = failing = FailingExecutor(stub, fail_at, ValueError("boom"))
    reqs = [Request(f"a{i}", [5] * n, SamplingParams(max_tokens=5)) for i, n in enumerate(lengths)]
    try:
        eng.run(reqs)
    except ValueError:
        ended = [r.finish_reason.value for r in reqs]
        assert "aborted" in ended and set(ended) <= {"aborted", "length"}
        assert all("ValueError: boom" in r.finish_message for r in reqs if r.finish_reason.value == "aborted")
    else:
        assert failing.calls < fail_at
    assert_idle(eng)
    eng.executor = stub
    again = [Request(f"b{i}", [5] * n, SamplingParams(max_tokens=5)) for i, n in enumerate(lengths)]
    eng.run(again)
    assert all(r.finish_reason.value == "length" for r in again)
    assert_idle(eng)


def test_an_executor_returning_the_wrong_number_of_tokens_fails_loudly():
    class Short(StubExecutor):
        def execute(self, scheduled, kv):
            return super().execute(scheduled, kv)[:-1]

    eng = stub_engine(executor=Short())
    reqs = [Request(str(i), [5] * 4, SamplingParams(max_tokens=2)) for i in range(2)]
    with pytest.raises(RuntimeError, match="returned 1 tokens for a batch of 2 requests"):
        eng.run(reqs)
    assert_idle(eng)


# -- Ctrl-C inside generate ------------------------------------------------------------------
def test_keyboard_interrupt_aborts_the_call_and_the_next_one_starts_clean(llm, expected):
    inner = llm.engine.executor
    llm.engine.executor = FailingExecutor(inner, 3, KeyboardInterrupt())
    first = llm.make_requests(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.run(first)
    finally:
        llm.engine.executor = inner
    assert all(r.finish_reason.value == "aborted" and "KeyboardInterrupt" in r.finish_message for r in first)
    assert_idle(llm.engine)
    outs = llm.generate(PROMPTS, GREEDY)
    # Only the new requests ran: none of the interrupted batch was finished first.
    assert {r for s in llm.engine.steps for r in s.req_ids} == {o.request_id for o in outs}
    assert [o.token_ids for o in outs] == expected
    assert all(len(r.output_token_ids) < 20 for r in first)


def test_interrupt_between_steps_aborts_requests_not_yet_arrived():
    eng = stub_engine()
    reqs = [Request("now", [5] * 4, SamplingParams(max_tokens=8)),
            Request("later", [5] * 4, SamplingParams(max_tokens=8), arrival=100.0)]

    def on_step(done):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.run(reqs, on_step=on_step)
    assert reqs[0].finish_message == "the run stopped: KeyboardInterrupt"
    assert reqs[1].finish_reason.value == "aborted" and "before this request arrived" in reqs[1].finish_message
    assert reqs[1].finish_time >= reqs[1].arrival
    assert_idle(eng)


# -- timestamps of one request are ordered ---------------------------------------------------
def assert_ordered(r: Request) -> None:
    t = [r.arrival]
    if r.first_scheduled is not None:
        t.append(r.first_scheduled)
    t += r.token_times
    t.append(r.finish_time)
    assert all(a <= b for a, b in zip(t, t[1:])), (r.req_id, r.finish_reason, t)


@given(policy=st.sampled_from(registry.names("scheduler")), wall=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6), st.sampled_from([0.0, 0.0, 1e-4, 2e-3])),
                     min_size=1, max_size=6))
def test_timestamps_of_a_request_are_ordered(policy, wall, reqs):
    clock = WallClock() if wall else SimClock()
    eng = stub_engine(policy, clock=clock)
    rs = [Request(str(i), [5] * n, SamplingParams(max_tokens=m), arrival=a) for i, (n, m, a) in enumerate(reqs)]
    eng.run(rs)
    for r in rs:
        assert_ordered(r)


def test_timestamps_are_ordered_on_the_real_engine(llm):
    reqs = llm.make_requests(PROMPTS + [[]], GREEDY)
    llm.run(reqs)
    for r in reqs:
        assert_ordered(r)
    assert reqs[0].arrival <= reqs[0].first_scheduled


# -- a long-lived LLM does not grow ----------------------------------------------------------
def test_many_generate_calls_keep_the_engine_bounded(llm):
    seeded = SamplingParams(max_tokens=2, temperature=1.0, seed=5, ignore_eos=True)
    for _ in range(12):
        outs = llm.generate(PROMPTS, seeded)
        eng = llm.engine
        assert not eng.requests and not llm.executor.rows and not llm.executor.sampler.generators
        # The step log is this call's only (what its metrics need).
        assert {r for s in eng.steps for r in s.req_ids} == {o.request_id for o in outs}


# -- engine settings: one line naming the setting, the value and the fix ---------------------
BAD_SETTINGS = [
    (dict(dtype="float33"), "dtype='float33': is not a dtype"),
    (dict(dtype=torch.int64), "dtype=torch.int64: is not a dtype"),
    (dict(device="gpu"), "device='gpu': is not a device"),
    (dict(block_size="abc"), "block_size='abc': must be an integer >= 1"),
    (dict(block_size=0), "block_size=0: must be an integer >= 1"),
    (dict(block_size=4.0), "block_size=4.0: must be an integer >= 1"),
    (dict(seed="abc"), r"seed='abc': must be an integer in \[0, 2\*\*64\)"),
    (dict(seed=-1), "seed=-1: must be an integer"),
    (dict(kv_cache_memory="100TB"), "kv_cache_memory='100TB': a KV pool of .* GiB, more than the .* GiB free on cpu"),
    (dict(kv_cache_memory="abc"), "kv_cache_memory='abc': is not a memory size"),
    (dict(kv_cache_memory="1.2.3GB"), "kv_cache_memory='1.2.3GB': is not a memory size"),
    (dict(kv_cache_memory=0), "kv_cache_memory=0: holds no KV block"),
    (dict(kv_cache_memory="100B"), "kv_cache_memory='100B': holds no KV block of"),
    (dict(num_blocks=0), "num_blocks=0: must be an integer >= 1"),
    (dict(num_blocks=-3), "num_blocks=-3: must be an integer >= 1"),
    (dict(num_blocks=10**12), "num_blocks=1000000000000: a KV pool of"),
    (dict(max_num_seqs=0), "max_num_seqs=0: must be an integer >= 1"),
    (dict(max_model_len=-5), "max_model_len=-5: must be an integer >= 1"),
    (dict(max_model_len=0), "max_model_len=0: must be an integer >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0: must be an integer >= 1"),
    (dict(max_model_len=5000), "max_model_len=5000: is more than the model's max_position_embeddings .4096."),
    (dict(max_num_seq=8), "max_num_seq=8: not a setting of LLM nor an option of the paged allocator"),
    (dict(allocator="contiguous", reservaton="oracle"), "reservaton='oracle': not a setting of LLM nor an option"),
    (dict(allocator=PagedAllocator, enable_prefix_caching=False), "enable_prefix_caching: allocator options go with"),
    (dict(scheduler=ChunkedPolicy(max_num_seqs=2), max_num_seqs=8),
     "max_num_seqs=8: the policy object given as scheduler has its own .2.; set it on the policy"),
]


@pytest.mark.parametrize("kw,message", BAD_SETTINGS, ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "")
def test_bad_settings_are_one_clear_line(model_dir, kw, message):
    kw = dict(dict(block_size=4, max_model_len=64), **kw)
    with pytest.raises(ValueError, match=message) as e:
        LLM(model_dir, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: device=cuda is valid")
def test_cuda_on_a_cpu_torch_is_one_clear_line(model_dir):
    with pytest.raises(ValueError, match=r"device='cuda': .*(CPU-only build|no CUDA device).*use device=cpu"):
        LLM(model_dir, device="cuda")


def test_threads_setting_is_checked():
    with pytest.raises(ValueError, match="threads=0: must be an integer >= 1"):
        check_engine_settings(threads=0)
    assert check_engine_settings(threads=2, max_num_batched_tokens=None).max_num_batched_tokens is None


CLI_CASES = [("engine.block_size=abc", "engine.block_size=abc: must be an integer"),
             ("engine.threads=0", "engine.threads=0: must be an integer >= 1"),
             ("engine.seed=abc", "engine.seed=abc: must be an integer"),
             ("engine.dtype=float33", "engine.dtype=float33: is not a dtype"),
             ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs=0: must be an integer >= 1"),
             ("engine.kv_cache_memory=100TB", "engine.kv_cache_memory=100TB: a KV pool of"),
             ("engine.max_model_len=5000", "engine.max_model_len=5000: is more than the model's")]


@pytest.mark.parametrize("override,message", CLI_CASES)
def test_cli_bad_setting_exits_2_with_one_line(model_dir, tmp_path, monkeypatch, capsys, override, message):
    from varlen.run import main

    monkeypatch.setenv("VARLEN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["varlen.run", f"hydra.run.dir={tmp_path / 'out'}", "progress=false",
                                      f"model.path={model_dir}", override])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_non_finite_arrival_is_rejected_not_hung():
    eng = stub_engine()
    reqs = [Request("nan", [5] * 4, SamplingParams(max_tokens=2), arrival=math.nan),
            Request("inf", [5] * 4, SamplingParams(max_tokens=2), arrival=math.inf),
            Request("ok", [5] * 4, SamplingParams(max_tokens=2))]
    eng.run(reqs)
    assert [r.finish_reason.value for r in reqs] == ["rejected", "rejected", "length"]
    assert reqs[0].finish_message == "request 'nan': arrival=nan: must be a finite time (0 = now)"


def test_a_tiny_temperature_decodes_greedily_instead_of_failing(llm, expected):
    # logits / 1e-300 overflow to inf and softmax would give NaN: sampling there is argmax anyway.
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_a_failing_policy_aborts_every_unfinished_request():
    class Flaky(ChunkedPolicy):
        calls = 0

        def schedule(self, kv):
            type(self).calls += 1
            if type(self).calls == 2:
                raise RuntimeError("policy bug")
            return super().schedule(kv)

    eng = Engine(Flaky(max_num_seqs=2, max_num_batched_tokens=8), PagedAllocator(40, 4, 64), StubExecutor(),
                 clock=SimClock(), max_model_len=64, vocab_size=VOCAB)
    reqs = [Request(str(i), [5 + i] * 6, SamplingParams(max_tokens=3)) for i in range(4)]
    with pytest.raises(RuntimeError, match="policy bug"):
        eng.run(reqs)
    assert {r.finish_message for r in reqs} == {"step 1 failed before its batch was decided: RuntimeError: policy bug"}
    assert_idle(eng)
    again = [Request(f"b{i}", [5 + i] * 6, SamplingParams(max_tokens=3)) for i in range(4)]
    eng.run(again)
    assert all(r.finish_reason.value == "length" for r in again)


def test_a_failing_decode_run_aborts_the_running_requests():
    class NoDecodeRun(FastForwardExecutor):
        clock = None
        execute = StubExecutor.execute

        def decode_run(self, batch, max_steps, until):
            raise RuntimeError("cost model bug")

    eng = stub_engine(executor=NoDecodeRun(), engine=FastForwardEngine)
    reqs = [Request(str(i), [5] * 4, SamplingParams(max_tokens=6)) for i in range(2)]
    for r in reqs:
        eng.add_request(r)
    with pytest.raises(RuntimeError, match="cost model bug"):
        eng.step(until=math.inf)  # the prefill, then the promised decode run
    assert [r.finish_message for r in reqs] == ["step 1 failed: RuntimeError: cost model bug"] * 2  # after the prefill
    assert_idle(eng)


def test_llm_stops_on_every_eos_id_of_the_model(llm):
    from varlen.llm import eos_token_ids

    ids = eos_token_ids(llm.runner.model)
    assert ids and llm.engine.eos_token_ids == tuple(ids)
