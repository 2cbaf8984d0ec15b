"""Disaggregated prefill/decode (sim/disagg.py, sim/cluster.py): each request's timeline is
consistent (prefill end <= transfer start <= transfer end <= first decode step), its prompt is
computed once (on the prefill instance), TTFT is the prefill's first token, KV is freed on both
sides, every request finishes with its token count; bad cluster settings are one-line errors."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hydra import compose, initialize_config_dir

import sim.run as sim_run
from schedulers import ChunkedPolicy
from sim.cluster import check_cluster
from sim.cost.roofline import RooflineCostModel
from sim.disagg import DisaggEngine, Link, receiving, simulate_disaggregated
from sim.executor import CostModelExecutor
from varlen.cli import SettingError
from varlen.kv import ContiguousAllocator, PagedAllocator
from varlen.promises import keeps_promise
from varlen.kv.base import ALLOCATION_PROMISE_BEHAVIOUR, KVAllocator
from varlen.sampling_params import SamplingParams
from varlen.traces import load_trace
from varlen.workload import trace_requests

MAX_LEN = 2048


def trace(n=120):
    tr = load_trace("mooncake_conv", limit=n, max_model_len=MAX_LEN, over_length="clip", rate=6.0)
    return trace_requests(tr, 512, SamplingParams(ignore_eos=True), token_ids=True)


def factory(role, num_blocks, alloc=PagedAllocator):
    cost = RooflineCostModel("tiny", "cpu_2core")
    cls = alloc if role == "prefill" else receiving(alloc)

    def make(clock):
        ex = CostModelExecutor(cost, clock)
        kv = cls(num_blocks, 16, MAX_LEN)
        eng = DisaggEngine(ChunkedPolicy(max_num_seqs=16, max_num_batched_tokens=512), kv, ex, clock=clock,
                           max_model_len=MAX_LEN, keep_finished_kv=role == "prefill")
        return eng, ex

    return make


def per_request_steps(engine):
    out = defaultdict(list)  # req_id -> [(start, end, new, cached)]
    for rec in engine.steps:
        for rid, n, c in zip(rec.req_ids, rec.new_tokens, rec.cached_tokens):
            out[rid].append((rec.start, rec.start + rec.duration, n, c))
    return out


# Roomy, and tight: transfers wait for decode room, decodes preempt, and the prefill instance's
# pool fills with KV it holds for them, so its queue waits for transfers to end.
@pytest.mark.parametrize("prefill_blocks, decode_blocks", [(600, 4000), (200, 140)])
def test_one_prefill_one_decode_timelines(prefill_blocks, decode_blocks):
    reqs = trace()
    link = Link("test", bandwidth_gbs=0.5, latency_s=1e-3)  # slow: transfers take visible time
    res = simulate_disaggregated(reqs, factory("prefill", prefill_blocks), factory("decode", decode_blocks), 1, 1, link,
                                 kv_bytes_per_token=4096.0)
    pre, dec = res.prefill[0].engine, res.decode[0].engine
    on_pre, on_dec = per_request_steps(pre), per_request_steps(dec)
    transfers = {t.req_id: t for t in res.transfers}
    assert all(r.finish_reason.value == "length" and r.num_output_tokens == r.sampling.max_tokens for r in reqs)
    waited = 0
    for r in reqs:
        p = on_pre[r.req_id]
        assert sum(n for *_, n, _ in p) + p[0][3] == r.num_prompt_tokens  # the prompt, once (less its hits)
        assert r.token_times[0] == p[-1][1]  # TTFT: the first token comes from the prefill's last step
        if r.sampling.max_tokens == 1:
            assert r.req_id not in transfers and r.req_id not in on_dec
            continue
        t = transfers[r.req_id]
        assert t.ready == r.token_times[0] <= t.start < t.end
        assert t.end - t.start == pytest.approx(link.seconds(r.num_prompt_tokens * 4096.0))
        assert t.bytes == r.num_prompt_tokens * 4096.0 and t.tokens == r.num_prompt_tokens
        d = on_dec[r.req_id]
        assert d[0][0] >= t.end  # the first decode step starts after the KV has arrived
        if r.num_preemptions == 0:  # never recomputed: one token per decode step, the prompt cached
            assert d[0][2:] == (1, r.num_prompt_tokens)
            assert sum(n for _, _, n, _ in d) == r.sampling.max_tokens - 1
        waited += t.start > t.ready
    if decode_blocks == 140:
        assert waited > 0 and dec.num_preemptions > 0  # the tight case exercises both
    for eng in (pre, dec):  # each instance's steps one after another, never back in time
        ends = [(rec.start, rec.start + rec.duration) for rec in eng.steps]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    if decode_blocks == 140:
        assert res.blocked[0] > 0, "the tight case has the prefill instance wait for its held KV"
    # Transfers never overlap on a port (one prefill, one decode instance: one at a time).
    spans = sorted((t.start, t.end) for t in res.transfers)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for eng in (pre, dec):  # KV freed on both sides
        assert eng.kv.usage().reserved_slots == 0 and eng.kv.live_tokens == 0 and not eng.kv.tables
        assert not eng.held and not eng.incoming and not eng.requests
    assert not dec.kv.received


def test_contiguous_pools_and_several_instances():
    reqs = trace(80)
    res = simulate_disaggregated(reqs, factory("prefill", 2000, ContiguousAllocator), factory("decode", 3000, ContiguousAllocator),
                                 2, 3, Link("nvlink", 450, 5e-6), 1024.0, streams=2, router="least_outstanding")
    assert all(r.finish_reason.value == "length" and r.num_output_tokens == r.sampling.max_tokens for r in reqs)
    # Tensor-parallel pools: each GPU sends its shard, two streams at once.
    assert all(t.end - t.start == pytest.approx(5e-6 + t.tokens * 1024.0 / 2 / 450e9) for t in res.transfers)
    assert set(res.routed.values()) == {0, 1} and set(res.decode_routed.values()) == {2, 3, 4}
    for rep in res.replicas:
        assert rep.engine.kv.usage().reserved_slots == 0 and not rep.engine.kv.runs


def test_receiving_allocator_keeps_its_decode_promises():
    kv = receiving(PagedAllocator)(10, 16, 160, enable_prefix_caching=False)
    assert keeps_promise(kv, ("next_allocation_event", "grow_decodes"), ALLOCATION_PROMISE_BEHAVIOUR, KVAllocator)
    assert receiving(PagedAllocator) is type(kv)
    # The count horizon's promise too (it rests on the decode-growth methods the subclass re-declares):
    # otherwise every disaggregated run warns and its decode pools lose the horizon.
    from varlen.promises import broken_by

    assert broken_by(type(kv), "decode_steps_fit", (*ALLOCATION_PROMISE_BEHAVIOUR, "next_allocation_event",
                                                    "grow_decodes"), KVAllocator) == ""


def sim_cfg(*overrides):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        return compose("sim", list(overrides))


@pytest.mark.parametrize("overrides, match", [
    (["cluster.mode=split"], r"cluster.mode='split' is unknown; choose colocated or disaggregated"),
    (["cluster.mode=disaggregated", "cluster.link=carrier_pigeon"], r"cluster.link='carrier_pigeon' is unknown; choose one of nvlink"),
    (["cluster.mode=disaggregated", "cluster.prefill_replicas=0"], r"cluster.prefill_replicas"),
    (["cluster.mode=disaggregated", "parallel.pipeline=2"], r"parallel.pipeline=2: each pool has its own; use parallel.pipeline=1 and cluster.prefill.pipeline"),
    (["cluster.mode=disaggregated", "cluster.decode.hardware=tpu"], r"cluster.decode.hardware='tpu' is unknown; choose one of .*h100_sxm"),
    (["cluster.mode=disaggregated", "cluster.prefill.scheduler=fifo"], r"cluster.prefill.scheduler='fifo' is unknown"),
    (["cluster.mode=disaggregated", "cluster.decode.tensor=0"], r"cluster.decode.tensor"),
    (["cluster.mode=disaggregated", "cluster.prefill.pipeline=0"], r"cluster.prefill.pipeline=0 is not valid"),
    (["cluster.mode=disaggregated", "+cluster.decode.gpus=2"], r"cluster.decode.gpus is not a per-pool setting"),
    (["cluster.mode=disaggregated", "cluster.links.nvlink.bandwidth_gbs=0"], r"cluster.links.nvlink.bandwidth_gbs"),
])
def test_bad_cluster_settings_are_one_line_errors(overrides, match):
    with pytest.raises(SettingError, match=match) as e:
        check_cluster(sim_cfg(*overrides))
    assert "\n" not in str(e.value)


def test_disaggregated_run_from_config_reports_transfers_and_pools():
    cfg = sim_cfg("sim_model=llama3_8b", "workload=azure_conv", "workload.limit=60", "cluster.mode=disaggregated",
                  "cluster.prefill_replicas=1", "cluster.decode_replicas=2", "cluster.link=infiniband",
                  "cluster.decode.max_num_batched_tokens=1024", "cluster.prefill.tensor=2")
    res, row = sim_run.simulate_config(cfg)
    assert row["finished"] == 60 and row["mode"] == "disaggregated" and row["gpus"] == 4
    assert row["transfers"] == sum(r.num_output_tokens > 1 for r in res.requests)
    assert row["transfer_bytes_total"] == pytest.approx(sum(t.tokens for t in res.transfers) * 131072)  # Llama-3-8B
    assert 0 < row["transfer_mean_s"] <= row["transfer_p99_s"]
    assert 0 < row["prefill_busy"] < 1 and 0 < row["decode_busy"] < 1
    assert row["decode_max_num_batched_tokens"] == 1024 and row["prefill_tensor"] == 2
    assert res.decode[0].engine.policy.max_num_batched_tokens == 1024
    with pytest.raises(SettingError, match=r"cluster.decode: .*does not fit"):
        sim_run.simulate_config(sim_cfg("sim_model=llama2_70b", "workload.limit=5", "cluster.mode=disaggregated",
                                        "cluster.prefill.tensor=4"))


def test_pipeline_stages_in_a_pool_are_batches_in_flight():
    """cluster.decode.pipeline=2 as colocated PP (sim/parallel.py): each decode instance is two, each with half
    the KV a TP1 x PP2 group holds and a step taking the whole pipeline's latency; the GPUs count both stages."""
    from sim.cost.hardware import HardwareSpec
    from sim.parallel import Parallelism, capacity

    cfg = sim_cfg("sim_model=llama3_8b", "hardware=a100_80gb_sxm", "workload=azure_conv", "workload.limit=60",
                  "cluster.mode=disaggregated", "cluster.prefill.tensor=2", "cluster.decode_replicas=2",
                  "cluster.decode.pipeline=2", "progress.enabled=false")
    res, row = sim_run.simulate_config(cfg)
    assert row["finished"] == 60 and row["decode_pipeline"] == 2 and row["prefill_pipeline"] == 1
    assert row["gpus"] == 2 + 2 * 2 and len(res.decode) == 4 and len(res.prefill) == 1
    c = sim_run.OmegaConf.to_container(cfg, resolve=True)
    group = capacity(sim_run.load_sim_model(c["sim_model"]["config"]), HardwareSpec.from_dict(c["hardware"]),
                     Parallelism(1, 2), 0.9).kv_tokens
    assert {r.engine.kv.capacity_tokens for r in res.decode} == {group // 16 // 2 * 16}
    assert {r.engine.executor.cost.pipeline for r in res.decode} == {2}
    assert res.prefill[0].engine.executor.cost.pipeline == 1
    assert len(set(res.decode_routed.values())) == 4  # every in-flight batch serves requests


@pytest.mark.parametrize("decode_blocks, num_decode", [(4000, 2), (140, 1)])
def test_fast_forward_changes_nothing(decode_blocks, num_decode):
    """The decode instances' fast-forward gives every request the same timeline as stepping one
    step at a time (transfers waiting for room included)."""
    runs = []
    for ff in (True, False):
        reqs = trace(100)
        res = simulate_disaggregated(reqs, factory("prefill", 600), factory("decode", decode_blocks), 1,
                                     num_decode, Link("t", 0.5, 1e-3), 4096.0, fast_forward=ff)
        runs.append(([(r.req_id, r.token_times, r.finish_reason) for r in reqs],
                     [(t.req_id, t.start, t.end, t.decode) for t in res.transfers],
                     sum(rep.engine.num_fast_forwarded_steps for rep in res.decode)))
    (a, ta, fa), (b, tb, fb) = runs
    assert fa > 0 and fb == 0
    assert ta == tb
    assert a == b


def test_report_keeps_cluster_designs_apart(tmp_path):
    """A sweep over cluster.mode (or routers) draws one line per design, not one joined line."""
    import json

    from sim.report import gather

    base = dict(scheduler="chunked", allocator="paged", rate=1.0, requests_per_s=1.0, router="round_robin")
    for i, extra in enumerate([dict(mode="colocated"), dict(mode="disaggregated"),
                               dict(mode="colocated", router="prefix_aware")]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "summary.json").write_text(json.dumps({**base, **extra}))
    assert sorted(gather([tmp_path])["policy"]) == ["chunked/paged P/D round_robin", "chunked/paged colocated prefix_aware",
                                                    "chunked/paged colocated round_robin"]
    (tmp_path / "1" / "summary.json").unlink()
    (tmp_path / "2" / "summary.json").unlink()
    assert list(gather([tmp_path])["policy"]) == ["chunked/paged"]  # one design: the label as before


def test_received_requests_queue_as_the_policy_queues_arrivals():
    """The framework never reorders a policy's queue (static's preempted member stays at its head)."""
    from varlen.clock import SimClock
    from varlen.request import Request

    eng, _ = factory("decode", 100)(SimClock())
    other = Request("other", list(range(40)), SamplingParams(max_tokens=3))
    eng.add_request(other)
    got = []
    for name in ("a", "b", "c"):
        r = Request(name, list(range(100, 140)), SamplingParams(max_tokens=3))
        r.output_token_ids.append(0)  # its first token, from the prefill instance
        assert eng.kv.reserve(r, r.num_prompt_tokens)
        eng.receive(r)
        got.append(r)
    assert [r.req_id for r in eng.policy.waiting] == ["other", "a", "b", "c"]
    eng.step()  # admitted with the prompt cached: one token each, nothing recomputed
    assert [(rec.req_ids, rec.new_tokens, rec.cached_tokens) for rec in eng.steps][0][:2] == (
        ["other", "a", "b", "c"], [40, 1, 1, 1])
    assert all(r.num_output_tokens == 2 for r in got)


def test_idle_decode_instance_takes_back_received_blocks_its_queue_head_needs():
    """A request needing memory at the head, received ones holding the pool behind it, nothing
    running: the last received is recomputed here, the head runs, nothing is aborted."""
    from varlen.clock import SimClock
    from varlen.request import Request

    eng, _ = factory("decode", 10)(SimClock())  # 160 slots
    head = Request("head", list(range(60)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_request(head)  # as a request preempted here: it needs blocks
    got = []
    for k, name in enumerate(("a", "b", "c")):
        r = Request(name, list(range(100 * k + 100, 100 * k + 132)), SamplingParams(max_tokens=3, ignore_eos=True))
        r.output_token_ids.append(0)
        assert eng.kv.reserve(r, r.num_prompt_tokens)  # 3 blocks each: 9 of 10 held
        eng.receive(r)
        got.append(r)
    eng.step()
    assert eng.steps[0].req_ids == ["head", "a", "b"] and eng.num_evicted == 1
    assert got[2].num_preemptions == 1 and "c" not in eng.kv.received
    while eng.has_unfinished():
        eng.step()
    assert all(r.finish_reason.value == "length" for r in [head, *got])
    assert [r.num_output_tokens for r in got] == [3, 3, 3] and eng.kv.usage().reserved_slots == 0


# The runs (decode pool of 300 blocks, 150 requests at 100 req/s): a request preempted on
# the decode instance waited at the head for blocks that received requests behind it held.
@pytest.mark.parametrize("decode", [["cluster.decode.scheduler=static"], ["cluster.decode.scheduler=sjf"],
                                    ["cluster.decode.scheduler=priority"],
                                    ["cluster.decode.scheduler=chunked", "cluster.decode.max_num_seqs=2"]])
def test_tight_decode_pool_serves_every_request(decode):
    cfg = sim_cfg("cluster.mode=disaggregated", "cluster.decode.num_blocks=300", "workload.limit=150",
                  "workload.rate=100", *decode)
    res, row = sim_run.simulate_config(cfg)
    bad = [(r.req_id, r.finish_reason.value, r.finish_message) for r in res.requests
           if r.finish_reason.value != "length" or r.num_output_tokens != r.sampling.max_tokens]
    assert not bad and row["finished"] == 150
    assert res.decode[0].engine.num_preemptions > 0  # the tight case it is meant to be
    assert not res.decode[0].engine.kv.received and not res.decode[0].engine.requests


def test_request_longer_than_the_decode_pool_is_rejected_up_front():
    # The trace unclipped (over_length=clip would clip to what the pool holds): the engine must refuse them.
    cfg = sim_cfg("cluster.mode=disaggregated", "cluster.decode.num_blocks=20", "workload.limit=40",
                  "workload.rate=100", "workload.max_model_len=null")
    res, row = sim_run.simulate_config(cfg)
    reasons = {r.finish_reason.value for r in res.requests}
    rejected = [r for r in res.requests if r.finish_reason.value == "rejected"]
    assert reasons == {"length", "rejected"} and rejected
    assert all(r.num_prompt_tokens > 320 and "longer than max_model_len (320 tokens)" in r.finish_message
               for r in rejected)


@pytest.mark.parametrize("value", [-1, True, 99, None, 1.0])
def test_a_router_returning_no_prefill_instance_is_one_line_naming_it(value):
    """Checked where it enters: no prefill copy reaches a decode instance (-1 was the last one)."""
    def bad_router(replicas, req):
        return value

    reqs = trace(40)
    with pytest.raises(ValueError, match=rf"router .*bad_router returned {value!r} .*\[0, 1\]") as e:
        simulate_disaggregated(reqs, factory("prefill", 600), factory("decode", 600), 2, 1, Link("t", 450, 5e-6),
                               1024.0, router=bad_router)
    assert "\n" not in str(e.value)
