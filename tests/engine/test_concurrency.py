"""One LLM shared by threads (issue 23, BUG 2): concurrent generate() calls are served on one engine
loop, batched together, and each returns exactly its serial (greedy) result; submit() streams and
abort() frees a request's KV; a failing step aborts its requests and the loop serves the next ones.
Also the API's input checks: arrivals out of range, a call whose requests are all rejected."""

from __future__ import annotations

import re
import signal
import threading
import time
import warnings

import pytest

from varlen import LLM, SamplingParams
from varlen.engine import Executor

from test_reliability_engine import FailingExecutor

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Each caller's own prompts (token ids), of different lengths so that batches mix prefill and decode.
CALLERS = [[list(range(3 + c, 3 + c + n)) for n in (5 + c, 11, 3 + 2 * c)] for c in range(4)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


def make_llm(model_dir) -> LLM:
    return LLM(model_dir, block_size=4, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def serial(model_dir):
    """Each caller's outputs when it runs alone."""
    llm = make_llm(model_dir)
    return [[o.token_ids for o in llm.generate(p, GREEDY)] for p in CALLERS]


def assert_idle(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.policy.waiting and not eng.policy.running and not eng.requests
    usage = eng.kv.usage()
    assert usage.live_tokens == 0 and usage.reserved_slots == 0


class GateExecutor(Executor):
    """Holds the first step until `open` is set, so that every caller's requests are queued by then."""

    def __init__(self, inner: Executor):
        self.inner, self.open = inner, threading.Event()
        self.rows = getattr(inner, "rows", None)

    def execute(self, scheduled, kv):
        assert self.open.wait(60), "the test never opened the gate"
        return self.inner.execute(scheduled, kv)

    def release(self, req):
        self.inner.release(req)


def wait_for(condition, what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_generate_calls_share_one_loop_and_each_gets_its_serial_result(model_dir, serial, threads):
    llm = make_llm(model_dir)
    inner = llm.engine.executor
    llm.engine.executor = gate = GateExecutor(inner)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def call(c: int) -> None:
        try:
            results[c] = llm.generate(CALLERS[c], GREEDY)
        except BaseException as err:  # shown by the assertion below
            errors.append(err)

    workers = [threading.Thread(target=call, args=(c,)) for c in range(threads)]
    for w in workers:
        w.start()
    total = sum(len(CALLERS[c]) for c in range(threads))
    wait_for(lambda: len(llm.loop._live) == total, f"{total} requests submitted")
    gate.open.set()
    for w in workers:
        w.join(600)
    assert not errors, errors
    for c in range(threads):
        outs = results[c]
        assert [o.finish_reason for o in outs] == ["length"] * len(CALLERS[c])
        assert [o.token_ids for o in outs] == serial[c], f"caller {c}"
    # one loop batched the callers together: a step holds requests of every caller
    owner = {o.request_id: c for c, outs in results.items() for o in outs}
    assert any(len({owner[r] for r in s.req_ids}) == threads for s in llm.engine.steps)
    assert_idle(llm)


def test_submit_streams_the_tokens_as_they_come(model_dir, serial):
    llm = make_llm(model_dir)
    stream = llm.submit(CALLERS[0][1], GREEDY)
    seen = list(stream)
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    assert len(seen) >= 2 and all(len(a.token_ids) < len(b.token_ids) for a, b in zip(seen, seen[1:-1]))
    assert all(b.token_ids[:len(a.token_ids)] == a.token_ids for a, b in zip(seen, seen[1:]))
    assert seen[-1].token_ids == serial[0][1] and seen[-1].finish_reason == "length"
    assert stream.result().token_ids == serial[0][1] and seen[-1].metrics is not None
    assert_idle(llm)


def test_abort_ends_a_streaming_request_and_frees_its_kv(model_dir, serial):
    llm = make_llm(model_dir)
    long = llm.submit(CALLERS[1][1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    other = llm.submit(CALLERS[0][0], GREEDY)
    for out in long:
        if out.token_ids:
            llm.abort(long.request_id)
            break
    final = long.result(timeout=600)
    assert final.finish_reason == "aborted" and final.finish_message == "aborted by the caller"
    assert 0 < len(final.token_ids) < 40
    assert other.result(timeout=600).token_ids == serial[0][0]  # the other caller's request goes on
    wait_for(lambda: llm.loop._thread is None, "the loop going idle")
    assert_idle(llm)


def test_a_failing_step_aborts_its_requests_and_the_loop_serves_the_next(model_dir, serial):
    llm = make_llm(model_dir)
    inner = llm.engine.executor
    llm.engine.executor = FailingExecutor(inner, 2, RuntimeError("device lost"))
    streams = [llm.submit(p, GREEDY) for p in CALLERS[0]]
    outs = [s.result(timeout=600) for s in streams]
    failed = [o for o in outs if o.finish_reason == "aborted"]
    assert failed and all("step 1 failed: RuntimeError: device lost" in o.finish_message for o in failed)
    assert all(isinstance(s.error, RuntimeError) for s in streams if s.result().finish_reason == "aborted")
    llm.engine.executor = inner
    assert [o.token_ids for o in llm.generate(CALLERS[1], GREEDY)] == serial[1]
    assert_idle(llm)


def test_a_step_error_reaches_generate_and_aborts_the_whole_call(model_dir, serial):
    llm = make_llm(model_dir)
    inner = llm.engine.executor
    llm.engine.executor = FailingExecutor(inner, 2, RuntimeError("device lost"))
    reqs = llm.make_requests(CALLERS[2], GREEDY)
    with pytest.raises(RuntimeError, match="device lost") as e:
        llm.run(reqs)
    assert any("3 of this call's 3 requests ended aborted" in n for n in e.value.__notes__)
    assert all(r.finish_reason.value == "aborted" for r in reqs)
    llm.engine.executor = inner
    assert [o.token_ids for o in llm.generate(CALLERS[2], GREEDY)] == serial[2]
    assert_idle(llm)


class PausingExecutor(Executor):
    """After its first step, each step waits for `resume`."""

    def __init__(self, inner: Executor):
        self.inner, self.resume, self.calls = inner, threading.Event(), 0
        self.rows = getattr(inner, "rows", None)

    def execute(self, scheduled, kv):
        self.calls += 1
        if self.calls > 1:
            assert self.resume.wait(60), "the test never resumed the loop"
        return self.inner.execute(scheduled, kv)

    def release(self, req):
        self.inner.release(req)


def test_ctrl_c_aborts_the_callers_requests_and_the_loop_stays_usable(model_dir, serial):
    llm = make_llm(model_dir)
    inner = llm.engine.executor
    llm.engine.executor = pausing = PausingExecutor(inner)
    reqs = llm.make_requests(CALLERS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))

    def ctrl_c() -> None:  # SIGINT to the caller (the main thread) while its requests run
        wait_for(lambda: pausing.calls >= 2, "the second step")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        wait_for(lambda: len(llm.loop._aborts) == len(reqs), "the caller asking for the aborts")
        pausing.resume.set()

    helper = threading.Thread(target=ctrl_c)
    helper.start()
    with pytest.raises(KeyboardInterrupt) as e:
        llm.run(reqs)
    helper.join(600)
    assert any("3 of this call's 3 requests ended aborted" in n for n in e.value.__notes__)
    assert all(r.finish_reason.value == "aborted" and r.finish_message == "the run stopped: KeyboardInterrupt"
               and r.output_token_ids for r in reqs)
    llm.engine.executor = inner
    assert [o.token_ids for o in llm.generate(CALLERS[0], GREEDY)] == serial[0]
    assert_idle(llm)


@pytest.mark.parametrize("arrivals, message", [
    ([-5, 0], r"arrivals\[0\]: arrival=-5.0: must be a finite time >= 0"),
    ([0, float("nan")], r"arrivals\[1\]: arrival=nan: must be a finite time >= 0"),
    ([1e9, 0], r"arrivals\[0\]: arrival=1000000000.0: more than 86400 s \(one day\) after submission"),
])
def test_arrivals_out_of_range_are_refused(model_dir, arrivals, message):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match=message):
        llm.make_requests(CALLERS[0][:2], GREEDY, arrivals=arrivals)


def test_arrivals_are_seconds_after_the_call(model_dir):
    llm = make_llm(model_dir)
    reqs = llm.make_requests(CALLERS[0][:2], GREEDY, arrivals=[0.0, 0.2])
    before = llm.engine.clock.now()
    llm.run(reqs)
    assert reqs[1].arrival - reqs[0].arrival == pytest.approx(0.2, abs=0.05)
    assert reqs[0].arrival >= before and reqs[1].first_scheduled >= reqs[1].arrival


def test_a_generate_call_whose_requests_are_all_rejected_warns(model_dir):
    llm = make_llm(model_dir)
    with pytest.warns(UserWarning, match=r"all 2 requests of this generate call were rejected; the first: "
                                         r"request '\d+': empty prompt"):
        outs = llm.generate([[], [1] * 100], GREEDY)
    assert [o.finish_reason for o in outs] == ["rejected", "rejected"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one good request: no warning
        outs = llm.generate([[], CALLERS[0][0]], GREEDY)
    assert [o.finish_reason for o in outs] == ["rejected", "length"]


def test_after_ctrl_c_the_progress_bar_counts_the_requests_that_ended(model_dir, monkeypatch, capsys):
    """Ctrl-C can land after a step ended requests but before the bar counted them: the bar's last
    line must still say how many ended (varlen.run's "wrote the N requests finished" agrees with it)."""
    llm = make_llm(model_dir)
    reqs = llm.make_requests(CALLERS[0], GREEDY, arrivals=[0.0, 0.0, 3600.0])  # the third never starts
    real_wait = llm.loop.wait

    def wait_then_ctrl_c(streams, on_done=None):
        if on_done is None:  # the abort's own wait
            return real_wait(streams)
        real_wait(streams[:2])  # two requests end; their on_done never runs
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.loop, "wait", wait_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llm.run(reqs, use_tqdm=True)
    assert [r.finish_reason.value for r in reqs] == ["length", "length", "aborted"]
    last = capsys.readouterr().err.strip().replace("\r", "\n").splitlines()[-1]
    assert re.search(r"\| 2/3 \[", last), last
