"""`cluster.cells=N` (sim/cells.py): independent cells behind a state-free front door, merged into
one fleet's result. A round-robin front door before round-robin routers places every request
where one round-robin fleet of all the replicas would: the merged result is that fleet's, request
for request and figure for figure, whether the cells send their requests' columns (the default)
or every token time (output.token_times=true). Cells on Ray give what the same cells give in one process,
bit for bit (one small run on a local Ray instance; skipped without the `cluster` extra)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from sim.cells import front_door
from sim.run import CONF, _simulate_paused
from tests.cli.test_cli_errors import run_main
from varlen.cli import SettingError
from varlen.metrics import GapCounts, RequestResults, request_table
from varlen.traces.trace import Trace, TraceRequest, TraceStats

SMALL = ["workload=synthetic", "workload.limit=300", "workload.rate=30", "engine.num_blocks=400",
         "cluster.router=round_robin"]
# Differ run to run by nature (how long it took), or name how it ran (the overrides given).
UNCOMPARED = {"sim_wall_s", "sim_requests_per_wall_s", "overrides"}


def config(*overrides: str):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("sim", overrides=list(overrides))


TOKEN_MODES = pytest.mark.parametrize("tokens", [[], ["output.token_times=true"]], ids=["columns", "token_times"])


@TOKEN_MODES
def test_round_robin_cells_are_the_round_robin_fleet(tokens):
    one, rows_one, lat_one = _simulate_paused(config(*SMALL, *tokens, "cluster.replicas=4"), None, False)
    cells, row, lat = _simulate_paused(config(*SMALL, *tokens, "cluster.replicas=2", "cluster.cells=2"), None, False)
    assert isinstance(cells.requests, RequestResults) == (not tokens)
    assert row["preemptions"] > 0  # a loaded fleet: the comparison covers preemption and recompute
    pd.testing.assert_frame_equal(request_table(cells.requests, lat), request_table(one.requests, lat_one),
                                  check_exact=True)
    # Cell c's replica k (numbered 2c + k) is the fleet's replica c + 2k: request i goes to i % 4 both ways.
    assert {r: g // 2 + g % 2 * 2 for r, g in cells.routed.items()} == one.routed
    assert row["cells"] == 2 and row["replicas_per_cell"] == 2 and row["replicas"] == 4 and row["gpus"] == 4
    differ = {k for k in rows_one if rows_one[k] != row[k]} - UNCOMPARED
    # Replicas' steps concatenated in another order: a time-weighted sum may round differently.
    assert differ <= {"mean_kv_usage"}
    assert row["mean_kv_usage"] == pytest.approx(rows_one["mean_kv_usage"], rel=1e-12)
    assert set(row) - set(rows_one) == {"cells", "replicas_per_cell"}


def _trace(hash_ids):
    return Trace([TraceRequest(float(i), 600, 5, h) for i, h in enumerate(hash_ids)], TraceStats("t", "test"))


def test_front_door_keeps_a_prefix_in_one_cell_and_deals_the_rest_round_robin():
    rng = np.random.default_rng(0)
    prefixes = [(0, int(x)) for x in rng.integers(1, 1 << 62, 40)]  # a shared first block, as in Mooncake
    hashed = [(*prefixes[int(j)], int(rng.integers(1 << 40))) for j in rng.integers(0, 40, 400)]
    trace = _trace(hashed + [None, (0,)] * 10)
    cell = front_door(trace, 4, key_blocks=2)
    assert cell.dtype == np.int64 and set(cell.tolist()) == {0, 1, 2, 3}
    by_prefix: dict = {}
    for h, c in zip(hashed, cell[:400].tolist()):
        assert by_prefix.setdefault(h[:2], c) == c  # one cell per prefix
    assert len(set(by_prefix.values())) == 4
    assert cell[400:].tolist() == [i % 4 for i in range(400, 420)]  # fewer ids than key_blocks: by position
    # A function of the request and its position only: another trace's requests do not move it.
    assert front_door(_trace(hashed[:100]), 4)[:100].tolist() == cell[:100].tolist()
    assert front_door(_trace([None] * 9), 3).tolist() == [0, 1, 2] * 3


def conversations(path: Path, convs: int = 15, turns: int = 4) -> Path:
    """A Mooncake-format trace of `convs` conversations, interleaved: every prompt starts with a
    block all share (a system prompt), then its conversation's block, then the turns so far."""
    lines = []
    for t in range(turns):
        for c in range(convs):
            ids = [0, 1000 + c] + [100 * c + j for j in range(1, 2 * t + 2)]
            lines.append(json.dumps({"timestamp": 200 * (t * convs + c), "input_length": 512 * len(ids) - 100,
                                     "output_length": 20, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prefix_cells_keep_a_conversation_and_its_prefix_hits(tmp_path):
    """Hashing the first 2 hash ids keeps each conversation in one cell, where its earlier turns
    are cached: the hit rate of one fleet. Round-robin (no request has 1000 ids) splits turns."""
    base = ["workload=mooncake_conv", f"workload.source={conversations(tmp_path / 'conv.jsonl')}"]
    _, one, _ = _simulate_paused(config(*base), None, False)
    _, cells, _ = _simulate_paused(config(*base, "cluster.cells=2"), None, False)
    _, dealt, _ = _simulate_paused(config(*base, "cluster.cells=2", "cluster.cell_key_blocks=1000"), None, False)
    assert one["requests"] == cells["requests"] == dealt["requests"] == 60
    assert one["prefix_hit_rate"] > 0.5
    # Each cell caches the block every prompt shares once for itself: one miss more per cell.
    assert cells["prefix_hit_rate"] == pytest.approx(one["prefix_hit_rate"], rel=0.01)
    assert dealt["prefix_hit_rate"] < 0.8 * one["prefix_hit_rate"]  # a turn finds only the one two before it
    with pytest.raises(SettingError, match="front door sends no request to cell 1"):  # all share block 0
        _simulate_paused(config(*base, "cluster.cells=2", "cluster.cell_key_blocks=1"), None, False)


def test_disaggregated_cells_merge_their_pools():
    base = ["workload=synthetic", "workload.limit=80", "workload.rate=20", "cluster.mode=disaggregated",
            "cluster.prefill_replicas=1", "cluster.decode_replicas=2"]
    res, row, _ = _simulate_paused(config(*base, "cluster.cells=2"), None, False)
    _, one, _ = _simulate_paused(config(*base, "cluster.cells=1"), None, False)
    assert row["requests"] == row["finished"] == 80 and row["replicas"] == 6 and row["gpus"] == 6
    assert row["transfers"] == len(res.transfers) == 80 and row["prefill_replicas"] == 1
    # Cell c's instances are 3c, 3c + 1, 3c + 2: its prefill instance, then its decode ones.
    assert sorted(set(res.routed.values())) == [0, 3] and sorted(set(res.decode_routed.values())) == [1, 2, 4, 5]
    assert len(res.prefill) == 2 and len(res.decode) == 4
    assert row["transfer_bytes_total"] == pytest.approx(one["transfer_bytes_total"], rel=1e-12)


def test_each_cell_shows_its_progress(tmp_path, monkeypatch, capsys):
    code, out, err = run_main("sim.run", [*SMALL, "workload.limit=40", "cluster.cells=2", "progress.interval_s=0",
                                          f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert code == 0, err
    assert "in 2 cells on local" in out
    assert "cell 1/2: 20/20 requests done" in err and "cell 2/2: 20/20 requests done" in err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["requests"] == 40 and s["cells"] == 2
    assert pd.read_csv(tmp_path / "requests.csv").replica.tolist() == [i % 2 for i in range(40)]


@pytest.mark.parametrize("args, line", [
    (["cluster.cells=0"], "cluster.cells=0 is not valid: it must be an integer >= 1"),
    (["cluster.cells=1.5"], "cluster.cells=1.5 is not valid"),
    (["cluster.cells=2", "cluster.cells_on=slurm"], "cluster.cells_on='slurm' is unknown; choose local"),
    (["cluster.cells=30"], "cluster.cells=30 is more than the workload's 20 requests"),
    (["cluster.cells=2", "output.timeline=true"], "with cluster.cells=2 set output.timeline=false"),
])
def test_bad_cell_settings_give_one_line(args, line, monkeypatch, capsys, tmp_path):
    code, out, err = run_main("sim.run", ["workload=synthetic", "workload.limit=20", *args,
                                          f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert code == 2
    assert line in err and len(err.strip().splitlines()) == 1, err


def test_ray_missing_is_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    code, _, err = run_main("sim.run", ["workload=synthetic", "workload.limit=20", "cluster.cells=2",
                                        "cluster.cells_on=ray", f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert code == 2 and "cluster.cells_on=ray needs Ray, which is not installed: install the cluster extra" in err


def test_capacity_probes_run_the_celled_fleet(monkeypatch, capsys, tmp_path):
    """Two round-robin cells of one replica are a round-robin fleet of two: the same search."""
    base = ["workload=synthetic", "workload.limit=40", "capacity.rel_tol=0.5", "capacity.low=1", "capacity.high=64",
            "cluster.router=round_robin"]
    found = []
    for name, args in (("fleet", ["cluster.replicas=2"]), ("cells", ["cluster.cells=2"])):
        code, out, err = run_main("sim.capacity", [*base, *args, f"hydra.run.dir={tmp_path / name}"], monkeypatch, capsys)
        assert code == 0, err
        found.append(pd.read_csv(tmp_path / name / "capacity_probes.csv").drop(columns=["sim_wall_s"]))
    pd.testing.assert_frame_equal(found[0], found[1], check_exact=True)
    assert len(found[0]) >= 3


@TOKEN_MODES
def test_one_cell_is_todays_run(tokens, monkeypatch, capsys, tmp_path):
    """cluster.cells=1 takes the single-fleet path, whatever cells_on says: nothing of Ray starts."""
    for name, args in (("plain", []), ("one", ["cluster.cells=1", "cluster.cells_on=ray"])):
        code, _, err = run_main("sim.run", [*SMALL, *tokens, "workload.limit=60", *args,
                                            f"hydra.run.dir={tmp_path / name}"],
                                monkeypatch, capsys)
        assert code == 0, err
    _same_run(tmp_path / "plain", tmp_path / "one")
    assert "cells" not in json.loads((tmp_path / "one" / "summary.json").read_text())


def test_cells_send_columns_not_token_times_and_the_files_are_the_same(monkeypatch, capsys, tmp_path):
    """Without token-level output a cell sends its RequestResults (gaps as a value -> count table),
    no token time; the merged run's files equal those of cells that send every token time."""
    from omegaconf import OmegaConf

    from sim.cells import run_cell
    from sim.run import _simulate_paused

    for tokens, columns in (([], True), (["output.token_times=true"], False)):
        cfg = OmegaConf.to_container(config(*SMALL, *tokens, "workload.limit=40", "cluster.cells=2"), resolve=True)
        out = run_cell(cfg, 0, None, _simulate_paused)
        assert isinstance(out.results, RequestResults) == columns
        assert (len(out.token_times) == 0) == columns and len(out.positions) == 20
        if columns:
            assert len(out.results) == 20 and len(out.results.itl) > 0 and set(out.columns) == {"replica"}
    for name, tokens in (("columns", []), ("tokens", ["output.token_times=true"])):
        code, _, err = run_main("sim.run", [*SMALL, *tokens, "cluster.cells=2", "cluster.replicas=2",
                                            f"hydra.run.dir={tmp_path / name}"], monkeypatch, capsys)
        assert code == 0, err
    _same_run(tmp_path / "columns", tmp_path / "tokens")


DISAGG = ["workload=synthetic", "workload.limit=80", "workload.rate=20", "cluster.mode=disaggregated",
          "cluster.prefill_replicas=1", "cluster.decode_replicas=2", "cluster.decode.num_blocks=120"]


def test_disaggregated_cells_send_columns_and_the_files_are_the_token_times_ones(monkeypatch, capsys, tmp_path):
    """A disaggregated cell too sends its requests' RequestResults (gaps as a value -> count table), each
    request's decode instance and the transfers, no token time; the merged run's files (requests.csv with
    both instances, kv_usage.csv, summary.json with the transfer and pool figures) equal, bit for bit,
    those of the same cells sending every token time."""
    from omegaconf import OmegaConf

    from sim.cells import run_cell

    for tokens, columns in (([], True), (["output.token_times=true"], False)):
        cfg = OmegaConf.to_container(config(*DISAGG, *tokens, "cluster.cells=2"), resolve=True)
        out = run_cell(cfg, 0, None, _simulate_paused)
        assert isinstance(out.results, RequestResults) == columns and (len(out.token_times) == 0) == columns
        sent = out.columns["decode_replica"] >= 0  # a request ended by its first token is not sent
        assert out.num_prefill == 1 and len(out.positions) == 40 and len(out.prefill_hit_tokens) == 40
        assert 30 <= len(out.transfers["bytes"]) == sent.sum() and (out.columns["decode_replica"][sent] >= 1).all()
        if columns:
            assert set(out.columns) == {"replica", "decode_replica"} and len(out.results.itl) > 0
    for name, tokens in (("columns", []), ("tokens", ["output.token_times=true"])):
        code, _, err = run_main("sim.run", [*DISAGG, *tokens, "cluster.cells=2", f"hydra.run.dir={tmp_path / name}"],
                                monkeypatch, capsys)
        assert code == 0, err
    _same_run(tmp_path / "columns", tmp_path / "tokens")
    s = json.loads((tmp_path / "columns" / "summary.json").read_text())
    table = pd.read_csv(tmp_path / "columns" / "requests.csv")
    assert s["cells"] == 2 and s["preemptions"] > 0  # the decode pools were full
    assert s["transfers"] == table.decode_replica.notna().sum() >= 60
    assert set(table.replica) == {0, 3} and set(table.decode_replica.dropna()) == {1, 2, 4, 5}


def test_gap_tables_summed_are_the_table_of_all_gaps():
    rng = np.random.default_rng(1)
    parts = [rng.choice([0.0125, 0.0125 + 1e-17, 0.3, 1 / 3, 7.0], int(k)) for k in rng.integers(0, 50, 5)]
    whole, merged = GapCounts(), GapCounts()
    for p in parts:
        whole.add(p)
        g = GapCounts()
        g.add(p)
        merged.absorb(g)
    merged.absorb(GapCounts())  # an empty cell's table adds nothing
    qs = [0, 12.5, 50, 90, 99, 100]
    assert len(merged) == len(whole) == sum(map(len, parts))
    assert merged.percentiles(qs) == whole.percentiles(qs) == [float(v) for v in np.percentile(np.concatenate(parts), qs)]


def _same_run(a: Path, b: Path) -> None:
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert list(sa) == list(sb)
    assert {k for k in sa if sa[k] != sb[k]} <= UNCOMPARED
    assert (a / "requests.csv").read_bytes() == (b / "requests.csv").read_bytes()
    assert (a / "kv_usage.csv").read_bytes() == (b / "kv_usage.csv").read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="ray is not installed: install the cluster extra: pip install -e '.[cluster]' (scripts/setup.sh does)")
@pytest.mark.parametrize("fleet", [[*SMALL, "workload.limit=120"], DISAGG], ids=["colocated", "disaggregated"])
def test_cells_on_ray_equal_cells_in_one_process(fleet, tmp_path, monkeypatch, capsys):
    """One run on a local Ray instance (2 CPUs, no dashboard), in a subprocess of its own so that the
    instance ends with it; the same cells in this process give the same files, bit for bit."""
    import os
    import subprocess
    import sys

    args = [*fleet, "cluster.cells=3", "output.steps=true"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="180",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sim.run", *args, "cluster.cells_on=ray", "cluster.ray_num_cpus=2",
                           f"hydra.run.dir={tmp_path / 'ray'}"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"sim.run with 3 cells on Ray: {time.perf_counter() - t0:.1f} s wall")
    code, _, err = run_main("sim.run", [*args, f"hydra.run.dir={tmp_path / 'local'}"], monkeypatch, capsys)
    assert code == 0, err
    _same_run(tmp_path / "ray", tmp_path / "local")
    assert (tmp_path / "ray" / "steps.csv").read_bytes() == (tmp_path / "local" / "steps.csv").read_bytes()
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["cells"] == 3


def test_a_cell_hands_its_progress_to_a_sink_and_the_fleet_line_sums_them():
    """On Ray each cell reports (simulated time, done, total) to one board; the driver prints one
    line for all cells from the board's figures."""
    from omegaconf import OmegaConf

    from sim.cells import fleet_line, run_cell
    from sim.run import _simulate_paused

    class Board:  # a Ray actor handle's shape: board.report.remote(...)
        def __init__(self):
            self.seen = []
            self.report = self

        def remote(self, *figures):
            self.seen.append(figures)

    board = Board()
    cfg = OmegaConf.to_container(config(*SMALL, "workload.limit=40", "cluster.cells=2"), resolve=True)
    out = run_cell(cfg, 1, None, _simulate_paused, board, interval_s=0)
    assert board.seen and {f[0] for f in board.seen} == {1}
    assert board.seen[-1][2:] == (20, 20) == (len(out.positions),) * 2  # the last report: all done
    line = fleet_line("simulating", 2, {0: (5.0, 10, 20), 1: (7.5, 20, 20)}, 1, 4.0)
    assert line.startswith("simulating: 1/2 cells finished, 30/40 requests done (75%), every cell simulated past 5.0 s")
    assert "0:00:01" in line.split("ETA")[1]  # 10 left at 7.5 requests/s of wall time
    assert "1 of the cells yet to report" in fleet_line("simulating", 2, {0: (5.0, 10, 20)}, 0, 4.0)


def test_pipeline_stages_are_not_counted_as_replicas():
    _, one, _ = _simulate_paused(config(*SMALL, "workload.limit=40", "cluster.replicas=2", "parallel.pipeline=2"), None, False)
    res, row, _ = _simulate_paused(config(*SMALL, "workload.limit=40", "cluster.cells=2", "parallel.pipeline=2"), None, False)
    assert (one["replicas"], one["gpus"]) == (2, 4) and (row["replicas"], row["gpus"]) == (2, 4)
    assert len(res.replicas) == 4  # each cell's engines: one per in-flight pipeline batch, as a single run has
