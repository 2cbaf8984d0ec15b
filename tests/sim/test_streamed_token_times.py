"""Streamed token times (issue 26): a simulation without token-level output keeps no per-request
token_times list; each request keeps its first and last token time, its count and its longest gap,
and the engine counts every gap into the run's gap table as it happens (a decode run's shared gaps
once, times its batch). The figures and the table equal those of the stored token times, bit for
bit, preemptions included. A request that could outgrow the whole KV pool (so may end aborted) keeps
its token times: it ends aborted with its reason, and the run goes on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra import compose, initialize_config_dir

from sim.fast_forward import FastForwardEngine
from sim.run import CONF, _simulate_paused, write_outputs
from sim.simulator import simulate
from sim.validate import fresh_copies
from varlen.kv import PagedAllocator
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


class OverclaimingPool(PagedAllocator):
    """A plug-in pool that says it holds requests longer than itself (a user's allocator may): a request
    whose prompt fits but whose prompt + outputs outgrow the pool is preempted alone, can never be
    re-admitted, and the engine aborts it (Engine._unstick)."""

    def max_request_tokens(self) -> int:
        return self.max_model_len


def _factory(policy: str, allocator: str, blocks: int, own_rule: bool):
    over = allocator.endswith("-overclaiming")
    make = factory(policy, allocator.removesuffix("-overclaiming"), blocks)
    if not own_rule and not over:
        return make

    def make_other(clock):
        e, ex = make(clock)
        kv = OverclaimingPool(blocks, 16, 1024, enable_prefix_caching=allocator.startswith("paged-cache")) \
            if over else e.kv
        cls = OwnStopRule if own_rule else FastForwardEngine
        return cls(e.policy, kv, ex, clock=clock, max_model_len=1024 if over else e.max_model_len), ex

    return make_other


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
       allocator=st.sampled_from(["paged", "paged-cache", "contiguous-pow2", "paged-overclaiming",
                                  "paged-cache-overclaiming"]),
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
    engine = streamed.replicas[0].engine
    capacity, longest = engine.kv.capacity_tokens, engine.max_model_len  # longest > capacity: overclaiming
    for a, b in zip(stored.requests, streamed.requests):
        assert b.finish_reason == a.finish_reason and b.finish_message == a.finish_message
        assert b.output_token_ids == a.output_token_ids and b.finish_time == a.finish_time
        t = a.token_times
        if min(b.num_prompt_tokens + b.sampling.max_tokens, longest) > capacity:  # may end aborted: keeps its times
            assert not b.streams_token_times and b.num_token_times == 0 and b.token_times == t
            continue
        assert a.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
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
    with pytest.raises(RuntimeError, match=r"abort\(\): aborted by the caller.*output.token_times=true"):
        engine.abort(one.req_id)
    assert not one.is_finished
    fresh = fresh_copies(reqs[:1])[0]
    fresh.req_id = "fresh"
    engine.add_request(fresh)
    engine.abort("fresh")  # no token yet, no gap counted: aborted as usual
    assert fresh.finish_reason is FinishReason.ABORTED


def _run(overrides: list[str], token_times: bool, out):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides + [f"output.token_times={str(token_times).lower()}",
                                                    "progress.enabled=false"])
    out.mkdir()
    res, row, results = _simulate_paused(cfg, {"scheduler": "chunked", "allocator": "paged"}, False)
    write_outputs(res, row, out, cfg, results)
    return res, {k: v for k, v in row.items() if k not in ("sim_wall_s", "sim_requests_per_wall_s")}


def test_a_request_outgrowing_the_pool_ends_aborted_and_the_run_equals_token_level_output(tmp_path):
    """One bad request never breaks the others: streamed or not, it ends aborted with its reason, the
    others finish, and every summary figure and requests.csv equal the token-level run's."""
    over = ["workload=synthetic", "workload.limit=60", "workload.rate=20", "workload.prompt_len=uniform:16:100",
            "workload.output_len=uniform:1:150", "engine.num_blocks=8", "cluster.replicas=2",
            "cluster.router=least_outstanding", f"allocator._target_={__name__}.OverclaimingPool"]
    tok_res, tok_row = _run(over, True, tmp_path / "tokens")
    col_res, col_row = _run(over, False, tmp_path / "columns")
    assert isinstance(col_res.requests, RequestResults)
    reasons = [r.finish_reason for r in tok_res.requests]
    aborted = [r for r in tok_res.requests if r.finish_reason is FinishReason.ABORTED]
    assert aborted and all("could not be scheduled on an idle engine" in r.finish_message for r in aborted)
    assert all(len(r.token_times) > 1 for r in aborted)  # their gaps would have been streamed
    assert all(x in (FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORTED) for x in reasons)
    assert reasons.count(FinishReason.ABORTED) < len(reasons) - 10
    assert tok_row.keys() == col_row.keys()
    for k in tok_row:
        x, y = tok_row[k], col_row[k]
        assert x == y or (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y)), (k, x, y)
    assert (tmp_path / "columns" / "requests.csv").read_bytes() == (tmp_path / "tokens" / "requests.csv").read_bytes()
