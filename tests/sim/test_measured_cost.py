"""The measured operator cost model: shipped tables, interpolation, prediction from GEMM shapes,
the roofline (labelled) for GPUs without tables, user profile folders, the simulator's fast path."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.cost.base import StepSums
from sim.cost.hardware import HardwareSpec
from sim.cost.measured import MeasuredCostModel
from sim.cost.collectives import interp_size
from sim.cost.gemm import layer_op_ms
from sim.cost.profiles import (
    LAYER_OPS, PER_LAYER, SHIPPED, ModelKey, ProfileError, interp_tokens, load_profiles, read_compute_table,
)

ROOT = Path(__file__).resolve().parents[2]
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)


def test_shipped_tables_read_and_validate() -> None:
    prof = load_profiles()
    assert prof.gpus == ["a100", "a40", "h100"]
    assert prof.nodes == ["a100_dgx", "a100_pairwise_nvlink", "a40_pairwise_nvlink", "h100_dgx", "h100_pairwise_nvlink"]
    assert (SHIPPED / "LICENSE").read_text().count("MIT License") == 1
    names = {g: sorted(t.name for t in prof.compute(g)) for g in prof.gpus}
    assert names["a100"] == ["meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-7b-hf", "meta-llama/Meta-Llama-3-70B",
                             "meta-llama/Meta-Llama-3-8B", "microsoft/phi-2"]
    assert "meta-llama/Meta-Llama-3-8B" not in names["h100"]  # the gap the model predicts across
    for g in prof.gpus:
        for t in prof.compute(g):
            assert sorted(t.by_tp) == ([1] if "phi-2" in t.name else [1, 2, 4, 8])
            for tok, times in t.by_tp.values():
                assert tok[0] == 1 and np.all(np.diff(tok) > 0) and tok[-1] >= 4096
                assert all(np.all(v > 0) for v in times.values())
    assert "all_reduce" not in prof.network("a40_pairwise_nvlink")
    ar = prof.network("h100_dgx")["all_reduce"]
    assert sorted(ar.curves) == [(2, 2), (4, 4), (8, 8)]


def test_bad_tables_fail_with_the_file_and_the_problem(tmp_path: Path) -> None:
    src = SHIPPED / "compute/a100/microsoft/phi-2/mlp.csv.gz"
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    header = lines[0].split(",")
    bad = tmp_path / "missing.csv"
    i = header.index("time_stats.mlp_up_proj.median")
    bad.write_text("\n".join(",".join(c for j, c in enumerate(r.split(",")) if j != i) for r in lines) + "\n")
    with pytest.raises(ProfileError, match=r"missing.csv: missing columns \['time_stats.mlp_up_proj.median'\]"):
        read_compute_table(bad, "x", "org/m")
    neg = tmp_path / "negative.csv"
    row = lines[1].split(",")
    row[i] = "-1"
    neg.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    with pytest.raises(ProfileError, match="mlp_up_proj has non-positive"):
        read_compute_table(neg, "x", "org/m")
    with pytest.raises(ProfileError, match="is not a folder"):
        MeasuredCostModel(LLAMA2_7B, "a100_80gb_sxm", profiles=tmp_path / "nowhere")


def test_interpolation_is_exact_at_profiled_points() -> None:
    prof = load_profiles()
    table = next(t for t in prof.compute("a100") if t.name == "meta-llama/Llama-2-7b-hf")
    tok, times = table.by_tp[1]
    m = MeasuredCostModel(LLAMA2_7B, "a100_80gb_sxm")
    assert m.linear_source == "measured: a100/meta-llama/Llama-2-7b-hf TP1"
    layer = sum(PER_LAYER[op] * times[op] for op in LAYER_OPS)
    for i in (0, 5, 100, len(tok) - 1):
        t = int(tok[i])
        assert m._layer[t] == pytest.approx(layer[i] * 1e-3, rel=1e-12)
        assert m._emb[t] == pytest.approx(times["emb"][i] * 1e-3, rel=1e-12)
    # Between points: linear; past the last: time per token of the last point.
    assert interp_tokens(np.array([1.0, 3.0]), np.array([2.0, 6.0]), [2.0, 6.0]).tolist() == [4.0, 12.0]
    size, ms = np.array([1e3, 1e5]), np.array([0.01, 0.1])
    assert interp_size(size, ms, [1e3, 1e4, 1e5, 2e5]).tolist() == pytest.approx([0.01, 0.01 * 10 ** 0.5, 0.1, 0.2])


def test_step_time_is_the_sum_of_its_parts_and_grows_with_the_work() -> None:
    m = MeasuredCostModel(LLAMA3_8B, "a100_80gb_sxm")
    s = StepSums.of([300, 1, 1], [0, 100, 4000])
    assert sum(m.parts(s).values()) == pytest.approx(m.step_time_sums(s), rel=1e-12)
    assert m.step_time([300, 1, 1], [0, 100, 4000]) == m.step_time_sums(s)
    assert m.step_time([600], [0]) > m.step_time([300], [0]) > m.step_time([1], [0])
    assert m.step_time([1] * 8, [8000] * 8) > m.step_time([1] * 8, [100] * 8)
    # Past the per-token grid: still defined and growing.
    assert m.step_time([40000], [0]) > 2 * m.step_time([16000], [0])


@pytest.mark.parametrize("batch", [1, 7, 64, 300])
def test_decode_closure_equals_step_time_sums_bit_for_bit(batch: int) -> None:
    m = MeasuredCostModel(LLAMA3_8B, "h100_sxm", tensor=2)
    f = m.decode_step_time(batch)
    for cached in (batch, 1000 * batch, 7919 * batch + 3):
        assert f(cached) == m.step_time_sums(StepSums(batch, batch, cached, cached, batch, batch))


def test_held_out_model_is_predicted_within_bounds() -> None:
    """Leave-one-out on one case (benchmarks/sim_profiles.py does all): Llama-3-8B on an A100."""
    prof = load_profiles()
    table = next(t for t in prof.compute("a100") if t.name == "meta-llama/Meta-Llama-3-8B")
    tok, times = table.by_tp[1]
    pred, source = layer_op_ms(prof, "a100", table.key, 128, 1, tok, exclude=(table.key,))
    assert source.startswith("predicted from GEMM shapes on a100")
    meas = sum(PER_LAYER[op] * times[op] for op in LAYER_OPS)
    err = np.abs(sum(PER_LAYER[op] * pred[op] for op in LAYER_OPS) / meas - 1)
    assert np.median(err) < 0.06 and err.max() < 0.2


def test_held_out_tables_do_not_leak_into_their_prediction(tmp_path: Path) -> None:
    """Held-out tables (a shape at every TP degree, or at one) may be rewritten or deleted without
    changing their prediction; a table not held out does change it (so the check can fail)."""
    from sim.cost.gemm import _operator_model
    from sim.cost.profiles import Profiles

    src = SHIPPED / "compute" / "a100"
    held = ("meta-llama/Llama-2-70b-hf", "meta-llama/Meta-Llama-3-70B")

    def folder(name: str, scale: dict[str, float], drop: tuple[str, ...] = (), tp: int | None = None) -> Profiles:
        """The shipped A100 tables, `scale`d or `drop`ped (at TP `tp` only, if given)."""
        root = tmp_path / name / "compute" / "a100"
        for f in sorted(src.glob("*/*/mlp.csv.gz")):
            model = f"{f.parent.parent.name}/{f.parent.name}"
            if model in drop and tp is None:
                continue
            lines = gzip.decompress(f.read_bytes()).decode().splitlines()
            head = lines[0].split(",")
            cols = [i for i, h in enumerate(head) if h.startswith("time_stats.") and h.endswith(".median")]
            tp_col = head.index("num_tensor_parallel_workers")
            out = [lines[0]]
            for line in lines[1:]:
                v = line.split(",")
                mine = tp is None or int(float(v[tp_col])) == tp
                if mine and model in drop:
                    continue
                for i in cols:
                    v[i] = repr(float(v[i]) * (scale.get(model, 1.0) if mine else 1.0))
                out.append(",".join(v))
            (root / model).mkdir(parents=True)
            (root / model / "mlp.csv").write_text("\n".join(out) + "\n")
        return Profiles([tmp_path / name])

    base = folder("base", {})
    key = next(t.key for t in base.compute("a100") if t.name == held[0])
    tok = np.array([1.0, 7.0, 64.0, 240.0, 1000.0, 4096.0, 9000.0])

    def predict(prof: Profiles, exclude: tuple) -> dict[str, np.ndarray]:
        _operator_model.cache_clear()
        pred, source = layer_op_ms(prof, "a100", key, 128, 4, tok, exclude=exclude)
        assert source.startswith("predicted from GEMM shapes")
        return pred

    def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
        return all(np.array_equal(a[op], b[op]) for op in a)

    # The held-out shape at every TP degree (the shape's tables rewritten or gone).
    want = predict(base, (key,))
    for prof in (folder("scaled", {m: 3.0 for m in held}), folder("dropped", {}, drop=held)):
        assert same(predict(prof, (key,)), want)
    other = folder("other", {"meta-llama/Llama-2-7b-hf": 3.0})
    assert not np.allclose(predict(other, (key,))["mlp_up_proj"], want["mlp_up_proj"])
    # The held-out table alone (the shape at TP 4): its own rows rewritten or gone change
    # nothing; the shape's TP 2 table, which the prediction rests on, does.
    want = predict(base, ((key, 4),))
    assert not same(want, predict(base, (key,)))
    for prof in (folder("scaled4", {m: 3.0 for m in held}, tp=4), folder("dropped4", {}, drop=held, tp=4)):
        assert same(predict(prof, ((key, 4),)), want)
    sibling = predict(folder("scaled2", {m: 3.0 for m in held}, tp=2), ((key, 4),))
    assert not np.allclose(sibling["mlp_up_proj"], want["mlp_up_proj"])
    assert not np.allclose(sibling["input_layernorm"], want["input_layernorm"])


def test_unprofiled_tp_degree_is_predicted_from_the_same_shapes_other_tp_tables() -> None:
    """Llama-2-70B's hidden TP 2 table on the H100 is predicted with the shape's TP 1, 4 and 8
    tables, says so, and comes closer than without them."""
    prof = load_profiles()
    table = next(t for t in prof.compute("h100") if t.name == "meta-llama/Llama-2-70b-hf")
    tok, times = table.by_tp[2]
    meas = sum(PER_LAYER[op] * times[op] for op in LAYER_OPS)
    err = {}
    for how, exclude in (("siblings", ((table.key, 2),)), ("shape", (table.key,))):
        pred, source = layer_op_ms(prof, "h100", table.key, 128, 2, tok, exclude=exclude)
        assert source.startswith("predicted from GEMM shapes on h100")
        assert ("incl. this shape at TP 1, 4, 8" in source) == (how == "siblings")
        err[how] = np.abs(sum(PER_LAYER[op] * pred[op] for op in LAYER_OPS) / meas - 1)
    assert np.median(err["siblings"]) < 0.75 * np.median(err["shape"])
    assert err["siblings"].max() < 0.75 * err["shape"].max()
    # The cost model, for a TP degree no table has: the shape's four tables, named.
    m = MeasuredCostModel(LLAMA2_7B, "a100_80gb_sxm", tensor=16)
    assert m.linear_source.startswith("predicted from GEMM shapes on a100 incl. this shape at TP 1, 2, 4, 8")
    t8 = MeasuredCostModel(LLAMA2_7B, "a100_80gb_sxm", tensor=8)
    assert 0.3 * t8._layer[1024] < m._layer[1024] < t8._layer[1024]  # half the GEMMs of TP 8, and then some


def test_gemms_that_follow_a_fixed_cost_plus_throughput_are_predicted_exactly() -> None:
    """GEMMs taking 2 M (c0 + c1 N K): a shape larger than any profiled is predicted to rounding;
    with a single profiled shape the local fit is used."""
    from sim.cost.gemm import GpuOperatorModel, gemm_dims
    from sim.cost.profiles import GEMMS, ComputeTable

    c0, c1 = 8e-9, 1 / 400e12
    tokens = np.array([1.0, 8.0, 64.0, 512.0, 4096.0])

    def table(key: ModelKey, tps: tuple[int, ...]) -> ComputeTable:
        by_tp = {tp: (tokens, {op: 2 * tokens * (c0 + c1 * n * k) * 1e3 for op, (n, k) in gemm_dims(key, 128, tp).items()})
                 for tp in tps}
        return ComputeTable("x", "org/m", Path("x"), key, 32000, by_tp)

    small = [table(ModelKey(32, 32, 4096, 11008, True, 128), (1, 2, 4)), table(ModelKey(32, 8, 4096, 14336, True, 128), (1, 2))]
    om = GpuOperatorModel("x", small)
    assert om.affine_weight == pytest.approx(1.0, abs=1e-9)
    big = ModelKey(64, 8, 8192, 28672, True, 128)
    got = om.layer_gemm_ms(tokens, big, 128, 1)
    for op in GEMMS:
        n, k = gemm_dims(big, 128, 1)[op]
        np.testing.assert_allclose(got[op], 2 * tokens * (c0 + c1 * n * k) * 1e3, rtol=1e-6)
    assert GpuOperatorModel("x", small[:1]).affine_weight == 0.0


def test_unprofiled_shapes_and_gpus_are_predicted_and_flagged() -> None:
    qwen3_8b = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936)
    m = MeasuredCostModel(qwen3_8b, "h100_sxm")
    assert m.linear_source.startswith("predicted from GEMM shapes on h100")
    assert any(n.startswith("attention: estimated") for n in m.notes)
    # Llama-3-8B's shape has no H100 table: predicted, between 7B's and a larger model's time.
    l3 = MeasuredCostModel(LLAMA3_8B, "h100_sxm")
    l2 = MeasuredCostModel(LLAMA2_7B, "h100_sxm")
    assert l3.linear_source.startswith("predicted") and l2.linear_source.startswith("measured")
    assert l3._layer[2048] > l2._layer[2048]  # a wider MLP (14336 vs 11008) costs more
    # A40: no all-reduce table, so TP's all-reduce is predicted, and says so.
    a40 = MeasuredCostModel(LLAMA2_7B, "a40", tensor=2)
    assert any("ring over send/recv" in n for n in a40.notes)


@pytest.mark.parametrize("hw", ["h200_sxm", "cpu_2core"])
def test_gpu_without_tables_uses_the_roofline_for_those_parts_and_says_so(hw: str) -> None:
    from sim.cost.roofline import RooflineCostModel
    from sim.headline import unmeasured_notes

    m, roof = MeasuredCostModel(LLAMA3_8B, hw), RooflineCostModel(LLAMA3_8B, hw)
    # Decodes, a mixed batch, a prefill past the tables' token grid: the roofline's times, finite.
    for new, cached in (([1] * 8, [100] * 8), ([512, 1, 1], [0, 300, 40]), ([20000], [0])):
        t = m.step_time(new, cached)
        assert np.isfinite(t) and t == pytest.approx(roof.step_time(new, cached), rel=1e-12)
    # Every part not measured is named, in words the run's headline picks up.
    flagged = unmeasured_notes(m)
    for part in ("linear", "lm_head", "attention", "overhead"):
        assert any(n.startswith(f"{part}: ") for n in flagged), (part, m.notes)
    assert f"linear: estimated (roofline: no operator tables for {hw}; tables exist for a100, a40, h100" in m.notes[0]
    assert "cost.profiles" in m.notes[0] and all("\n" not in n for n in m.notes)


def test_user_profiles_cover_a_new_gpu_and_override_shipped_tables(tmp_path: Path) -> None:
    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    dst = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    dst.mkdir(parents=True)
    (dst / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    m = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert m.gpu == "h200_sxm" and m.linear_source == "measured: h200_sxm/meta-llama/Meta-Llama-3-8B TP1"
    # A user's a100 table of a shipped shape wins over the shipped one.
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    header = lines[0].split(",")
    cols = [i for i, h in enumerate(header) if h.startswith("time_stats.")]
    doubled = [lines[0]] + [",".join(str(2 * float(v)) if i in cols else v for i, v in enumerate(r.split(",")))
                            for r in lines[1:]]
    mine = tmp_path / "compute/a100/me/llama3-8b-slow"
    mine.mkdir(parents=True)
    (mine / "mlp.csv").write_text("\n".join(doubled) + "\n")
    shipped = MeasuredCostModel(LLAMA3_8B, "a100_80gb_sxm")
    user = MeasuredCostModel(LLAMA3_8B, "a100_80gb_sxm", profiles=tmp_path)
    assert user.linear_source == "measured: a100/me/llama3-8b-slow TP1"
    assert user._layer[512] == pytest.approx(2 * shipped._layer[512], rel=1e-9)
    shutil.rmtree(tmp_path / "compute")


def test_model_key_matches_configs_by_shape() -> None:
    prof = load_profiles()
    keys = {t.name: t.key for t in prof.compute("a100")}
    assert keys["meta-llama/Llama-2-70b-hf"] == keys["meta-llama/Meta-Llama-3-70B"] == ModelKey(64, 8, 8192, 28672, True, 128)
    assert not keys["microsoft/phi-2"].gated
    assert HardwareSpec.load("a100_80gb_sxm").profile_gpu == "a100"


def test_sim_run_with_the_measured_model_and_its_errors(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "sim.run", f"hydra.run.dir={tmp_path}", "workload.limit=40", "output.requests=false"]
    ok = subprocess.run([*base, "cost.model=measured", "hardware=a100_80gb_sxm"], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert "40/40 finished" in ok.stdout
    # No tables for the H200: it runs, and the headline names each part the roofline stands in for.
    est = subprocess.run([*base, "cost.model=measured", "hardware=h200_sxm"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert est.returncode == 0, est.stderr
    assert "40/40 finished" in est.stdout
    line = next(ln for ln in est.stdout.splitlines() if "cost measured, not from measurements:" in ln)
    assert "linear: estimated (roofline: no operator tables for h200_sxm" in line
    assert "lm_head: estimated (roofline" in line and "attention: estimated" in line
    bad = subprocess.run([*base, "cost.model=measured", "hardware=a100_80gb_sxm", "parallel.tensor=2",
                          "hardware.node=null"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "names no node (hardware.node)" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


def test_profiler_writes_tables_the_measured_model_reads(tmp_path: Path) -> None:
    """python -m sim.profile's table for the tiny model is valid and read back exactly."""
    from sim.profile import DECODE_GRID, PREFILL_GRID, main

    assert main(["--model", "tiny", "--out", str(tmp_path), "--tokens", "1,8,64", "--repeats", "1", "--no-engine"]) == 0
    path = tmp_path / "compute/cpu_2core/local/tiny/mlp.csv"
    table = read_compute_table(path, "cpu_2core", "local/tiny")
    assert table.key == ModelKey(4, 2, 64, 128, True, 16) and sorted(table.by_tp) == [1]
    tok, times = table.by_tp[1]
    assert tok.tolist() == [1.0, 8.0, 64.0] and set(times) == {*LAYER_OPS, "emb"}
    m = MeasuredCostModel("tiny", "cpu_2core", profiles=tmp_path)
    assert m.linear_source == "measured: cpu_2core/local/tiny TP1"
    assert m._layer[8] == pytest.approx(sum(PER_LAYER[op] * times[op][1] for op in LAYER_OPS) * 1e-3, rel=1e-12)
    # The backend's attention was profiled too, and calibrates the attention.
    att = load_profiles(tmp_path).attention("cpu_2core")
    assert len(att) == 1 and len(att[0][1]["batch_size"]) == len(DECODE_GRID) + len(PREFILL_GRID)
    assert m.attention_calibration is not None and any(n.startswith(f"attention: calibrated on {len(DECODE_GRID) + len(PREFILL_GRID)} ")
                                                      for n in m.notes)
    for b in (1, 9):
        f = m.decode_step_time(b)
        assert f(100 * b) == m.step_time_sums(StepSums(b, b, 100 * b, 100 * b, b, b))
    assert main(["--model", str(tmp_path), "--out", str(tmp_path)]) == 2  # not a model folder


