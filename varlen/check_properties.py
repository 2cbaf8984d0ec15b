"""The properties `python -m varlen.check` runs, per plug-in kind, on one plug-in: each takes the
Subject (the plug-in, its settings) and hypothesis settings, and raises on a failure. Built from the
strategies and checks of varlen/testing/, so a user's plug-in meets the suites' own standard."""

from __future__ import annotations

import math
import time
import warnings
from numbers import Integral
from dataclasses import dataclass, field
from typing import Any, Callable


EOS = 1  # the stand-in executor's end-of-sequence token (varlen/testing/invariants.py)
MAX_LEN = 64  # the real-model property's max_model_len: the tiny model, short requests

_cache: dict[str, Any] = {}


class NotApplicable(Exception):
    """A property that does not apply to this plug-in (said, not failed)."""


@dataclass
class Subject:
    kind: str
    name: str
    options: dict[str, Any]  # KIND.key=value overrides of its yaml
    examples: int | None  # --examples: every property's example count; None: each its default
    sim_model: str = "tiny"
    hardware: str = "cpu_2core"
    info: list[str] = field(default_factory=list)

    def build(self, **extra: Any) -> Any:
        from varlen import registry

        return registry.build(self.kind, self.name, **{**self.options, **extra})

    def n(self, default: int) -> int:
        return self.examples if self.examples is not None else default


@dataclass
class Property:
    name: str  # what holds, said as a claim
    run: Callable[[Subject, Any], None]  # (subject, hypothesis settings) -> raises on failure
    examples: int  # default example count (about 3 min in all on 2 shared cores)


SHRINK = True  # --no-shrink: report the first failing example as found (faster, larger)
DERANDOMIZE = False  # --derandomize: the same examples every run


