"""The reference policies behave like the systems they are named after (conf/scheduler/*.yaml),
checked on every step of a run with preemption, not on one hand-made state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from schedulers import ContinuousPolicy, StaticPolicy, VllmV0Policy
from varlen.scheduler_api import SchedulerPolicy
from varlen import registry
from varlen.clock import SimClock
from varlen.engine import Engine, Executor
from varlen.kv import PagedAllocator
from varlen.request import Request
from varlen.sampling_params import SamplingParams

MAX_LEN = 64


class Recorder(Executor):
    """Records each step as (request, tokens computed before, new tokens, whether a decode)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int, int]]] = []
        self.finished_before: list[set[str]] = []  # per step, the requests finished before it
        self.reqs: list[Request] = []
        self.running_before: set[str] = set()  # set by the driver before each step

    def execute(self, scheduled, kv):
        self.finished_before.append({r.req_id for r in self.reqs if r.is_finished})
        # A decode: a request that was running before the step, given its one last token. (A
        # recomputation after preemption may also be one token, when the prefix cache holds the rest.)
        self.steps.append([(r.req_id, r.num_computed_tokens, n, r.req_id in self.running_before and n == 1
                            and r.num_computed_tokens + 1 == r.num_tokens) for r, n in scheduled])
        return [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in scheduled]


def is_decode(entry: tuple[str, int, int, bool]) -> bool:
    return entry[3]


def whole(entry: tuple[str, int, int, bool], reqs: dict[str, Request]) -> bool:
    """The entry computes all the request's tokens past its cached ones in one go (no chunking)."""
    rid, before, n, _ = entry
    r = reqs[rid]
    return before + n >= r.num_prompt_tokens


def run(policy: str, num_blocks: int = 40, seats: int = 6, budget: int | None = None, n: int = 40,
        seed: int = 0) -> tuple[Recorder, list[Request], Engine]:
    """A bursty workload on a small pool (preemptions happen), stepped to the end."""
    cls = registry.target("scheduler", policy)
    budget = budget or (16 if cls.chunked_prefill else MAX_LEN)
    rng = random.Random(seed)
    ex = Recorder()
    eng = Engine(cls(max_num_seqs=seats, max_num_batched_tokens=budget),
                 PagedAllocator(num_blocks, 4, MAX_LEN), ex, SimClock(), MAX_LEN)
    reqs = []
    for i in range(n):
        plen = rng.randint(1, 40)
        reqs.append(Request(f"r{i}", [10 + i] * plen, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True),
                            arrival=1e-9))
    ex.reqs = reqs
    pending = list(reqs)
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # arrivals between steps
            if pending:
                eng.add_request(pending.pop(0))
        eng.clock.advance(0.01)
        ex.running_before = {r.req_id for r in eng.policy.running}
        eng.step()
    assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in reqs)
    return ex, reqs, eng


@pytest.mark.parametrize("policy", [n for n in registry.names("scheduler")
                                    if not registry.target("scheduler", n).chunked_prefill])
def test_whole_prompt_admission_not_blocked_by_running_decodes(policy):
    """Regression: the token budget of a whole-prompt policy bounds its prompts, not the decodes
    running beside them. With the budget shared, a prompt as long as the budget (max_model_len by
    default) waited until the batch drained, and the whole queue behind it (the sim at 8 req/s on
    Azure conv, Llama-2-7B/A100, max_model_len 4096: 500+ waiting, the KV pool 23% used)."""
    budget = 32
    pol = registry.target("scheduler", policy)(max_num_seqs=8, max_num_batched_tokens=budget)
    kv = PagedAllocator(64, 4, budget)
    eng = Engine(pol, kv, Recorder(), SimClock(), budget)
    short = Request("short", [5] * 4, SamplingParams(max_tokens=10, ignore_eos=True), arrival=1e-9)
    eng.add_request(short)
    eng.step()  # its prefill; from now on it decodes
    if policy in ("static", "fastertransformer"):
        # Request-level batching admits newcomers only into an empty batch; a member preempted for
        # memory re-enters its batch beside the running decodes, with the whole budget.
        long_ = Request("long", [6] * budget, SamplingParams(max_tokens=1, ignore_eos=True), arrival=1e-9)
        eng.add_request(long_)
        pol.members.add("long")
    else:
        long_ = Request("long", [6] * budget, SamplingParams(max_tokens=1, ignore_eos=True), arrival=1e-9)
        eng.add_request(long_)
    out = pol.schedule(kv)
    assert ("long", budget) in [(r.req_id, k) for r, k in out.scheduled], out.scheduled


def test_vllm_v0_steps_are_prefills_or_decodes_prefills_first():
    ex, reqs, eng = run("vllm_v0")
    mixed = [s for s in ex.steps if any(map(is_decode, s)) and not all(map(is_decode, s))]
    assert not mixed, f"a step mixed prefills and decodes: {mixed[0]}"
    assert all(sum(n for _, _, n, _ in s) <= eng.policy.max_num_batched_tokens
               for s in ex.steps if not all(map(is_decode, s))), "prefill tokens over the budget"
    by_id = {r.req_id: r for r in reqs}
    assert all(whole(e, by_id) for s in ex.steps for e in s), "a prompt was chunked"
    # Prefills first: a decode step happens only when no waiting request fit (checked on a state
    # where one does: a decode is running and a short prompt waits).
    pol = VllmV0Policy(max_num_seqs=4, max_num_batched_tokens=MAX_LEN)
    kv = PagedAllocator(40, 4, MAX_LEN)
    e = Engine(pol, kv, Recorder(), SimClock(), MAX_LEN)
    e.add_request(Request("a", [1] * 8, SamplingParams(max_tokens=5, ignore_eos=True), arrival=1e-9))
    e.step()
    e.add_request(Request("b", [2] * 8, SamplingParams(max_tokens=5, ignore_eos=True), arrival=1e-9))
    assert [(r.req_id, k) for r, k in pol.schedule(kv).scheduled] == [("b", 8)]