def test_profiler_times_collectives_on_cpu_with_gloo(tmp_path: Path) -> None:
    """python -m sim.profile --collectives 2 on CPU (gloo): tables in the shipped layout, read back."""
    import csv

    from sim.cost.collectives import Collectives
    from sim.cost.profiles import Profiles, read_collective_table
    from sim.profile import main

    assert main(["--only-collectives", "--collectives", "2", "--node", "cpu_pair", "--sizes", "1024,65536",
                 "--repeats", "2", "--out", str(tmp_path)]) == 0
    folder = tmp_path / "network" / "cpu_pair"
    shipped = gzip.decompress((SHIPPED / "network" / "h100_dgx" / "all_reduce.csv.gz").read_bytes()).decode()
    for kind in ("all_reduce", "send_recv"):
        with (folder / f"{kind}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == shipped.splitlines()[0].replace("all_reduce", kind).split(",")
        assert [(r["num_workers"], r["size"], r["devices_per_node"]) for r in rows] == [("2", "1024", "2"), ("2", "65536", "2")]
        table = read_collective_table(folder / f"{kind}.csv", "cpu_pair", kind)
        size, ms = table.curves[(2, 2)]
        assert list(size) == [1024, 65536] and np.all(ms > 0)
        assert list(ms) == [float(r[f"time_stats.{kind}.median"]) for r in rows]
    comm = Collectives("cpu_pair", Profiles([tmp_path]))
    np.testing.assert_allclose(comm.all_reduce_ms(np.array([1024.0, 65536.0]), 2),  # exp(log): to rounding
                               read_collective_table(folder / "all_reduce.csv", "cpu_pair", "all_reduce").curves[(2, 2)][1],
                               rtol=1e-12)
    assert comm.has_measured_all_reduce(2) and comm.send_recv_ms(np.array([1024.0]))[0] > 0
    assert main(["--only-collectives", "--collectives", "1", "--out", str(tmp_path)]) == 2


def test_attention_calibration_recovers_the_rates_of_a_table(tmp_path: Path) -> None:
    from sim.cost.attention import calibrate_attention
    from sim.cost.profiles import ATTENTION_COLUMNS

    const, per_seq, per_byte, per_flop = 20e-6, 3e-6, 1 / 50e9, 1 / 2e12
    rows = []
    for b, n, c in [(1, 1, 64), (1, 1, 4096), (16, 1, 512), (64, 1, 2048), (1, 512, 0), (1, 2048, 0), (4, 256, 1024)]:
        pairs = b * (n * c + n * (n + 1) / 2)
        nbytes = 2 * 1024 * 2 * b * (c + 2 * n) + 2 * 4096 * 2 * b * n
        ms = (const + per_seq * b + per_byte * nbytes + per_flop * 4 * 4096 * pairs) * 1e3
        rows.append([b, n, c, 32, 8, 128, 2, ms])
    d = tmp_path / "compute/h200_sxm/me/m"
    d.mkdir(parents=True)
    (d / "attention.csv").write_text("\n".join([",".join(ATTENTION_COLUMNS)] + [",".join(map(str, r)) for r in rows]) + "\n")
    cal = calibrate_attention(load_profiles(tmp_path), "h200_sxm")
    assert cal is not None and cal.cases == 7
    for got, want in zip((cal.const, cal.per_seq, cal.per_byte, cal.per_flop), (const, per_seq, per_byte, per_flop)):
        assert got == pytest.approx(want, rel=1e-6)
    assert calibrate_attention(load_profiles(), "a100") is None  # Vidur's tables time no attention


def test_profiled_engine_overhead_replaces_the_estimate(tmp_path: Path) -> None:
    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    plain = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    (d / "overhead.csv").write_text("const_ms,per_seq_ms,per_prefill_ms,steps,step_mape_pct\n2.5,0.01,0.3,100,5\n")
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert any(n.startswith("overhead: the engine's, profiled (meta-llama/Meta-Llama-3-8B): 2.5 ms") for n in eng.notes)
    assert any("sampling at temperature 1" in n for n in eng.notes)  # written before the column: sampled at 1
    (d / "overhead.csv").write_text("const_ms,per_seq_ms,per_prefill_ms,steps,step_mape_pct,temperature\n"
                                    "2.5,0.01,0.3,100,5,0\n")
    assert any("greedy sampling" in n for n in MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path).notes)
    (d / "overhead.csv").write_text("const_ms,per_seq_ms,per_prefill_ms,steps,step_mape_pct\n2.5,0.01,0.3,100,5\n")
    new, cached = [300, 1, 1, 1], [0, 10, 20, 30]
    base, per_seq, per_prefill = plain.overhead_form  # the hardware's estimate, replaced
    want = 2.5e-3 + 4 * 0.01e-3 + 1 * 0.3e-3 - (base + 4 * per_seq + 1 * per_prefill)
    assert eng.step_time(new, cached) - plain.step_time(new, cached) == pytest.approx(want, rel=1e-9)
    f = eng.decode_step_time(16)
    assert f(3200) == eng.step_time_sums(StepSums(16, 16, 3200, 3200, 16, 16))
    assert MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.001).overhead_s == 0.001