def hypothesis_settings(examples: int, stateful_steps: int | None = None) -> Any:
    from hypothesis import HealthCheck, Phase, settings

    # One failure (the simplest found) per property: its counterexample is what the user reads.
    kw: dict[str, Any] = dict(max_examples=examples, deadline=None, database=None, print_blob=False,
                              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    if DERANDOMIZE:
        kw["derandomize"] = True
    if not SHRINK:
        kw["phases"] = [p for p in Phase if p is not Phase.shrink]
    if stateful_steps is not None:
        kw["stateful_step_count"] = stateful_steps
    return settings(**kw)




# -- the plug-in's pieces, as each property needs them ------------------------------------------

def policy_maker(subject: Subject, drawn: str | None) -> Callable[[int, int], Any]:
    """(seats, budget) -> a policy: the subject's (its yaml and settings), or a drawn shipped one."""
    from varlen.testing.fast_forward import policy_class

    if subject.kind == "scheduler":
        return lambda seats, budget: subject.build(max_num_seqs=seats, max_num_batched_tokens=budget)
    assert drawn is not None
    cls = policy_class(drawn)
    return lambda seats, budget: cls(max_num_seqs=seats, max_num_batched_tokens=budget)


def chunked(subject: Subject, drawn: str | None) -> bool:
    """Whether the policy splits prompts (else its budget must hold a whole prompt)."""
    return bool(getattr(policy_maker(subject, drawn)(1, 1), "chunked_prefill"))


def allocator_maker(subject: Subject, drawn: str | None) -> Callable[..., Any]:
    """(num_blocks=, block_size=, max_model_len=) -> an allocator: the subject's or a drawn shipped one."""
    from varlen.testing.fast_forward import ALLOCATORS

    if subject.kind == "allocator":
        return subject.build()
    assert drawn is not None
    return ALLOCATORS[drawn]


def sim_factory(subject: Subject, policy: str | None, allocator: str | None, num_blocks: int, block_size: int,
                max_model_len: int, budget: int, seats: int, cost: Any = None):
    """make_engine for simulate(): the decode fast-forward's engine on a cost model's executor."""
    from sim.cost.roofline import RooflineCostModel
    from sim.executor import CostModelExecutor
    from sim.fast_forward import FastForwardEngine

    cost = cost or RooflineCostModel("tiny", "cpu_2core")
    make_policy, make_kv = policy_maker(subject, policy), allocator_maker(subject, allocator)
    if not chunked(subject, policy):
        budget = max(budget, max_model_len)  # whole prompts must fit one step

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        kv = make_kv(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
        return FastForwardEngine(make_policy(seats, budget), kv, ex, clock=clock, max_model_len=max_model_len), ex

    return make


def tiny_models() -> dict[str, tuple[Any, Any, str]]:
    """(model under test, its HF SDPA oracle, folder) of each tiny architecture, loaded once."""
    if "models" not in _cache:
        from varlen.testing.equivalence import load_pair
        from varlen.tiny_model import ensure_tiny_model

        out = {}
        for arch in ("qwen3", "llama"):  # the equivalence suites' two (tests/conftest.py)
            path = str(ensure_tiny_model(arch))
            out[arch] = (*load_pair(path), path)
        _cache["models"] = out
    return _cache["models"]


def prepare(subject: Subject) -> None:
    """Build the plug-in once (a bad setting is bad input, exit 2), and what its properties share."""
    if subject.kind == "scheduler":
        subject.build(max_num_seqs=2, max_num_batched_tokens=MAX_LEN)
    elif subject.kind == "allocator":
        maker = subject.build()
        if not callable(maker) or isinstance(maker, type(None)):
            raise ValueError(f"allocator {subject.name}: its yaml must build a factory (_partial_: true)")
        maker(num_blocks=8, block_size=4, max_model_len=32)
    elif subject.kind == "backend":
        import torch

        backend = subject.build()
        backend.check("cpu", torch.float32, 1)  # ValueError: bad input; the properties run on CPU in fp32
    elif subject.kind == "cost":
        cost_model(subject)
    elif subject.kind == "router":
        router = subject.build()
        if not callable(router):
            raise ValueError(f"router {subject.name}: builds {type(router).__name__}, not a callable "
                             "(replicas, request) -> index")


# -- schedulers and allocators ----------------------------------------------------------------------

def machine_for(subject: Subject):
    """The scheduling-invariant machine with the subject in its place; the rest drawn as usual."""
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize

    from varlen.clock import SimClock
    from varlen.engine import Engine
    from varlen.testing.fast_forward import POLICIES
    from varlen.testing.invariants import SchedulingMachine

    policies = [subject.name] if subject.kind == "scheduler" else shipped(POLICIES, "scheduler")
    allocators = ["paged", "contiguous"] if subject.kind == "scheduler" else [subject.name]

    class PluginMachine(SchedulingMachine):
        @initialize(policy=st.sampled_from(policies), allocator=st.sampled_from(allocators),
                    block_size=st.sampled_from([1, 2, 4, 16]), seats=st.integers(1, 6),
                    reservation=st.sampled_from(["max", "pow2", "oracle"]))
        def setup(self, policy, allocator, block_size, seats, reservation):
            SchedulingMachine.setup(self, policy, allocator, block_size, seats, reservation)
            if subject.kind == "scheduler":  # the policy as its yaml and settings make it
                self.policy = subject.build(max_num_seqs=seats, max_num_batched_tokens=self.budget)
                self.engine = Engine(self.policy, self.kv, self.exe, SimClock(), self.max_len, eos_token_id=EOS)

        def make_allocator(self, allocator, num_blocks, block_size, reservation):
            if subject.kind == "allocator":
                return subject.build()(num_blocks=num_blocks, block_size=block_size, max_model_len=self.max_len)
            return SchedulingMachine.make_allocator(self, allocator, num_blocks, block_size, reservation)

    return PluginMachine


def shipped(names: list[str], group: str) -> list[str]:
    """The names among `names` whose config ships with varlen (not the user's folders)."""
    from varlen import registry

    root = registry.conf_dir(group)
    return [n for n in names if registry.files(group)[n].parent == root] or names


def prop_invariants(subject: Subject, s: Any) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine_for(subject), settings=hypothesis_settings(s.max_examples, 60))


def _workload_for(subject: Subject, w: dict) -> tuple[str | None, str | None]:
    return (None if subject.kind == "scheduler" else w["policy"],
            None if subject.kind == "allocator" else w["allocator"])


def prop_fast_forward(subject: Subject, s: Any) -> None:
    from hypothesis import given

    from varlen.testing.fast_forward import assert_same, run_both
    from varlen.testing.strategies import trace_workloads

    @s
    @given(trace_workloads())
    def fast_forward_changes_nothing(w):
        policy, allocator = _workload_for(subject, w)
        make = sim_factory(subject, policy, allocator, w["num_blocks"], w["block_size"], w["max_model_len"],
                           w["budget"], w["seats"])
        a, b = run_both(w["reqs"], make, num_replicas=w["replicas"], router="least_outstanding")
        assert_same(a, b)

    fast_forward_changes_nothing()


def prop_decode_promise(subject: Subject, s: Any) -> None:
    """When the policy promises its next step (next_decode_batch), the step runs exactly that batch."""
    from hypothesis import given

    from sim.validate import fresh_copies
    from varlen.clock import SimClock
    from varlen.engine import Engine
    from varlen.testing.invariants import RecordingExecutor
    from varlen.testing.strategies import trace_workloads

    @s
    @given(trace_workloads())
    def decode_promise_kept(w):
        policy, allocator = _workload_for(subject, w)
        budget = w["budget"] if chunked(subject, policy) else max(w["budget"], w["max_model_len"])
        pol = policy_maker(subject, policy)(w["seats"], budget)
        kv = allocator_maker(subject, allocator)(num_blocks=w["num_blocks"], block_size=w["block_size"],
                                                 max_model_len=w["max_model_len"])
        exe = RecordingExecutor()
        eng = Engine(pol, kv, exe, SimClock(), w["max_model_len"], eos_token_id=EOS)
        reqs = fresh_copies(w["reqs"])
        for r in reqs:
            r.arrival = 0.0
            eng.add_request(r)
        for _ in range(20_000):
            if not eng.has_unfinished():
                break
            promised = pol.next_decode_batch()
            ids = None if promised is None else [r.req_id for r in promised]
            before, preemptions = len(exe.calls), eng.num_preemptions
            eng.clock.advance(0.01)
            eng.step()
            if ids is not None and eng.num_preemptions == preemptions:
                assert len(exe.calls) > before, "a promised decode step did not run"
                assert [c[0] for c in exe.calls[-1]] == ids, \
                    f"next_decode_batch promised {ids}, the step ran {[c[0] for c in exe.calls[-1]]}"
                assert all(n == 1 for *_, n in exe.calls[-1]), "a promised decode step was not pure decode"
        assert all(r.is_finished for r in reqs), "liveness: a request never ended"

    decode_promise_kept()


def prop_matches_hf(subject: Subject, s: Any) -> None:
    """The real engine (tiny model, torch_sdpa) serves a drawn workload with the plug-in; every
    greedy token is the HF model's argmax on that request alone (ties within 1e-4 allowed)."""
    import torch
    from hypothesis import given, strategies as st

    from varlen import LLM, SamplingParams
    from varlen.testing.fast_forward import POLICIES

    models = tiny_models()
    policies = shipped(POLICIES, "scheduler")

    @s
    @given(arch=st.sampled_from(sorted(models)), policy=st.sampled_from(policies),
           block_size=st.sampled_from([1, 2, 4, 16]), seats=st.integers(1, 4), budget=st.integers(4, 48),
           spare=st.integers(0, 8),
           requests=st.lists(st.tuples(st.lists(st.integers(3, 500), min_size=1, max_size=30), st.integers(1, 8)),
                             min_size=1, max_size=5))
    def each_request_matches_hf_alone(arch, policy, block_size, seats, budget, spare, requests):
        _, oracle, path = models[arch]
        drawn = None if subject.kind == "scheduler" else policy
        if not chunked(subject, drawn):
            budget = MAX_LEN
        pol = policy_maker(subject, drawn)(seats, budget)
        num_blocks = -(-MAX_LEN // block_size) + spare  # one full-length request, and a few blocks: preemptions
        alloc = subject.build() if subject.kind == "allocator" else "paged"
        llm = LLM(path, backend="torch_sdpa", scheduler=pol, allocator=alloc, block_size=block_size,
                  num_blocks=num_blocks, max_model_len=MAX_LEN)
        prompts = [p for p, _ in requests]
        sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        with torch.inference_mode():
            for i, (out, prompt) in enumerate(zip(outs, prompts)):
                assert out.finish_reason in ("length", "rejected"), \
                    f"request {i} ended {out.finish_reason}: {out.finish_message}"
                if out.finish_reason == "rejected":
                    assert len(prompt) + sps[i].max_tokens > MAX_LEN, f"request {i} rejected: {out.finish_message}"
                    continue
                assert len(out.token_ids) == sps[i].max_tokens, f"request {i}: {len(out.token_ids)} tokens"
                logits = oracle(torch.tensor([prompt + out.token_ids])).logits[0]
                for j, tok in enumerate(out.token_ids):
                    row = logits[len(prompt) - 1 + j]
                    gap = (row.max() - row[tok]).item()
                    assert gap <= 1e-4, (f"request {i} token {j}: {tok} is not HF's greedy choice "
                                         f"{int(row.argmax())} (logit gap {gap:.2e})")

    each_request_matches_hf_alone()


# -- backends -----------------------------------------------------------------------------------------

def prop_backend_vs_reference(subject: Subject, s: Any) -> None:
    import torch
    from hypothesis import assume, given

    from varlen.testing.attention import ATOL, reference
    from varlen.testing.strategies import problems

    # The properties' KV pool is torch_ref's layout, [2, blocks, block_size, kv_heads, head_dim].
    from varlen.attention_api import AttentionBackend

    cls = type(subject.build())
    if (cls.allocate_kv_cache is not AttentionBackend.allocate_kv_cache
            or cls.kv_cache_shape is not AttentionBackend.kv_cache_shape):
        raise NotApplicable("its KV cache layout is its own (kv_cache_shape / allocate_kv_cache): the "
                            "model-level properties below check it through the model runner")

    @s
    @given(problems())
    def same_output_and_cache_as_torch_ref(p):
        backend = subject.build()
        try:
            backend.check("cpu", torch.float32, p["batch"].block_size)
        except ValueError:
            assume(False)  # a block size it does not take: not this example
        want, want_cache = reference(p)
        cache = p["cache"].clone()
        got = backend.forward(p["q"], p["k"], p["v"], cache, backend.prepare(p["batch"], "cpu"), p["scale"])
        assert torch.equal(cache, want_cache), "the KV cache after the step's write differs from torch_ref's"
        err = (got - want).abs().max().item()
        assert err <= ATOL, f"output differs from torch_ref's by {err:.2e} > {ATOL}"

    same_output_and_cache_as_torch_ref()


def _runner(subject: Subject, model: Any, block_size: int, pool: int) -> Any:
    import torch
    from hypothesis import assume

    from varlen.model_runner import ModelRunner

    backend = subject.build()
    try:
        backend.check("cpu", torch.float32, block_size)
    except ValueError:
        assume(False)
    return ModelRunner(model, backend, block_size, pool)


def prop_backend_mixed_batches(subject: Subject, s: Any) -> None:
    from hypothesis import given, strategies as st

    from varlen.testing.equivalence import assert_each_matches_alone, run_grouping
    from varlen.testing.strategies import batch_workloads, groupings

    models = tiny_models()

    @s
    @given(arch=st.sampled_from(sorted(models)), data=st.data())
    def mixed_batch_matches_each_request_alone(arch, data):
        model, oracle, _ = models[arch]
        block_size, pool, reqs = data.draw(batch_workloads(max_requests=6))
        rounds = data.draw(groupings([len(r.steps) for r in reqs]), label="rounds")
        assert_each_matches_alone(run_grouping(_runner(subject, model, block_size, pool), reqs, rounds), reqs, oracle)

    mixed_batch_matches_each_request_alone()


def prop_backend_batchings_agree(subject: Subject, s: Any) -> None:
    from hypothesis import given, strategies as st

    from varlen.testing.equivalence import TOL, run_grouping
    from varlen.testing.strategies import batch_workloads, groupings

    models = tiny_models()

    @s
    @given(arch=st.sampled_from(sorted(models)), data=st.data())
    def two_batchings_agree(arch, data):
        model = models[arch][0]
        block_size, pool, reqs = data.draw(batch_workloads(max_requests=6))
        steps = [len(r.steps) for r in reqs]
        first, second = data.draw(groupings(steps), label="first"), data.draw(groupings(steps), label="second")
        a = run_grouping(_runner(subject, model, block_size, pool), reqs, first)
        b = run_grouping(_runner(subject, model, block_size, pool), reqs, second)
        assert a.keys() == b.keys()
        for key in a:
            err = (a[key] - b[key]).abs().max().item()
            assert err <= TOL, f"(request, step) {key}: the two batchings differ by {err:.2e}"

    two_batchings_agree()


# -- cost models ---------------------------------------------------------------------------------------

def cost_model(subject: Subject) -> Any:
    """The cost model as sim.run builds it (conf/cost/ yaml, cost.* settings) for --sim-model/--hardware."""
    from sim.cost.registry import build_cost_model
    from varlen import registry

    model: Any = subject.sim_model
    path = registry.conf_dir("sim_model", f"{model}.yaml")
    if path.is_file():
        import yaml

        model = yaml.safe_load(path.read_text())["config"]
    return build_cost_model({"model": subject.name, **subject.options}, model, subject.hardware)


def steps():
    """A step: per-request new tokens (prefill chunks and decodes) and cached tokens."""
    from hypothesis import strategies as st

    req = st.tuples(st.one_of(st.just(1), st.integers(1, 4096)), st.integers(0, 100_000))
    return st.lists(req, min_size=1, max_size=32).map(lambda rs: ([n for n, _ in rs], [c for _, c in rs]))


def prop_cost_finite(subject: Subject, s: Any) -> None:
    from hypothesis import given

    cost = cost_model(subject)

    @s
    @given(steps())
    def step_time_is_finite_and_non_negative(step):
        t = cost.step_time(*step)
        assert isinstance(t, float) and math.isfinite(t) and t >= 0, f"step_time {t!r}"

    step_time_is_finite_and_non_negative()


def prop_cost_deterministic(subject: Subject, s: Any) -> None:
    from hypothesis import given

    cost, other = cost_model(subject), cost_model(subject)

    @s
    @given(steps(), steps())
    def same_step_same_time(step, between):
        first = cost.step_time(*step)
        cost.step_time(*between)
        assert cost.step_time(*step) == first, "the same step timed twice differs (state kept between steps?)"
        assert other.step_time(*step) == first, "a second instance times the same step differently"

    same_step_same_time()


def prop_cost_parts(subject: Subject, s: Any) -> None:
    from hypothesis import given

    from sim.cost.base import StepSums

    cost = cost_model(subject)
    if not cost.uses_sums:
        raise NotApplicable("it times steps by step_time alone: no parts (sim.explain)")

    @s
    @given(steps())
    def parts_sum_to_the_total(step):
        sums = StepSums.of(*step)
        total = cost.step_time_sums(sums)
        parts = {k: v for k, v in cost.parts(sums).items() if v is not None}
        assert all(math.isfinite(v) and v >= 0 for v in parts.values()), f"parts {parts}"
        assert math.isclose(sum(parts.values()), total, rel_tol=1e-9, abs_tol=1e-15), \
            f"parts sum to {sum(parts.values())!r}, the step time is {total!r}: {parts}"

    parts_sum_to_the_total()


def prop_cost_decode_closure(subject: Subject, s: Any) -> None:
    from hypothesis import given, strategies as st

    from sim.cost.base import StepSums

    cost = cost_model(subject)

    @s
    @given(st.integers(1, 4096), st.integers(0, 3_000_000))
    def decode_closure_is_step_time(batch, cached):
        step = cost.decode_step_time(batch)
        for j in range(5):
            c = cached + j * batch
            want = cost.step_time_sums(StepSums(batch, batch, c, c, batch, batch))
            assert step(c) == want, f"decode_step_time({batch})({c}) = {step(c)!r}, step time {want!r}"

    decode_closure_is_step_time()


# -- routers --------------------------------------------------------------------------------------------

def _routed(subject: Subject, w: dict, replicas: int) -> list[int]:
    """Serve the workload on `replicas` engines with a fresh router; every index it returned."""
    from sim.simulator import simulate
    from sim.validate import fresh_copies

    router, picks = subject.build(), []

    def recording(reps, req):
        k = router(reps, req)
        assert isinstance(k, Integral) and not isinstance(k, bool), f"returned {k!r} (not an int) for {req.req_id}"
        assert 0 <= k < len(reps), f"returned {k} for {req.req_id}, with {len(reps)} replicas"
        picks.append(int(k))
        return int(k)

    make = sim_factory(subject, w["policy"], w["allocator"], w["num_blocks"], w["block_size"], w["max_model_len"],
                       w["budget"], w["seats"])
    simulate(fresh_copies(w["reqs"]), make, num_replicas=replicas, router=recording)
    return picks


def prop_router_valid(subject: Subject, s: Any) -> None:
    from hypothesis import given, strategies as st

    from varlen.testing.strategies import trace_workloads

    @s
    @given(trace_workloads(), st.integers(2, 5))
    def a_valid_replica_index(w, replicas):
        _routed(subject, w, replicas)

    a_valid_replica_index()


def prop_router_deterministic(subject: Subject, s: Any) -> None:
    from hypothesis import given, strategies as st

    from varlen.testing.strategies import trace_workloads

    @s
    @given(trace_workloads(), st.integers(2, 5))
    def same_arrivals_same_routes(w, replicas):
        assert _routed(subject, w, replicas) == _routed(subject, w, replicas), "two fresh routers routed differently"

    same_arrivals_same_routes()


# -- information (never a failure) ----------------------------------------------------------------------

def information(subject: Subject) -> list[str]:
    try:
        return INFO[subject.kind](subject)
    except Exception as e:  # noqa: BLE001 (information only: its failure is said, not raised)
        return [f"(could not measure: {type(e).__name__}: {' '.join(str(e).split())[:200]})"]


def _sim_figures(subject: Subject, policy: str | None, allocator: str | None) -> tuple[float, float, list[str]]:
    """(fast-forwarded share of steps, wall us per step stepping one by one, promise warnings)."""
    from sim.simulator import simulate
    from sim.validate import fresh_copies
    from varlen.promises import PromiseWarning
    from varlen.testing.fast_forward import shared_prefix_requests

    reqs = shared_prefix_requests(200, rate=30.0, seed=1)
    make = sim_factory(subject, policy, allocator, 400, 16, 1024, 256, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PromiseWarning)
        fast = simulate(fresh_copies(reqs), make, fast_forward=True)
    t = time.perf_counter()
    slow = simulate(fresh_copies(reqs), make, fast_forward=False)
    wall = time.perf_counter() - t
    eng: Any = fast.replicas[0].engine
    said = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, PromiseWarning)))
    return eng.num_fast_forwarded_steps / max(len(eng.steps), 1), wall / max(slow.num_steps, 1) * 1e6, said


