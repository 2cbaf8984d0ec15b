"""vLLM's sampling options on LLM.generate / submit: stop strings (cut before the string, which may
span tokens; finish reason stop), n completions per prompt, per-token logprobs (the chosen token's
and the top-k, from the logits the sampler used). Turning them on changes no token up to the stop."""

from __future__ import annotations

import pytest
import torch

from varlen import LLM, SamplingParams

PROMPTS = ["Hello world! Once upon a time", "The scheduler decides", [5, 9, 14, 3, 7, 11, 2, 8]]
GREEDY = dict(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def plain(llm):
    return llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)


def assert_idle(llm: LLM) -> None:
    usage = llm.engine.kv.usage()
    assert not llm.engine.requests and usage.live_tokens == 0 and usage.reserved_slots == 0


def spanning_stop(llm: LLM, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next one's, and the
    number of tokens after which the output's text first holds it."""
    decode = llm.tokenizer.decode
    for i in range(2, len(ids) - 1):
        a, b = decode(ids[i:i + 1]), decode(ids[i + 1:i + 2])
        if a and b and "\ufffd" not in a + b:
            stop = a[-1] + b[0]
            k = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
            return stop, k
    raise AssertionError("no two printable neighbouring tokens in the output")


def test_stop_string_spanning_tokens_cuts_the_text_and_ends_the_request(llm, plain):
    for out in plain:
        stop, k = spanning_stop(llm, out.token_ids)
        got = llm.generate(out.prompt or out.prompt_token_ids, SamplingParams(**GREEDY, stop=["\x00never", stop]),
                           use_tqdm=False)[0]
        assert got.token_ids == out.token_ids[:k], "stopped right after the token completing the string"
        assert got.text == out.text[:out.text.index(stop)] and stop not in got.text
        assert got.finish_reason == "stop" and got.outputs[0].stop_reason == stop
        assert got.finish_message == f"stop string {stop!r} generated"
    assert_idle(llm)


def test_logprobs_and_stop_change_no_token_in_a_mixed_batch(llm, plain):
    seeded = dict(max_tokens=24, temperature=0.9, top_k=40, seed=11, ignore_eos=True)
    base = llm.generate(PROMPTS, SamplingParams(**seeded), use_tqdm=False)
    stops = [spanning_stop(llm, o.token_ids)[0] for o in plain]
    mixed = [SamplingParams(**GREEDY, logprobs=3), SamplingParams(**seeded, logprobs=0),
             SamplingParams(**GREEDY, stop=stops[2], logprobs=5)]
    got = llm.generate(PROMPTS, mixed, use_tqdm=False)
    assert got[0].token_ids == plain[0].token_ids and got[0].text == plain[0].text
    assert got[1].token_ids == base[1].token_ids
    n = len(got[2].token_ids)
    assert got[2].token_ids == plain[2].token_ids[:n] and got[2].finish_reason == "stop"
    assert [len(o.logprobs) for o in got] == [len(o.token_ids) for o in got]


def test_logprobs_are_the_models_log_softmax_of_each_position(llm, model_dir, plain):
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPTS[0], SamplingParams(**GREEDY, logprobs=4), use_tqdm=False)[0]
    assert out.token_ids == plain[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        lp = hf(ids).logits[0].float().log_softmax(-1)
    p = len(out.prompt_token_ids)
    total = 0.0
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        row = lp[p - 1 + i]
        entries = list(d.items())
        assert entries[0][0] == tok and entries[0][1].rank == 1  # greedy: the chosen token is the top one
        assert entries[0][1].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        top = torch.topk(row, 4)
        assert [t for t, _ in entries] == top.indices.tolist()  # the chosen one is also the first of the top-4
        assert [e.logprob for _, e in entries] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entries[1][1].decoded_token == llm.tokenizer.decode([entries[1][0]])
        total += entries[0][1].logprob
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)


def test_sampled_logprobs_rank_the_chosen_token(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.5, seed=2, ignore_eos=True,
                                                  logprobs=2), use_tqdm=False)[0]
    for tok, d in zip(out.token_ids, out.logprobs):
        first, *top = d.items()
        assert first[0] == tok and first[1].logprob <= 0
        better = [e for _, e in top if e.logprob > first[1].logprob]
        assert first[1].rank >= len(better) + 1
        assert len(d) in (2, 3)  # the chosen token, then the top-2 (once, if it is one of them)


def test_n_completions_are_grouped_per_prompt_each_its_seeded_draw(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert len(outs) == 2
    for prompt, out in zip(PROMPTS, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
        for c in out.outputs:
            alone = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + c.index,
                                                        ignore_eos=True), use_tqdm=False)[0]
            assert c.token_ids == alone.token_ids and c.text == alone.text and len(c.logprobs) == 12
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "distinct seeds, distinct draws"
    greedy = llm.generate(PROMPTS[2], SamplingParams(**GREEDY, n=2), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_idle(llm)


def test_a_stream_never_shows_text_a_stop_string_takes_back(llm, plain):
    stop, k = spanning_stop(llm, plain[1].token_ids)
    stream = llm.submit(PROMPTS[1], SamplingParams(**GREEDY, stop=stop, n=2))
    seen = list(stream)
    final = seen[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["stop", "stop"]
    for snap in seen:
        for c in snap.outputs:
            assert final.outputs[c.index].text.startswith(c.text)
    assert stream.result().text == plain[1].text[:plain[1].text.index(stop)]


def test_aborting_a_prompt_aborts_its_completions(llm):
    stream = llm.submit(PROMPTS[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, n=2))
    for snap in stream:
        if all(c.token_ids for c in snap.outputs):
            llm.abort(stream.request_id)
            break
    final = stream.result(timeout=600)
    assert [c.finish_reason for c in final.outputs] == ["aborted", "aborted"]
    assert all(len(c.token_ids) < 100 for c in final.outputs)
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop=""), "stop='': must be a non-empty string or a list of them"),
    (dict(stop=["a", 3]), r"stop=\['a', 3\]: must be a non-empty string or a list of them"),
    (dict(n=0), "n=0: must be an integer >= 1"),
    (dict(n=2.0), "n=2.0: must be an integer >= 1"),
    (dict(logprobs=21), r"logprobs=21: must be None or an integer in \[0, 20\]"),
    (dict(logprobs=-1), r"logprobs=-1: must be None or an integer in \[0, 20\]"),
])
def test_bad_sampling_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=f"^SamplingParams {message}"):
        SamplingParams(**kwargs)


def test_generate_progress_bar_is_on_by_default_and_quiet_off_a_terminal(llm, plain, capsys):
    out = llm.generate(PROMPTS[0], SamplingParams(**GREEDY))  # stderr is captured: not a terminal
    assert out[0].token_ids == plain[0].token_ids
    assert "requests" not in capsys.readouterr().err
    reqs = llm.make_requests(PROMPTS[:2], SamplingParams(**GREEDY))
    streams = llm.run(reqs, use_tqdm=True)  # run's bar is shown when asked (varlen.run's progress=true)
    assert "requests: 100%" in capsys.readouterr().err
    assert [s.result().token_ids for s in streams] == [o.token_ids for o in plain[:2]]