def test_engine_overhead_fit_recovers_a_known_cost(tmp_path: Path) -> None:
    from sim.profile import fit_engine_overhead

    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    ops = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.0)
    steps = [([64], [0]), ([1] * 8, [100] * 8), ([200, 1, 1], [0, 50, 60]), ([1] * 32, [900] * 32), ([128, 128], [0, 64])]
    rows = [(n, c, ops.step_time(n, c) + 2e-3 + 0.1e-3 * len(n) + 0.5e-3 * sum(x > 1 for x in n), None) for n, c in steps]
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path)
    assert (fit["const_ms"], fit["per_seq_ms"], fit["per_prefill_ms"]) == pytest.approx((2.0, 0.1, 0.5), rel=1e-6)
    assert fit["step_mape_pct"] < 1e-6


def test_engine_overhead_fit_scales_the_operators_when_the_engine_ran_slower_than_the_tables(tmp_path: Path) -> None:
    """Engine steps 1.2x the tables' operators plus a known overhead: the fit finds both (the unscaled fit
    put the machine's difference in the constant), and the measured model built on the written table
    predicts those steps, attention included."""
    from sim.profile import fit_engine_overhead, write_table

    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    ops = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.0, engine_overhead=False)
    steps = [([64], [0]), ([1] * 8, [100] * 8), ([200, 1, 1], [0, 50, 60]), ([1] * 32, [900] * 32),
             ([128, 128], [0, 64]), ([512], [1024]), ([1] * 4, [3000] * 4)]

    def engine(n: list[int], c: list[int]) -> float:
        return 1.2 * ops.step_time(n, c) + 2e-3 + 0.1e-3 * len(n) + 0.5e-3 * sum(x > 1 for x in n)

    rows = [(n, c, engine(n, c), None) for n, c in steps]
    fit = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path)
    assert (fit["ops_scale"], fit["const_ms"], fit["per_seq_ms"], fit["per_prefill_ms"]) == pytest.approx(
        (1.2, 2.0, 0.1, 0.5), rel=1e-6)
    unscaled = fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path, scaled=False)
    assert unscaled["ops_scale"] == 1.0 and unscaled["step_mape_pct"] > 1.0
    write_table([fit], tmp_path, "h200_sxm", "m", "overhead")
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert any("operators x1.2" in n for n in eng.notes), eng.notes
    for n, c in [*steps, ([1] * 16, [2048] * 16)]:
        assert eng.step_time(n, c) == pytest.approx(engine(n, c), rel=1e-9)


