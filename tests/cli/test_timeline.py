"""output.timeline=true: timeline.json is a Chrome/Perfetto trace of the run (varlen/timeline.py)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hydra import compose, initialize_config_dir

import sim.run as sim_run
import varlen.cli  # noqa: F401  (registers the configs' resolvers)


def _sim_cfg(*overrides: str):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        return compose("sim", ["scheduler=chunked", "workload.limit=40", "output.timeline=true", *overrides])


def _run(tmp_path, *overrides: str) -> tuple[object, dict]:
    cfg = _sim_cfg(*overrides)
    res, row = sim_run.simulate_config(cfg)
    sim_run.write_outputs(res, row, tmp_path, cfg)
    return res, json.loads((tmp_path / "timeline.json").read_text())


def _check_fields(events: list[dict]) -> None:
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e


def _spans(events: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["tid"] > 0:
            out[e["args"]["req_id"]].append(e)
    return out


def test_sim_run_timeline_fields_steps_and_request_spans(tmp_path):
    res, doc = _run(tmp_path, "cluster.replicas=2")
    events = doc["traceEvents"]
    _check_fields(events)
    assert doc["otherData"]["events_left_out"] == 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "replica 0"), (1, "replica 1")}

    # Every step, in µs from the run's start; a replica's steps follow one another without overlap.
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(steps) == res.num_steps
    first = min(r.arrival for r in res.requests)
    for rep in res.replicas:
        mine = [e for e in steps if e["pid"] == rep.index]
        assert len(mine) == len(rep.engine.steps)
        for e, s in zip(mine, rep.engine.steps):
            assert e["ts"] == pytest.approx((s.start - first) * 1e6, abs=1e-3)
            assert e["dur"] == pytest.approx(s.duration * 1e6, abs=1e-3)
            assert e["args"]["requests"] == len(s.req_ids)
            assert e["args"]["prefill_tokens"] + e["args"]["decode_tokens"] == sum(s.new_tokens)
            assert e["name"].startswith(f"step {s.step}: ")
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    assert any(e["args"]["prefill_tokens"] > 0 for e in steps) and any(e["args"]["decode_tokens"] > 0 for e in steps)

    # Each request: queued -> prefill -> decode, end to end, on its replica, from arrival to finish.
    spans = _spans(events)
    assert set(spans) == {r.req_id for r in res.requests}
    for r in res.requests:
        s = spans[r.req_id]
        assert [e["name"].split()[0] for e in s] == ["queued", "prefill", "decode"][:len(s)]
        assert s[-1]["name"].startswith("decode") or r.num_output_tokens <= 1
        assert {e["pid"] for e in s} == {res.routed[r.req_id]} and len({e["tid"] for e in s}) == 1
        assert s[0]["ts"] == pytest.approx((r.arrival - first) * 1e6, abs=1e-3)
        for a, b in zip(s, s[1:]):
            assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-2)
        assert s[1]["ts"] == pytest.approx((r.first_scheduled - first) * 1e6, abs=1e-3)
        assert s[-1]["ts"] + s[-1]["dur"] == pytest.approx((r.finish_time - first) * 1e6, abs=1e-2)
    # Lanes: two requests on one lane never overlap.
    lanes = defaultdict(list)
    for s in spans.values():
        lanes[s[0]["pid"], s[0]["tid"]].append((s[0]["ts"], s[-1]["ts"] + s[-1]["dur"]))
    for iv in lanes.values():
        iv.sort()
        assert all(a[1] <= b[0] + 1e-2 for a, b in zip(iv, iv[1:]))


def test_cap_is_respected_and_said(tmp_path, capsys):
    _, full = _run(tmp_path / "full")
    n = len(full["traceEvents"])
    _, doc = _run(tmp_path / "capped", f"output.timeline_max_events={n // 3}")
    events = doc["traceEvents"]
    _check_fields(events)
    assert len(events) == n // 3
    assert events[-1]["name"] == "timeline_truncated"
    left = n - (n // 3 - 1)
    assert events[-1]["args"] == {"max_events": n // 3, "events_left_out": left}
    assert doc["otherData"]["events_left_out"] == left
    assert f"{left} events left out at output.timeline_max_events={n // 3}" in capsys.readouterr().out
    # Exactly at the cap: everything fits, nothing announced.
    _, doc = _run(tmp_path / "exact", f"output.timeline_max_events={n}")
    assert doc["traceEvents"] == full["traceEvents"] and doc["otherData"]["events_left_out"] == 0


def test_disaggregated_pools_and_transfers(tmp_path):
    res, doc = _run(tmp_path, "cluster.mode=disaggregated")
    events = doc["traceEvents"]
    _check_fields(events)
    names = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert names == sorted([f"prefill {i}" for i in range(res.num_prefill)] +
                           [f"decode {i}" for i in range(len(res.replicas) - res.num_prefill)])
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(steps) == res.num_steps
    spans = _spans(events)
    moved = {t.req_id for t in res.transfers}
    assert moved and any("transfer" in [e["name"].split()[0] for e in spans[r]] for r in moved)
    for s in spans.values():
        for a, b in zip(s, s[1:]):
            assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-2)


def test_off_by_default(tmp_path):
    cfg = _sim_cfg("output.timeline=false")
    res, row = sim_run.simulate_config(cfg)
    sim_run.write_outputs(res, row, tmp_path, cfg)
    assert not (tmp_path / "timeline.json").exists()
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        assert compose("sim", []).output.timeline is False


def test_varlen_run_writes_the_timeline(tmp_path, monkeypatch, capsys):
    import pandas as pd

    from tests.cli.test_cli_errors import run_main

    # In this process (a subprocess would spend ~10 s importing torch and transformers).
    monkeypatch.setenv("VARLEN_HOME", str(tmp_path / "home"))
    code, _, err = run_main("varlen.run", [f"hydra.run.dir={tmp_path / 'out'}", "progress=false", "engine.threads=1",
                                           "workload.limit=6", "workload.output_len=uniform:2:6", "output.timeline=true"],
                            monkeypatch, capsys, through_cli=True)
    assert code == 0, err
    out = tmp_path / "out"
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    _check_fields(events)
    steps, reqs = pd.read_csv(out / "steps.csv"), pd.read_csv(out / "requests.csv")
    mine = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert [e["args"]["requests"] for e in mine] == steps.num_seqs.tolist()
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
    spans = _spans(events)
    assert set(spans) == set(reqs.req_id.astype(str))
    for s in spans.values():
        assert [e["name"].split()[0] for e in s] == ["queued", "prefill", "decode"]
        assert all(a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-2) for a, b in zip(s, s[1:]))