@pytest.mark.parametrize("policy", ["orca", "continuous"])
def test_orca_mixes_whole_prompts_with_decodes(policy):
    ex, reqs, _ = run(policy)
    assert any(any(map(is_decode, s)) and not all(map(is_decode, s)) for s in ex.steps), \
        "iteration-level batching never admitted a prompt beside running decodes"
    by_id = {r.req_id: r for r in reqs}
    assert all(whole(e, by_id) for s in ex.steps for e in s), "a prompt was chunked"


def test_sarathi_budget_and_decodes_first():
    ex, reqs, eng = run("sarathi", budget=16)
    budget = eng.policy.max_num_batched_tokens
    assert all(sum(n for _, _, n, _ in s) <= budget for s in ex.steps), "a step over the token budget"
    for s in ex.steps:
        kinds = [is_decode(e) for e in s]
        assert kinds == sorted(kinds, reverse=True), f"a prefill chunk scheduled before a decode: {s}"
    assert not all(whole(e, {r.req_id: r for r in reqs}) for s in ex.steps for e in s), "no prompt was chunked"
    # Decodes before a partial prefill that precedes them in `running` (re-admissions after a
    # preemption leave such orders): sarathi serves the decode first, vLLM V1 (chunked) in order.
    got = {}
    for name in ("sarathi", "chunked"):
        pol = registry.target("scheduler", name)(max_num_seqs=4, max_num_batched_tokens=8)
        kv = PagedAllocator(40, 4, MAX_LEN)
        e = Engine(pol, kv, Recorder(), SimClock(), MAX_LEN)
        e.add_request(Request("short", [2] * 3, SamplingParams(max_tokens=3, ignore_eos=True), arrival=1e-9))
        e.add_request(Request("long", [1] * 30, SamplingParams(max_tokens=3, ignore_eos=True), arrival=1e-9))
        e.step()  # short: its whole prompt (it decodes from now on); long: a 5-token chunk
        pol.running.reverse()
        got[name] = [(r.req_id, k) for r, k in pol.schedule(kv).scheduled]
    assert got == {"sarathi": [("short", 1), ("long", 7)], "chunked": [("long", 8)]}


@pytest.mark.parametrize("policy", ["fastertransformer", "static"])
def test_fastertransformer_admits_only_into_an_empty_batch(policy):
    ex, reqs, _ = run(policy)
    members: set[str] = set()
    batches = 0
    for s, done in zip(ex.steps, ex.finished_before):
        ids = {rid for rid, *_ in s}
        if members <= done:  # the previous batch has fully finished: a new one forms
            members, batches = ids, batches + 1
        assert ids <= members, f"{sorted(ids - members)} joined a batch that had not finished"
    assert batches > 1 and max(map(len, ex.steps)) > 1


def test_every_policy_config_names_a_registered_class_and_cites_its_behaviour():
    for name, f in registry.files("scheduler").items():
        text = f.read_text()
        assert text.lstrip().startswith("#"), f"{f.name} has no comment citing the behaviour it reproduces"
        cls = registry.target("scheduler", name)
        assert issubclass(cls, SchedulerPolicy) and cls.__name__ == yaml.safe_load(text)["_target_"].split(".")[-1]
    assert registry.target("scheduler", "orca") is ContinuousPolicy
    assert registry.target("scheduler", "fastertransformer") is StaticPolicy


@pytest.mark.parametrize("prompt_blocks, watermark, admitted", [(18, 0.1, True), (19, 0.1, False), (19, 0.0, True)])
def test_vllm_v0_admits_only_above_its_watermark(prompt_blocks, watermark, admitted):
    # vLLM V0's block manager admits a prompt only when `watermark` of the pool stays free after it
    # (here 2 of 20 blocks), so a request just preempted for memory is not re-admitted into the room
    # its eviction made; with no watermark the pool fills to the last block.
    pol = VllmV0Policy(max_num_seqs=4, max_num_batched_tokens=128, watermark=watermark)
    kv = PagedAllocator(20, 4, 128)
    eng = Engine(pol, kv, Recorder(), SimClock(), 128)
    eng.add_request(Request("r", [3] * (4 * prompt_blocks), SamplingParams(max_tokens=2, ignore_eos=True), arrival=1e-9))
    assert bool(pol.schedule(kv).scheduled) is admitted


def test_vllm_v0_watermark_is_a_fraction_of_the_pool():
    with pytest.raises(ValueError, match="watermark"):
        VllmV0Policy(watermark=1.0)
    assert yaml.safe_load((Path(__file__).parents[2] / "conf/scheduler/vllm_v0.yaml").read_text())["watermark"] == 0.01