def test_engine_overhead_fit_scales_decode_only_steps_and_steps_with_a_prompt_chunk_apart(tmp_path: Path) -> None:
    """Engine steps 1.05x the tables' operators when they only decode and 1.2x with a prompt chunk: the fit
    finds both scales and the overhead, and the measured model built on it predicts each kind (one scale
    for all left decodes ~5% slow or chunks ~10% fast, whichever the fit favoured)."""
    from sim.profile import fit_engine_overhead, write_table

    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    ops = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.0, engine_overhead=False)
    steps = [([1] * b, [c] * b) for b in (1, 4, 16) for c in (100, 1000)] + [
        ([64], [0]), ([512], [0]), ([2048], [0]), ([200, 1, 1], [0, 50, 60]), ([512], [1024]), ([128, 128], [0, 64])]

    def engine(n: list[int], c: list[int]) -> float:
        return (1.2 if max(n) > 1 else 1.05) * ops.step_time(n, c) + 2e-3 + 0.1e-3 * len(n)

    fit = fit_engine_overhead([(n, c, engine(n, c), None) for n, c in steps], LLAMA3_8B, "h200_sxm", tmp_path)
    assert (fit["ops_scale"], fit["decode_ops_scale"], fit["const_ms"], fit["per_seq_ms"]) == pytest.approx(
        (1.2, 1.05, 2.0, 0.1), rel=1e-6)
    write_table([fit], tmp_path, "h200_sxm", "m", "overhead")
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert any("x1.2 in steps with a prompt chunk, x1.05 in decode-only steps" in n for n in eng.notes), eng.notes
    for n, c in [*steps, ([1] * 32, [2048] * 32), ([300, 1], [0, 700])]:
        assert eng.step_time(n, c) == pytest.approx(engine(n, c), rel=1e-9)
    assert eng.decode_step_time(32)(32 * 2048) == eng.step_time([1] * 32, [2048] * 32)


