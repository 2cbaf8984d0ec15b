"""Streamed token times (issue 26): a simulation without token-level output keeps no per-request
token_times list; each request keeps its first and last token time, its count and its longest gap,
and the engine counts every gap into the run's gap table as it happens (a decode run's shared gaps
once, times its batch). The figures and the table equal those of the stored token times, bit for
bit, preemptions included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fast_forward import FastForwardEngine
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.metrics import GapCounts, RequestResults
from varlen.request import FinishReason
from varlen.testing.fast_forward import factory, shared_prefix_requests

PERCENTILES = [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100]


class OwnStopRule(FastForwardEngine):
    """Its own stop rule (the same one): Engine._step's loop and the decode runs' general path run."""

    def _stop_reason(self, r, tok):
        return super()._stop_reason(r, tok)

    def _decode_run(self, batch, until):  # keeps the decode runs' promise (varlen/promises.py)
        return super()._decode_run(batch, until)


def _factory(policy: str, allocator: str, blocks: int, own_rule: bool):
    make = factory(policy, allocator, blocks)
    if not own_rule:
        return make

    def make_own(clock):
        e, ex = make(clock)
        return OwnStopRule(e.policy, e.kv, ex, clock=clock, max_model_len=e.max_model_len), ex

    return make_own


def _streaming(make, tables: list[GapCounts]):
    """make_engine whose engines stream their token times into one gap table (appended to `tables`)."""
    table = GapCounts()
    table.FOLD = 64  # fold often: the merges of streamed batches are exercised
    tables.append(table)

    def make_streaming(clock):
        engine, ex = make(clock)
        engine.stream_token_times(table.add_counts)
        return engine, ex

    return make_streaming


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(["chunked", "sarathi", "vllm_v0", "continuous"]),
       allocator=st.sampled_from(["paged", "paged-cache", "contiguous-pow2"]),
       blocks=st.sampled_from([24, 60, 400]), replicas=st.integers(1, 3), fast_forward=st.booleans(),
       n=st.integers(1, 40), rate=st.sampled_from([2.0, 30.0, 300.0]), seed=st.integers(0, 2**16),
       own_rule=st.booleans())
def test_streamed_figures_and_gaps_equal_the_stored_token_times(policy, allocator, blocks, replicas, fast_forward,
                                                                 n, rate, seed, own_rule):
    reqs = shared_prefix_requests(n, rate, seed, max_len=300)
    make = _factory(policy, allocator, blocks, own_rule)
    tables: list[GapCounts] = []
    kw = dict(num_replicas=replicas, router="least_outstanding", fast_forward=fast_forward)
    stored = simulate(fresh_copies(reqs), make, **kw)
    streamed = simulate(fresh_copies(reqs), _streaming(make, tables), **kw)
    for rep in streamed.replicas:
        rep.engine.flush_token_gaps()
    gaps = []
    for a, b in zip(stored.requests, streamed.requests):
        assert a.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and b.finish_reason == a.finish_reason
        assert b.output_token_ids == a.output_token_ids and b.finish_time == a.finish_time
        t = a.token_times
        assert b.token_times == [] and b.num_token_times == len(t) > 0
        assert (b.first_token_time, b.last_token_time) == (t[0], t[-1])
        if len(t) > 1:
            d = np.diff(t)
            gaps.append(d)
            assert b.max_token_gap == d.max()
    table = tables[0]
    everything = np.concatenate(gaps) if gaps else np.empty(0)
    assert len(table) == len(everything)
    want = [float(v) for v in np.percentile(everything, PERCENTILES)] if len(everything) else [np.nan] * 10
    assert np.array_equal(table.percentiles(PERCENTILES), want, equal_nan=True)
    # Every figure the summary and requests.csv read, from the streamed fields and the streamed table.
    x, y = RequestResults.of(stored.requests), RequestResults.of(streamed.requests)
    y.itl.absorb(table)
    for k in RequestResults._ARRAYS:
        assert np.array_equal(getattr(x, k), getattr(y, k), equal_nan=getattr(x, k).dtype.kind == "f"), k
    assert np.array_equal(x.itl.table()[0], y.itl.table()[0]) and np.array_equal(x.itl.table()[1], y.itl.table()[1])


def test_a_released_simulation_keeps_no_token_times_lists():
    """simulate(keep_requests=False): the requests in flight carry their counts, not lists of times."""
    seen: list[tuple[int, int]] = []

    def route(replicas, req):  # reads every replica (no `reads`): looks at what its requests hold
        for rep in replicas:
            seen.extend((len(r.token_times), r.num_token_times) for r in rep.engine.policy.running)
        return min(range(len(replicas)), key=lambda k: replicas[k].outstanding)

    reqs = shared_prefix_requests(60, 40.0, 3)
    res = simulate(fresh_copies(reqs), factory("chunked", "paged", 400), num_replicas=2, router=route,
                   keep_requests=False)
    assert isinstance(res.requests, RequestResults) and res.requests.done.all()
    assert any(n > 1 for _, n in seen) and all(kept == 0 for kept, _ in seen)
    assert len(res.requests.itl) == int((res.requests.output_tokens - 1).sum())


def test_aborting_a_request_whose_gaps_were_streamed_is_refused_with_the_fix():
    """Its gaps are in the table already and cannot be taken back: an error, not a wrong percentile."""
    reqs = shared_prefix_requests(3, 1000.0, 5)
    make = factory("chunked", "paged", 400)
    from varlen.clock import SimClock

    engine, _ = make(SimClock())
    table = GapCounts()
    engine.stream_token_times(table.add_counts)
    for r in reqs:
        engine.add_request(r)
    while min(r.num_token_times for r in reqs) < 2:
        engine.step()
    one = reqs[0]
    with pytest.raises(RuntimeError, match="output.token_times=true"):
        engine.abort(one.req_id)
    assert not one.is_finished
    fresh = fresh_copies(reqs[:1])[0]
    fresh.req_id = "fresh"
    engine.add_request(fresh)
    engine.abort("fresh")  # no token yet, no gap counted: aborted as usual
    assert fresh.finish_reason is FinishReason.ABORTED
