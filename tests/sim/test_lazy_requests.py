"""Requests built as they arrive (issue 26): trace_requests(lazy=True) is a TraceRequests that builds
each Request when it is first read and drops it when the simulation releases it, so memory holds the
requests in flight, not every request of the trace; the results equal those of the built list."""

from __future__ import annotations

import numpy as np
import pytest

from sim.release import RELEASED, Release, arrival_order
from sim.simulator import simulate
from varlen.metrics import request_columns
from varlen.sampling_params import SamplingParams
from varlen.traces import SyntheticTrace, Trace, TraceRequest, TraceStats, load_trace
from varlen.workload import TraceRequests, trace_requests
from tests.sim.test_sim import engine_factory


def _trace(n: int = 300, rate: float = 50.0, output_len: str = "uniform:1:60") -> Trace:
    return load_trace(SyntheticTrace(requests=n, rate=rate, prompt_len="uniform:8:400", output_len=output_len))


@pytest.mark.parametrize("token_ids", [False, True])
def test_lazy_requests_are_the_built_list_built_on_first_read(token_ids):
    trace = _trace(40)
    sp = SamplingParams(ignore_eos=True)
    want = trace_requests(trace, 512, sp, token_ids=token_ids)
    lazy = trace_requests(trace, 512, sp, token_ids=token_ids, lazy=True)
    assert isinstance(lazy, TraceRequests) and len(lazy) == len(want) and not lazy._made  # nothing built yet
    np.testing.assert_array_equal(lazy.arrivals, [r.arrival for r in want])
    for i in (5, 0, -1, 39):
        a, b = lazy[i], want[i]
        assert (a.req_id, a.arrival, a.sampling, a.expected_output_len) == (b.req_id, b.arrival, b.sampling,
                                                                           b.expected_output_len)
        np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
    assert lazy[5] is lazy[5] and sorted(lazy._made) == [0, 5, 39]  # kept once built
    lazy.release(5, RELEASED)
    assert lazy[5] is RELEASED and 5 not in lazy._made
    with pytest.raises(IndexError):
        lazy[40]


@pytest.mark.parametrize("token_ids", [False, True])
def test_a_slice_is_the_requests_read_one_by_one(token_ids):
    trace, sp = _trace(40), SamplingParams(ignore_eos=True)
    want = trace_requests(trace, 512, sp, token_ids=token_ids)
    lazy = trace_requests(trace, 512, sp, token_ids=token_ids, lazy=True)
    held = lazy[7]
    lazy.release(9, RELEASED)
    got = lazy[5:30]  # built in one pass, except the one already built and the released one
    assert got[2] is held and got[4] is RELEASED and len(got) == 25
    for a, b in zip(got[:4] + got[5:], want[5:9] + want[10:30]):
        assert (a.req_id, a.arrival, a.sampling, a.expected_output_len, a.priority, a.prompt) == \
               (b.req_id, b.arrival, b.sampling, b.expected_output_len, b.priority, b.prompt)
        assert type(a.arrival) is float and a.num_prompt_tokens == b.num_prompt_tokens
        np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
    assert all(lazy[i] is got[i - 5] for i in range(5, 30))  # kept, as a read of one keeps it
    fresh = lazy[30:36]  # none built yet: made in one go
    for a, b in zip(fresh, want[30:36]):
        assert (a.req_id, a.arrival, a.sampling, a.expected_output_len, a.priority, a.prompt, a.num_prompt_tokens) == \
               (b.req_id, b.arrival, b.sampling, b.expected_output_len, b.priority, b.prompt, b.num_prompt_tokens)
        np.testing.assert_array_equal(a.prompt_token_ids, b.prompt_token_ids)
    assert all(lazy[i] is fresh[i - 30] for i in range(30, 36))
    assert lazy[38:100] == [lazy[38], lazy[39]] and lazy[30:10] == [] and lazy[10:20:3] == [lazy[i] for i in (10, 13, 16, 19)]


def test_a_simulation_builds_each_request_as_it_arrives_and_drops_it_when_it_ends():
    lazy = trace_requests(_trace(4000, rate=20.0, output_len="uniform:1:6"), 512, SamplingParams(ignore_eos=True),
                          token_ids=False, lazy=True)
    built: list[int] = []
    positions: list[int] = []

    class Counting(dict):  # every request built is kept here: each insertion is one build
        def __setitem__(self, i, r) -> None:
            built.append(len(self))  # requests held when one more is built
            positions.append(i)
            super().__setitem__(i, r)

        def update(self, pairs) -> None:
            for i, r in pairs:
                self[i] = r

    lazy._made = Counting()
    res = simulate(lazy, engine_factory(), 2, "least_outstanding", keep_requests=False)
    # Each built once; the ended ones released as the run goes (folded every ~1,000 events), not all held.
    assert sorted(positions) == list(range(4000)) and max(built) < 2000
    assert not lazy._made and all(lazy[i] is RELEASED for i in range(4000))
    assert res.results.finish_reasons().count("length") == 4000


@pytest.mark.parametrize("keep", [False, True])
def test_a_simulation_of_lazy_requests_equals_one_of_the_built_list(keep):
    trace, sp = _trace(300), SamplingParams(ignore_eos=True)
    res = simulate(trace_requests(trace, 512, sp, token_ids=False, lazy=True), engine_factory(), 2,
                   "least_outstanding", keep_requests=keep)
    want = simulate(trace_requests(trace, 512, sp, token_ids=False), engine_factory(), 2, "least_outstanding",
                    keep_requests=keep)
    got, exp = request_columns(res.requests), request_columns(want.requests)
    for k in exp:
        assert np.array_equal(np.asarray(got[k]), np.asarray(exp[k]), equal_nan=np.asarray(exp[k]).dtype.kind == "f"), k
    assert res.routed == want.routed and len(res.steps) == len(want.steps)


def test_lazy_requests_out_of_arrival_order_are_ordered_and_released_from_both():
    rows = [TraceRequest(t, 16, 4, None, f"q{i}") for i, t in enumerate([0.3, 0.1, 0.2])]
    lazy = TraceRequests(Trace(rows, TraceStats("test", "test")), 512, SamplingParams(ignore_eos=True), token_ids=False)
    pending, order = arrival_order(lazy)
    assert [r.req_id for r in pending] == ["q1", "q2", "q0"] and order.tolist() == [1, 2, 0]
    rel = Release(lazy, pending, order)
    rel.close()
    assert not lazy._made and rel.results.req_id == ["q0", "q1", "q2"]