def test_engine_overhead_fit_weighs_each_step_alike(tmp_path: Path) -> None:
    """Two long prompt steps 10% off the form the fit can take (noise, or what the tables miss in them)
    do not set the short decode steps' prediction: fitted in absolute terms, their milliseconds
    outweighed a dozen decodes, which came out 3% off."""
    from sim.profile import fit_engine_overhead, write_table

    src = SHIPPED / "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz"
    d = tmp_path / "compute/h200_sxm/meta-llama/Meta-Llama-3-8B"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_bytes(gzip.decompress(src.read_bytes()))
    ops = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path, overhead_s=0.0, engine_overhead=False)
    decodes = [([1] * b, [c] * b) for b in (1, 2, 4, 8) for c in (100, 400, 1600)]
    prompts = [([64], [0]), ([256], [0]), ([1024], [0]), ([2048], [0]), ([2048], [2048]), ([512, 1], [0, 300])]

    def engine(n: list[int], c: list[int]) -> float:
        off = 1.1 if max(n) > 1 and sum(n) + sum(c) >= 4096 else 1.0
        return off * (ops.step_time(n, c) + 2e-3 + 0.1e-3 * len(n))

    rows = [(n, c, engine(n, c), None) for n, c in (*decodes, *prompts)]
    write_table([fit_engine_overhead(rows, LLAMA3_8B, "h200_sxm", tmp_path)], tmp_path, "h200_sxm", "m", "overhead")
    eng = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    errors = [eng.step_time(n, c) / engine(n, c) - 1 for n, c in decodes]
    assert max(map(abs, errors)) < 0.01, errors


