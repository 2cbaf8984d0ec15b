"""What a plug-in returns is checked where it enters the simulator: a policy's token grants, a
cost model's step time, a router's replica index. Each wrong answer is one line naming the
plug-in and the value, never a hang or a silent wrong number."""

from __future__ import annotations

import pytest

from schedulers import ChunkedPolicy
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from varlen.clock import SimClock
from varlen.kv import PagedAllocator
from varlen.request import FinishReason, Request
from varlen.sampling_params import SamplingParams


def tiny_requests(n=4):
    return [Request(f"r{i}", list(range(1, 9 + i)), SamplingParams(max_tokens=5, ignore_eos=True), arrival=0.01 * i)
            for i in range(n)]


def factory(policy_cls=ChunkedPolicy, cost=None):
    cost = RooflineCostModel("tiny", "cpu_2core") if cost is None else cost

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        pol = policy_cls(max_num_seqs=8, max_num_batched_tokens=64)
        return FastForwardEngine(pol, PagedAllocator(64, 16, 256), ex, clock=clock, max_model_len=256), ex

    return make


def altering(change):
    class AlteringPolicy(ChunkedPolicy):
        """A user's policy: the base schedule, every grant then altered."""

        def schedule(self, kv):
            out = super().schedule(kv)
            out.scheduled = [(r, change(n)) for r, n in out.scheduled]
            return out

    return AlteringPolicy


@pytest.mark.parametrize("change,shown", [(lambda n: n + 1000, "1008"), (lambda n: 0, "0"), (lambda n: -3, "-3")])
def test_a_wrong_grant_fails_its_step_naming_policy_request_and_count(change, shown):
    """Today's main computed past a prompt's end (+1000), or nothing (0, -3), step after step:
    sim.run hung with memory growing."""
    clock = SimClock()
    eng, _ = factory(altering(change))(clock)
    req = tiny_requests(1)[0]
    eng.add_request(req)
    with pytest.raises(ValueError) as err:
        eng.step()
    msg = str(err.value)
    assert "\n" not in msg
    assert "AlteringPolicy" in msg and "'r0'" in msg and f"{shown} tokens" in msg
    assert req.finish_reason is FinishReason.ABORTED and "AlteringPolicy" in req.finish_message


def test_a_wrong_grant_ends_the_simulation_with_every_request_ended():
    reqs = tiny_requests()
    with pytest.raises(ValueError, match="AlteringPolicy"):
        simulate(reqs, factory(altering(lambda n: n + 1000)), fast_forward=True)
    assert all(r.finish_reason is FinishReason.ABORTED and "AlteringPolicy" in r.finish_message for r in reqs)


class BadStepTime(RooflineCostModel):
    """A user's cost model: the roofline's formula, its answer replaced."""

    def __init__(self, value):
        super().__init__("tiny", "cpu_2core")
        self.value = value

    def step_time_sums(self, s):
        return self.value


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
@pytest.mark.parametrize("fast_forward", [False, True])
def test_a_bad_step_time_is_refused_naming_the_cost_model_and_value(value, fast_forward):
    """Today's main advanced the clock by it: negative TTFTs, 5e10 req/s, exit 0."""
    reqs = tiny_requests()
    with pytest.raises(ValueError) as err:
        simulate(reqs, factory(cost=BadStepTime(value)), fast_forward=fast_forward)
    msg = str(err.value)
    assert "\n" not in msg and "BadStepTime" in msg and repr(value) in msg
    assert all(r.finish_reason is FinishReason.ABORTED for r in reqs)


def test_a_bad_decode_step_time_is_refused_in_the_fast_forward():
    """The decode fast-forward times its steps through decode_step_time: checked there too."""

    class BadDecode(RooflineCostModel):
        def decode_step_time(self, num_seqs):
            return lambda cached: -1.0

    reqs = tiny_requests()
    with pytest.raises(ValueError, match=r"cost model BadDecode returned a step time of -1\.0"):
        simulate(reqs, factory(cost=BadDecode("tiny", "cpu_2core")), fast_forward=True)


@pytest.mark.parametrize("value", [-1, True, 99, None, 1.0, 3])
def test_a_router_answer_outside_the_replicas_is_refused(value):
    """Today's main: -1 picked the last replica silently, True was stored as the replica, 99 and
    None raised raw IndexError/TypeError, 1.0 a TypeError."""
    def wrong(replicas, req):
        return value

    reqs = tiny_requests()
    with pytest.raises(ValueError) as err:
        simulate(reqs, factory(), num_replicas=3, router=wrong)
    msg = str(err.value)
    assert "\n" not in msg and f"{wrong.__qualname__} returned {value!r}" in msg and "[0, 2]" in msg
    assert all(r.is_finished for r in reqs)
