"""`python -m sim.search` end to end on a tiny grid, its pruning and its settings' errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.search import Point, pareto_front, replicas_for

ROOT = Path(__file__).resolve().parents[2]
TARGET = 12.0
# Llama-3-8B (16 GB of weights) in 30% of each GPU's memory: one A40 (14.4 GB) cannot hold it, two
# can, an A100 or H100 can; cpu_2core has no price. Short trace, coarse bisection: seconds.
TINY = ["workload.limit=60", "engine.gpu_memory_utilization=0.3", "capacity.rel_tol=0.3",
        f"search.target_rate={TARGET}", "search.hardware=[a40,a100_80gb_sxm,h100_sxm,cpu_2core]",
        "search.tensor=[1,2]", "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]",
        "slo.ttft_s=1", "slo.tpot_s=0.05"]


def run(module: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, f"hydra.run.dir={tmp}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def dominated(p: pd.Series, others: pd.DataFrame) -> bool:
    return bool(((others.cost_per_hour <= p.cost_per_hour) & (others.capacity >= p.capacity)
                 & ((others.cost_per_hour < p.cost_per_hour) | (others.capacity > p.capacity))).any())


@pytest.fixture(scope="module")
def tiny_search(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "run"
    res = run("sim.search", out, *TINY)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res.stdout


def test_search_finds_the_cheapest_checked_deployment_and_its_pareto_set(tiny_search, tmp_path):
    out, stdout = tiny_search
    table = pd.read_csv(out / "search.csv")
    result = json.loads((out / "search.json").read_text())
    # Pruned, each with its reason: TP1 does not fit, cpu_2core has no price (a line, not a row).
    assert "cpu_2core: no cost_per_gpu_hour" in stdout and set(table.hardware) == {"a40", "a100_80gb_sxm", "h100_sxm"}
    unfit = table[table.status == "does not fit"]
    assert set(zip(unfit.hardware, unfit.tensor)) == {("a40", 1)} and len(unfit) == 1
    assert unfit.reason.str.contains("use at least 2 GPUs").all()
    assert table[table.status != "does not fit"].status.isin(["ok", "misses SLOs"]).all(), table.reason
    ok = table[table.status == "ok"]
    assert len(ok) >= 3
    assert (ok.replicas == [replicas_for(TARGET, c) for c in ok.replica_capacity]).all()
    assert ok.cost_per_hour.tolist() == pytest.approx((ok.replicas * ok.tensor * ok.cost_per_gpu_hour).tolist())

    # The Pareto set: none of it dominated by any deployment, every deployment left out dominated by it.
    front = pd.DataFrame(result["pareto"])
    assert 2 <= len(front) < len(ok)  # a real choice: some deployments are dominated
    for _, p in front.iterrows():
        assert not dominated(p, ok), p.to_dict()
    keys = set(zip(front.hardware, front.tensor, front.budget.fillna(-1)))
    for _, p in ok.iterrows():
        if (p.hardware, p.tensor, -1 if pd.isna(p.budget) else p.budget) not in keys:
            assert dominated(p, front), p.to_dict()
    assert "Pareto set" in stdout and (out / "pareto.png").stat().st_size > 10_000

    # The choice: the cheapest deployment, checked at the target rate by the search ...
    chosen = result["chosen"]
    assert chosen["verified"] is True and chosen["status"] == "ok"
    assert chosen["cost_per_hour"] == pytest.approx(ok.cost_per_hour.min())
    verified = json.loads((out / "verified" / "summary.json").read_text())
    assert verified["replicas"] == chosen["replicas"] and verified["slo_attainment"] >= 0.9
    # ... and again by sim.run, from the command the search printed.
    assert f"python -m sim.run {chosen['sim_run']}" in stdout
    again = run("sim.run", tmp_path / "again", *chosen["sim_run"].split())
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert summary["replicas"] == chosen["replicas"] and summary["tensor"] == chosen["tensor"]
    assert summary["hardware"] == chosen["hardware"] and summary["slo_attainment"] >= 0.9
    assert summary["trace_num_returned"] == 60 and summary["slo_attainment"] == verified["slo_attainment"]


def test_a_deployment_that_misses_at_the_target_gets_another_replica() -> None:
    """The check, not the estimate, decides: a deployment found short gets a replica more."""
    from omegaconf import OmegaConf

    from sim.search import Search

    cfg = OmegaConf.create({"search": {"target_rate": 10.0, "max_gpus": 8, "max_verify": 5},
                            "capacity": {"attainment": 0.9}})
    a, b = Point("x", 1, 1, "chunked", 512, cost_per_gpu_hour=1.0), Point("y", 1, 1, "chunked", 512, cost_per_gpu_hour=2.5)
    for p, cap in ((a, 5.0), (b, 10.0)):
        p.status, p.replica_capacity, p.replicas = "ok", cap, replicas_for(10.0, cap)
    needs = {"x": 4, "y": 1}  # what each really needs at the target (x's estimate says 2)
    s = Search(cfg, compose=None, labels={}, log=lambda _: None)

    def verify(p):
        ok = p.replicas >= needs[p.hardware]
        p.checks.append({"replicas": p.replicas, "meets": ok})
        p.verified = ok
        return ok, None, {"slo_attainment": 1.0 if ok else 0.5}, None

    s.verify = verify
    chosen, *_ = s.cheapest_verified([a, b])
    # x at 2 ($2) misses, x at 3 ($3) is dearer than y at 1 ($2.5), which meets.
    assert chosen is b and [c["replicas"] for c in a.checks] == [2] and a.replicas == 3 and a.verified is None


@pytest.mark.parametrize("max_s_per_token, meets", [(10.0, True), (1e-4, False)])
def test_the_check_at_the_target_is_the_capacity_criterion_not_slo_attainment(max_s_per_token, meets) -> None:
    """capacity.criterion=normalized_latency: the check of a deployment at the target applies the
    criterion its replicas were sized by, whatever the SLOs (set unmeetable here) say."""
    from hydra import compose, initialize_config_dir

    from sim.run import CONF
    from sim.search import Search

    base = ["workload=synthetic", "workload.limit=60", "slo.ttft_s=0.0001", "search.target_rate=2",
            "capacity.criterion=normalized_latency", f"+capacity.criterion_options.max_s_per_token={max_s_per_token}"]
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("search", overrides=base)
        search = Search(cfg, lambda o: compose("search", overrides=[*base, *o]),
                        labels={"scheduler": "chunked", "allocator": "paged"}, log=lambda _: None)
        p = Point("a100_80gb_sxm", 1, 1, "chunked", 512, cost_per_gpu_hour=1.0)
        p.replicas = 1
        ok, _, row, _ = search.verify(p)
    assert row["slo_attainment"] < 0.9  # the SLOs alone would call it a miss
    check = p.checks[-1]
    assert ok is meets and p.verified is meets and check["meets"] is meets
    assert check["reason"].startswith("mean normalized latency")
    assert check["bound_by"] == (None if meets else "normalized_latency")


def test_a_replica_larger_than_max_gpus_is_left_out_unsimulated() -> None:
    from omegaconf import OmegaConf

    from sim.search import Search

    cfg = OmegaConf.create({"search": {"target_rate": 1.0, "max_gpus": 4}, "capacity": {"attainment": 0.9}})
    p = Point("h100_sxm", 4, 2, "chunked", 512, cost_per_gpu_hour=1.0)
    Search(cfg, compose=None, labels={}).replica_capacity(p)  # compose=None: nothing may be simulated
    assert p.status == "over max_gpus" and "8 GPUs" in p.reason and p.replicas is None


# The P/D split: a100 alone, tight SLOs (prefill interference matters), PP1 and PP2 (PP2 is refused
# by a disaggregated cluster). ~10 s.
PD = ["workload.limit=200", "capacity.rel_tol=0.3", "search.hardware=[a100_80gb_sxm]", "search.tensor=[1]",
      "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]", "slo.ttft_s=0.5", "slo.tpot_s=0.03"]


def test_a_search_over_pd_splits_sizes_them_by_units_and_keeps_the_split(tmp_path) -> None:
    out, target = tmp_path / "run", 5.0
    # 1,000 requests: the first 200 of the Azure trace come in bursts that a capacity probe cannot
    # tell from an overload (sim.capacity's steady state), which leaves no P:D unit on the front.
    pd_1000 = [o for o in PD if not o.startswith("workload.limit=")] + ["workload.limit=1000"]
    res = run("sim.search", out, *pd_1000, f"search.target_rate={target}", "search.pipeline=[1,2]",
              "search.cluster_mode=[colocated,disaggregated]", "search.pd_splits=[[1,1],[2,1]]")
    assert res.returncode == 0, res.stderr[-3000:]
    table = pd.read_csv(out / "search.csv", keep_default_na=False, na_values=[""])
    result = json.loads((out / "search.json").read_text())
    assert sorted(zip(table["mode"], table.split.fillna(""), table.pipeline)) == sorted(
        [("colocated", "", 1), ("colocated", "", 2), ("disaggregated", "1:1", 1), ("disaggregated", "2:1", 1),
         ("disaggregated", "1:1", 2), ("disaggregated", "2:1", 2)])
    skipped = table[table.status == "skipped"]
    assert set(zip(skipped["mode"], skipped.pipeline)) == {("disaggregated", 2)} and len(skipped) == 2
    assert skipped.reason.str.contains("pipeline parallelism").all() and skipped.replicas.isna().all()
    pd_ok = table[(table["mode"] == "disaggregated") & (table.status == "ok")]
    assert len(pd_ok) == 2, table[["split", "status", "reason"]]
    # k units of P prefill + D decode instances, each TP GPUs; k = ceil(target / unit capacity).
    P, D = zip(*(map(int, s.split(":")) for s in pd_ok.split))
    k = pd_ok.replicas.to_numpy()
    assert (k == [replicas_for(target, c) for c in pd_ok.replica_capacity]).all()
    assert (pd_ok.prefill_replicas == k * P).all() and (pd_ok.decode_replicas == k * D).all()
    assert (pd_ok.gpus == k * (pd.Series(P).to_numpy() + D) * pd_ok.tensor).all()
    assert pd_ok.cost_per_hour.tolist() == pytest.approx((pd_ok.gpus * pd_ok.cost_per_gpu_hour).tolist())
    assert pd_ok.capacity.tolist() == pytest.approx((k * pd_ok.replica_capacity).tolist())
    # The Pareto set is over both modes; its rows and table carry the split.
    front = pd.DataFrame(result["pareto"])
    ok = table[table.status == "ok"]
    for _, p in front.iterrows():
        assert not dominated(p, ok), p.to_dict()
    assert result["pd_splits"] == [[1, 1], [2, 1]] and "P:D" in res.stdout
    # At 5 req/s the 2:1 unit (3 GPUs) has the most capacity short of the next colocated size: on the front.
    assert (front["mode"] == "disaggregated").any(), front
    for _, p in front[front["mode"] == "disaggregated"].iterrows():
        assert p.split in ("1:1", "2:1") and p.prefill_replicas == p.replicas * int(p.split[0])


def test_a_checked_pd_split_meets_the_slos_when_sim_run_replays_it(tmp_path) -> None:
    out = tmp_path / "run"
    res = run("sim.search", out, *PD, "search.target_rate=12", "search.cluster_mode=[disaggregated]",
              "search.pd_splits=[[1,1],[2,1]]")
    assert res.returncode == 0, res.stderr[-3000:]
    chosen = json.loads((out / "search.json").read_text())["chosen"]
    assert chosen["mode"] == "disaggregated" and chosen["verified"] is True and chosen["split"] in ("1:1", "2:1")
    P, D = map(int, chosen["split"].split(":"))
    cmd = chosen["sim_run"].split()
    assert {"cluster.mode=disaggregated", f"cluster.prefill_replicas={chosen['replicas'] * P}",
            f"cluster.decode_replicas={chosen['replicas'] * D}"} <= set(cmd)
    assert f"python -m sim.run {chosen['sim_run']}" in res.stdout
    verified = json.loads((out / "verified" / "summary.json").read_text())
    again = run("sim.run", tmp_path / "again", *cmd)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert summary["mode"] == "disaggregated" and summary["gpus"] == chosen["gpus"]
    assert (summary["prefill_replicas"], summary["decode_replicas"]) == (chosen["prefill_replicas"],
                                                                         chosen["decode_replicas"])
    assert summary["slo_attainment"] >= 0.9 and summary["slo_attainment"] == verified["slo_attainment"]
    assert summary["trace_num_returned"] == 200


def test_a_pd_point_counts_its_units_gpus_and_settings() -> None:
    p = Point("h100_sxm", 2, 1, "chunked", 512, "disaggregated", cost_per_gpu_hour=3.0, split=(3, 1))
    p.replicas, p.replica_capacity = 2, 5.0
    assert p.gpus_per_replica == 8 and p.gpus == 16 and p.cost_per_hour == 48.0 and p.capacity == 10.0
    assert p.size_overrides(2) == ["cluster.prefill_replicas=6", "cluster.decode_replicas=2"]
    assert "cluster.mode=disaggregated" in p.overrides() and "P:D 3:1" in p.label()
    r = p.row()
    assert (r["split"], r["prefill_replicas"], r["decode_replicas"], r["gpus"]) == ("3:1", 6, 2, 16)


@given(st.lists(st.tuples(st.integers(1, 6), st.floats(0.5, 50)), min_size=1, max_size=25))
def test_pareto_front_is_exactly_the_non_dominated_points(specs) -> None:
    points = []
    for k, (replicas, cap) in enumerate(specs):
        p = Point(f"h{k}", 1, 1, "chunked", None, cost_per_gpu_hour=1.0)
        p.status, p.replicas, p.replica_capacity = "ok", replicas, cap / replicas
        points.append(p)

    def dom(a, b):
        return (a.cost_per_hour <= b.cost_per_hour and a.capacity >= b.capacity
                and (a.cost_per_hour, a.capacity) != (b.cost_per_hour, b.capacity))

    front = pareto_front(points)
    assert {id(p) for p in front} == {id(p) for p in points if not any(dom(q, p) for q in points)}
    assert [p.cost_per_hour for p in front] == sorted(p.cost_per_hour for p in front)


def test_replicas_reach_the_target() -> None:
    assert replicas_for(16, 4) == 4 and replicas_for(16, 3.9) == 5 and replicas_for(1, 64) == 1
    for cap in (0.7, 1.3, 3.0, 9.99):
        n = replicas_for(10, cap)
        assert n * cap >= 10 * (1 - 1e-9) and (n - 1) * cap < 10 and math.isfinite(n)


BAD = [
    (["hardware=a40"], "search.hardware"),  # the grid sets it: a command-line value would be replaced
    (["scheduler.max_num_batched_tokens=512"], "search.max_num_batched_tokens"),
    (["search.hardware=[b200]"], "unknown hardware 'b200'"),
    (["search.hardware=[cpu_2core]"], "no hardware to search"),
    (["search.scheduler=[fifo]"], "unknown scheduler 'fifo'"),
    (["search.tensor=[0]"], "search.tensor"),
    (["search.max_num_batched_tokens=[]"], "search.max_num_batched_tokens"),
    (["search.target_rate=0"], "search.target_rate"),
    (["search.cluster_mode=[shared]"], "search.cluster_mode holds 'shared'"),
    (["search.cluster_mode=[colocated,colocated]"], "give each mode once"),
    (["search.cluster_mode=[disaggregated]", "search.pd_splits=[[0,1]]"], "search.pd_splits holds [0, 1]"),
    (["search.cluster_mode=[disaggregated]", "search.pd_splits=[[2]]"], "search.pd_splits holds [2]"),
    (["search.cluster_mode=[disaggregated]", "search.pd_splits=[1,1]"], "search.pd_splits holds 1"),
    (["search.cluster_mode=[disaggregated]", "search.pd_splits=[]"], "search.pd_splits"),
    (["search.cluster_mode=[disaggregated]", "search.pd_splits=[[1,1],[1,1]]"], "twice"),
    (["search.pd_splits=[[2,1]]"], "searches no P/D split"),  # given, but no disaggregated mode to use it
    (["cluster.mode=disaggregated"], "search.cluster_mode"),  # the search sets the mode per point
    (["cluster.prefill_replicas=2"], "search.pd_splits"),
    (["cluster.decode.tensor=2"], "search.tensor"),  # the unit's price assumes the point's TP in both pools
    (["search.cost_per_gpu_hour={a40: -1}"], "cost_per_gpu_hour of a40"),
    (["slo.ttft_s=null", "slo.tpot_s=null"], "needs an SLO"),
]


@pytest.mark.parametrize("args,expect", BAD, ids=[a[0] for a, _ in BAD])
def test_bad_search_settings_are_refused_before_any_simulation(args, expect) -> None:
    from hydra import compose, initialize_config_dir

    from sim.run import CONF
    from sim.search import check_search_settings, hardware_prices
    from varlen.cli import SettingError

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="search", overrides=[a for a in args if not a.startswith(("hardware=", "scheduler."))])
    with pytest.raises(SettingError, match=expect.replace("[", r"\[")):
        check_search_settings(cfg, args)
        hardware_prices(cfg)


def test_a_bad_search_setting_ends_the_command_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    from tests.cli.test_cli_errors import run_main

    # In this process, through run_cli as `python -m sim.search` runs (no second interpreter start).
    code, _, err = run_main("sim.search", [f"hydra.run.dir={tmp_path / 'run'}", "search.hardware=[b200]"],
                            monkeypatch, capsys, through_cli=True)
    assert code == 2 and err.startswith("error: search.hardware: unknown hardware 'b200'")
    assert err.strip().count("\n") == 0 and not (tmp_path / "run" / "search.csv").exists()