def info_scheduling(subject: Subject) -> list[str]:
    base = Subject("scheduler", "chunked", {}, None)
    mine = (None, "paged-cache") if subject.kind == "scheduler" else ("chunked", None)
    share, us, said = _sim_figures(subject, *mine)
    _, base_us, _ = _sim_figures(base, None, "paged-cache")
    out = [f"fast-forward covers {share:.0%} of the steps of 200 shared-prefix requests at 30 req/s "
           "(roomy pool; the shipped policies: 30% or more)",
           f"step overhead: {us:.0f} us per simulated step one by one (chunked/paged here: {base_us:.0f} us; "
           "shared machine, indicative)"]
    if subject.kind == "scheduler" and not getattr(type(subject.build(max_num_seqs=2, max_num_batched_tokens=64)),
                                                   "repeats_decode_batches", False):
        out.append("the policy does not declare repeats_decode_batches: the simulator steps it one step at a "
                   "time (declare it if a running decode's turn and grant never change; README, Writing a plug-in)")
    out += [f"promise lapsed: {w}" for w in said]
    return out


def info_backend(subject: Subject) -> list[str]:
    import torch

    from backends.torch_ref import TorchRefBackend
    from varlen.batch import SeqSlice, build_batch

    seqs = [SeqSlice(list(range(3, 3 + n)), c, list(range(i * 8, i * 8 + 8)), req_id=i)
            for i, (n, c) in enumerate([(1, 60)] * 14 + [(40, 0), (20, 30)])]
    batch = build_batch(seqs, 16, 8 * len(seqs))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.num_tokens, h, 64, generator=gen) for h in (8, 4, 4))

    def per_step(backend) -> float:
        # In the backend's own layout (as the model runner allocates it).
        cache = backend.allocate_kv_cache(1, 8 * len(seqs), 16, 4, 64, torch.float32, "cpu")[0]
        cache.normal_(generator=gen)
        t, n = time.perf_counter(), 20
        for _ in range(n):
            backend.forward(q, k, v, cache, backend.prepare(batch, "cpu"), 0.125)
        return (time.perf_counter() - t) / n * 1e6

    return [f"one layer of a 16-request mixed step (prepare + forward): {per_step(subject.build()):.0f} us "
            f"(torch_ref: {per_step(TorchRefBackend()):.0f} us; shared machine, indicative)"]