def test_malformed_tables_name_the_file_line_and_column(tmp_path: Path) -> None:
    """Today's main: IndexError and BadGzipFile tracebacks, a line naming neither file nor column,
    a header-only table reported as '0 model shapes'."""
    src = SHIPPED / "compute/a100/microsoft/phi-2/mlp.csv.gz"
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()
    header = lines[0].split(",")
    i = header.index("time_stats.mlp_up_proj.median")

    def table(name: str, rows: list[str]) -> Path:
        p = tmp_path / name
        p.write_text("\n".join(rows) + "\n")
        return p

    short = table("short.csv", [lines[0], lines[1], ",".join(lines[2].split(",")[:i]), *lines[3:]])
    with pytest.raises(ProfileError, match=rf"short.csv: line 3: {i} fields where the header has {len(header)} "
                                           rf"\(column 'time_stats.mlp_up_proj.median' onward missing\)"):
        read_compute_table(short, "x", "org/m")
    row = lines[2].split(",")
    row[i] = "fast"
    word = table("word.csv", [lines[0], lines[1], ",".join(row), *lines[3:]])
    with pytest.raises(ProfileError, match=r"word.csv: line 3, column 'time_stats.mlp_up_proj.median': 'fast' is "
                                           r"not a number"):
        read_compute_table(word, "x", "org/m")
    latin = tmp_path / "latin.csv"
    row[i] = "\xb5"
    latin.write_bytes("\n".join([lines[0], lines[1], ",".join(row)]).encode("latin-1"))
    with pytest.raises(ProfileError, match=rf"latin.csv: line 3, column {i + 1}: byte 0xb5 is not UTF-8 text"):
        read_compute_table(latin, "x", "org/m")
    fake = tmp_path / "plain.csv.gz"
    fake.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=r"plain.csv.gz: not a readable gzip file .*; gzip the CSV or name it .csv"):
        read_compute_table(fake, "x", "org/m")
    empty = table("header_only.csv", [lines[0]])
    with pytest.raises(ProfileError, match="header_only.csv: a header and no rows"):
        read_compute_table(empty, "x", "org/m")


def test_cpu_operators_are_timed_in_cpu_time_like_the_engine_steps() -> None:
    # The engine's steps are logged in CPU time on CPU (profile_engine, sim_fidelity); operator
    # tables in wall time would count the time another process holds the core and disagree.
    import time

    import torch

    from sim.profile import _timer, op_clock

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clock = op_clock("cpu")
    finally:
        torch.set_num_threads(threads)
    assert clock is time.process_time and op_clock("cuda") is time.perf_counter
    idle = lambda: time.sleep(0.02)  # noqa: E731 (the core is someone else's for 20 ms)
    assert max(_timer(idle, 2, lambda: None, clock)) < 10.0
    assert min(_timer(idle, 2, lambda: None, time.perf_counter)) >= 20.0


def test_profiler_times_the_operators_as_the_engine_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """sim.profile's model runs the engine's kernels (packed oneDNN linears, fused norms, add+norm and
    SiLU·mul), and its table times the fused add+norm and SiLU·mul: stock modules' GEMMs are slower
    than the engine's, and `measured` predicted every prefill slow."""
    import sim.profile
    from varlen import LLM
    from varlen.layer_kernels import describe_layers
    from varlen.linear_kernels import describe_linears
    from varlen.tiny_model import ensure_tiny_model

    folder = ensure_tiny_model("qwen3")
    for kernel in ("onednn", "torch"):
        runner = LLM(str(folder), linear_kernel=kernel).runner
        model = sim.profile.engine_model(folder, linear_kernel=kernel)
        assert describe_linears(model) == runner.linear_kernel
        assert describe_layers(model) == runner.layer_kernels != "none"
    timed: list[str] = []
    real = sim.profile._fused_ops

    def spy(module):  # records which fused operations the profiler calls
        ops = real(module)
        if ops is None:
            return None

        class Spy:
            def __getattr__(self, name: str):
                timed.append(name)
                return getattr(ops, name)

        return Spy()

    monkeypatch.setattr(sim.profile, "_fused_ops", spy)
    rows = sim.profile.profile_model(folder, (1, 8), 1)
    assert {"silu_mul", "add_rmsnorm"} <= set(timed)
    assert all(r["time_stats.post_attention_layernorm.min"] >= 0 for r in rows)


def test_engine_profile_keeps_every_step_of_every_batch() -> None:
    """profile_engine's rows are all the steps of its timed batches: each request computes its prompt
    and all but its last output token (the engine loop's log restarts per call; slicing it by the
    previous call's length once dropped most steps); `between` runs after each timed batch."""
    from sim.profile import ENGINE_BATCHES, profile_engine
    from varlen.tiny_model import ensure_tiny_model

    calls: list[int] = []
    rows = profile_engine(ensure_tiny_model("qwen3"), "torch_sdpa", 3, between=lambda: calls.append(len(calls)))
    assert sum(sum(new) for new, *_ in rows) == sum(b * (p + o - 1) for b, p, o in ENGINE_BATCHES)
    assert sum(1 for new, *_ in rows if max(new) > 1) >= len(ENGINE_BATCHES)
    assert len(calls) == len(ENGINE_BATCHES)  # `between` once after each timed batch (none after the warm-up)


def test_operators_are_timed_over_every_layer_in_step_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step reads each layer's weights once: sim.profile times each operator on every layer in turn,
    in the step's order, not one layer's operator over and over on weights the cache then holds
    (cache-resident decode GEMMs timed 3-7x fast)."""
    import sim.profile
    from varlen.tiny_model import ensure_tiny_model

    order: list[int] = []
    real = sim.profile.engine_model

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.register_forward_hook(lambda *_, i=i: order.append(i))
        return model

    monkeypatch.setattr(sim.profile, "engine_model", spy)
    rows = sim.profile.profile_model(ensure_tiny_model("qwen3"), (1, 8), 2, passes=1)
    layers = json.loads((ensure_tiny_model("qwen3") / "config.json").read_text())["num_hidden_layers"]
    # (2 untimed + 2 rounds x SMALL_VISITS timed passes) x token counts, each pass over the layers in order
    assert layers > 1 and order == list(range(layers)) * (2 + 2 * sim.profile.SMALL_VISITS) * 2
    assert all(r[f"time_stats.{op}.median"] > 0 for r in rows for op in ("attn_pre_proj", "mlp_down_proj"))


def test_fused_add_norm_time_stays_positive_when_a_lone_add_times_slower() -> None:
    """The table's post-attention norm is the fused add+norm kernel less one add; at a few tokens the
    kernel can time below a lone add, and a zero time made the written table unreadable (ProfileError)."""
    import sim.profile

    now = [0.0]

    def takes(ms: float):
        def op() -> None:
            now[0] += ms * 1e-3
        return op

    ops = {op: takes(1.0) for op in sim.profile.OPS if op != "emb"}
    ops.update(post_attention_layernorm=takes(0.5), add=takes(0.8), fused_add=lambda: None)
    times = sim.profile._time_in_step_order([ops, ops], 2, lambda: None, lambda: now[0])
    assert all(t > 0 for t in times["post_attention_layernorm"])
    assert times["add"] == pytest.approx([0.8, 0.8])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_profile_samples_as_told_greedy_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         temperature: float) -> None:
    """The engine overhead is fitted on steps that sample as the simulated engine does: drawing from each
    request's softmax costs per request what one argmax over the batch does not, and engine runs that
    sampled at temperature 1 put it in the per-request overhead of a greedy engine's predicted steps."""
    import sim.profile
    from varlen.sampler import Sampler
    from varlen.tiny_model import ensure_tiny_model

    draws: list[int] = []
    real = Sampler._sample_one
    monkeypatch.setattr(Sampler, "_sample_one", lambda self, row, r: draws.append(1) or real(self, row, r))
    monkeypatch.setattr(sim.profile, "ENGINE_BATCHES", ((2, 8, 3),))
    kwargs = {} if temperature == 0 else {"temperature": temperature}
    rows = sim.profile.profile_engine(ensure_tiny_model("qwen3"), "torch_sdpa", 3, **kwargs)
    assert rows
    assert (len(draws) > 0) == (temperature > 0)
    fit = sim.profile.fit_engine_overhead(rows, json.loads((ensure_tiny_model("qwen3") / "config.json").read_text()),
                                          "cpu_2core", tmp_path, temperature=temperature)
    assert fit["temperature"] == temperature