def info_cost(subject: Subject) -> list[str]:
    cost = cost_model(subject)
    new, cached = [1] * 63 + [512], [700] * 64
    t, n = time.perf_counter(), 2000
    for _ in range(n):
        cost.step_time(new, cached)
    per = (time.perf_counter() - t) / n * 1e6
    formula = "a step formula (fast decode closure)" if cost.uses_sums else "step_time only (generic decode closure)"
    return [f"step_time: {per:.1f} us per call on a 64-request step; {formula}"]


def info_router(subject: Subject) -> list[str]:
    return []


PROPERTIES: dict[str, list[Property]] = {
    "scheduler": [
        Property("scheduling invariants (budget, seats, blocks, every request ends)", prop_invariants, 60),
        Property("fast-forward changes nothing (tokens, times, steps, KV state)", prop_fast_forward, 40),
        Property("decode promise kept (next_decode_batch is the step run)", prop_decode_promise, 40),
        Property("mixed batches == each request alone (HF greedy)", prop_matches_hf, 12),
    ],
    "backend": [
        Property("same output and KV write as torch_ref", prop_backend_vs_reference, 60),
        Property("mixed batch == each request alone (HF SDPA)", prop_backend_mixed_batches, 20),
        Property("two batchings of the same steps agree", prop_backend_batchings_agree, 20),
    ],
    "cost": [
        Property("step time finite and non-negative", prop_cost_finite, 200),
        Property("deterministic (same step, same time)", prop_cost_deterministic, 200),
        Property("parts sum to the step time", prop_cost_parts, 200),
        Property("decode closure == step time, bit for bit (fast-forward)", prop_cost_decode_closure, 200),
    ],
    "router": [
        Property("a valid replica index (an int in range)", prop_router_valid, 40),
        Property("deterministic (same arrivals, same routes)", prop_router_deterministic, 30),
    ],
}
PROPERTIES["allocator"] = PROPERTIES["scheduler"]
INFO: dict[str, Callable[[Subject], list[str]]] = {
    "scheduler": info_scheduling, "allocator": info_scheduling, "backend": info_backend, "cost": info_cost,
    "router": info_router,
}