def test_attention_table_is_timed_over_passes_in_their_own_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sweep of the attention cases takes seconds; a machine slow for the first one must not hand
    the whole table its speed: each case is timed in every pass (the later ones shuffled), pooled."""
    import sim.profile
    import varlen.batch

    calls: list[int] = []
    seen: list[tuple[int, int, int]] = []
    cases = len(sim.profile.DECODE_GRID) + len(sim.profile.PREFILL_GRID)

    def drifting(fn, repeats, sync, clock=None, before=None):  # the first pass runs at half speed
        calls.append(1)
        return [2.0 if len(calls) <= 2 * cases else 1.0] * repeats

    real_build = varlen.batch.build_batch

    def build(seqs, block_size, pool):
        seen.append((len(seqs), int(seqs[0].num_cached), len(seqs[0].token_ids)))
        return real_build(seqs, block_size, pool)

    monkeypatch.setattr(sim.profile, "_timer", drifting)
    monkeypatch.setattr(varlen.batch, "build_batch", build)
    rows = sim.profile.profile_attention(sim.profile.model_folder("tiny"), "torch_ref", 2, passes=3)
    assert len(calls) == 2 * 3 * cases  # forward and prepare, every case in every pass
    assert all(r["time_stats.attention.median"] == 1.0 for r in rows)  # not the slow pass's 2.0
    assert seen[cases:2 * cases] != seen[:cases] and sorted(seen[cases:2 * cases]) == sorted(seen[:cases])
    one = sim.profile.profile_attention(sim.profile.model_folder("tiny"), "torch_ref", 2, passes=1)
    assert len(one) == cases  # one pass: today's single sweep


# One layer's attention on a backend with a long-prompt path (torch_paged: SDPA from 64 new tokens): the
# kernel per causal pair, SDPA per rectangle pair after a context and per causal pair when fresh.
TWO_PATHS = dict(const=20e-6, per_seq=3e-6, per_byte=1 / 50e9, per_flop=1 / 0.2e12, per_rect_flop=1 / 2e12,
                 per_long=40e-6, per_fresh_flop=1 / 3e12, per_gathered=5e-9)
Q_DIM, KV_DIM, DTYPE = 4096, 1024, 2  # LLAMA3_8B's, at the H200's 2-byte dtype


def _two_path_layer_s(requests: list[tuple[int, int]], long_min: int = 64) -> float:
    """TWO_PATHS's attention for one layer over (new, cached) requests, each on its own path."""
    k = TWO_PATHS
    t = k["const"] + k["per_seq"] * len(requests)
    for n, c in requests:
        t += k["per_byte"] * (2 * KV_DIM * DTYPE * (c + 2 * n) + 2 * Q_DIM * DTYPE * n)
        if n < long_min:
            t += k["per_flop"] * 4 * Q_DIM * (n * c + n * (n + 1) / 2)
        elif c > 0:
            t += k["per_long"] + k["per_rect_flop"] * 4 * Q_DIM * n * (c + n) + k["per_gathered"] * (c + n)
        else:
            t += k["per_long"] + k["per_fresh_flop"] * 4 * Q_DIM * n * (n + 1) / 2
    return t


def _two_path_table(folder: Path) -> None:
    from sim.cost.profiles import ATTENTION_COLUMNS

    rows = []
    for b, n, c in [(1, 1, 64), (1, 1, 4096), (16, 1, 512), (64, 1, 2048), (1, 16, 0), (1, 48, 512), (4, 32, 256),
                    (1, 64, 0), (1, 256, 0), (4, 128, 0), (1, 256, 512), (1, 128, 512), (4, 256, 256), (1, 192, 128)]:
        ms = _two_path_layer_s([(n, c)] * b) * 1e3
        rows.append([b, n, c, 32, 8, 128, DTYPE, ms, 64])
    d = folder / "compute/h200_sxm/me/m"
    d.mkdir(parents=True)
    (d / "attention.csv").write_text("\n".join([",".join((*ATTENTION_COLUMNS, "long_query_min"))]
                                               + [",".join(map(str, r)) for r in rows]) + "\n")


def test_attention_calibration_fits_each_path_of_a_backend_with_a_long_prompt_path(tmp_path: Path) -> None:
    from sim.cost.attention import calibrate_attention

    _two_path_table(tmp_path)
    cal = calibrate_attention(load_profiles(tmp_path), "h200_sxm")
    assert cal is not None and cal.long_query_min == 64 and cal.cases == 14
    for name, want in TWO_PATHS.items():
        assert getattr(cal, name) == pytest.approx(want, rel=1e-6), name


@pytest.mark.parametrize("requests", [
    [(128, 512), (1, 100), (1, 200), (1, 300)],  # a chunk after its context, beside decodes: SDPA's rectangle
    [(200, 0), (1, 40)],                          # a fresh prompt: SDPA's causal pairs
    [(48, 512), (1, 100)],                        # a chunk's short tail: the kernel's pairs
    [(1, 100), (1, 700)],                         # decodes alone
])
def test_the_measured_model_charges_each_request_its_backends_path(tmp_path: Path, requests) -> None:
    """From the step's sums alone (sum n^2 gives the chunk's length, sum (n - 1) c its context), the step's
    attention is each request's on its own path: a chunk after a context pays its whole n x (cached + n)
    rectangle at SDPA's rate, not its causal pairs at the kernel's."""
    _two_path_table(tmp_path)
    m = MeasuredCostModel(LLAMA3_8B, "h200_sxm", profiles=tmp_path)
    assert any("prompts of >= 64 new tokens" in n for n in m.notes)
    new, cached = zip(*requests)
    got = m.parts(StepSums.of(new, cached))["attention_s"] / m.shape.layers
    assert got == pytest.approx(_two_path_layer_s(requests), rel=1e-9)
    assert m.step_time(new, cached) == m.step_time_sums(StepSums.of(new, cached))
