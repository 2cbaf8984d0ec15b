"""Tensor and pipeline parallelism: per-GPU capacity, rejections, sharded roofline + collectives,
pipeline stages as virtual engines in a simulation."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cost.base import StepSums
from sim.cost.hardware import HardwareSpec, ModelShape
from sim.cost.measured import MeasuredCostModel
from sim.cost.collectives import interp_size
from sim.cost.profiles import load_profiles
from sim.cost.roofline import RooflineCostModel
from sim.cost.registry import build_cost_model
from sim.parallel import CommunicationCostModel, Parallelism, capacity, shard_config

LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
A100, H100 = HardwareSpec.load("a100_80gb_sxm"), HardwareSpec.load("h100_sxm")


def test_one_gpu_capacity_is_the_roofline_s() -> None:
    for cfg, hw in ((LLAMA3_8B, H100), (LLAMA3_8B, A100)):
        cap = capacity(cfg, hw, Parallelism(), 0.9)
        assert cap.kv_tokens == RooflineCostModel(cfg, hw).kv_capacity_tokens(0.9)


def test_70b_on_one_a100_is_rejected_with_the_numbers() -> None:
    with pytest.raises(ValueError) as e:
        capacity(LLAMA2_70B, A100, Parallelism(), 0.9, name="llama2_70b")
    msg = str(e.value)
    # 68,976,648,192 parameters x 2 bytes.
    assert ModelShape.from_config(LLAMA2_70B).num_params == 68_976_648_192
    assert msg == ("llama2_70b does not fit on a100_80gb_sxm with parallel.tensor=1 parallel.pipeline=1: 138.0 GB of "
                   "weights per GPU vs 72.0 GB usable (0.9 x 80 GB); use at least 2 GPUs (parallel.tensor x "
                   "parallel.pipeline)")


def test_capacity_arithmetic_per_gpu() -> None:
    # TP4: each GPU holds a quarter of every layer (KV: 2 of the 8 KV heads), a quarter of the
    # embedding and of the LM head; the KV pool is what fits next to that on one GPU.
    cap = capacity(LLAMA2_70B, A100, Parallelism(4, 1), 0.9)
    h, L = 8192, 80
    layer = h * (16 * 128 + 2 * 2 * 128) + 16 * 128 * h + 3 * h * 7168 + 2 * h
    weights = (L * layer + 2 * 8000 * h + h) * 2
    assert cap.weight_bytes_per_gpu == weights
    per_token = L * 2 * 2 * 128 * 2
    assert cap.kv_bytes_per_token_per_gpu == per_token
    assert cap.kv_tokens == int((72e9 - weights) // per_token)
    # PP: 80 layers over 3 stages are 27, 27, 26; the first stage (27 layers + embedding) binds.
    cap3 = capacity(LLAMA2_70B, A100, Parallelism(1, 3), 0.9)
    full_layer = h * (64 * 128 + 2 * 8 * 128) + 64 * 128 * h + 3 * h * 28672 + 2 * h
    assert cap3.weight_bytes_per_gpu == max(27 * full_layer + 32000 * h, 26 * full_layer + 32000 * h + h) * 2
    assert cap3.kv_tokens == int((72e9 - cap3.weight_bytes_per_gpu) // (27 * 2 * 1024 * 2))
    # The pool grows with TP x PP: more GPUs, less weight each, more room for KV.
    pools = [capacity(LLAMA2_70B, H100, Parallelism(tp, pp), 0.9).kv_tokens for tp, pp in ((2, 1), (4, 1), (8, 1))]
    assert pools[0] < pools[1] < pools[2] and pools[2] > 2 * pools[1] > 4 * pools[0]
    # More TP GPUs than KV heads: each keeps a replica of one KV head.
    assert ModelShape.from_config(shard_config(LLAMA3_8B, 16 // 2)).kv_heads == 1


@pytest.mark.parametrize("par, match", [
    (Parallelism(3, 1), "parallel.tensor=3 does not divide the model's 64 attention heads"),
    (Parallelism(1, 81), "parallel.pipeline=81 exceeds the model's 80 layers"),
])
def test_impossible_splits_are_rejected(par: Parallelism, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        capacity(LLAMA2_70B, A100, par, 0.9)
    with pytest.raises(ValueError, match="must be >= 1"):
        Parallelism.of({"tensor": 0})
    with pytest.raises(ValueError, match="one must divide the"):
        Parallelism(32, 1).check(ModelShape.from_config({**LLAMA3_8B, "num_key_value_heads": 12,
                                                          "num_attention_heads": 96, "hidden_size": 12288}))


def test_roofline_tp_is_the_sharded_roofline_plus_two_all_reduces_per_layer() -> None:
    m = build_cost_model({"model": "roofline"}, LLAMA2_70B, H100, {"tensor": 4})
    assert isinstance(m, CommunicationCostModel)
    sharded = RooflineCostModel(shard_config(LLAMA2_70B, 4), H100)
    size, ms = load_profiles().network("h100_dgx")["all_reduce"].curves[(4, 4)]
    for new in (1, 64, 512, 3000):
        comm = 80 * 2 * interp_size(size, ms, new * 8192 * 2)[()] * 1e-3
        assert m.step_time([new], [100]) == pytest.approx(sharded.step_time([new], [100]) + comm, rel=1e-12)
    # Sharding pays: a 4k prefill on 4 GPUs is far faster than on one (which would not fit).
    one = RooflineCostModel(LLAMA2_70B, H100)
    assert m.step_time([4096], [0]) < 0.4 * one.step_time([4096], [0])


def test_pipeline_adds_send_recv_between_stages() -> None:
    pp2 = build_cost_model({"model": "roofline"}, LLAMA2_70B, H100, {"pipeline": 2})
    single = RooflineCostModel(LLAMA2_70B, H100)
    size, ms = load_profiles().network("h100_dgx")["send_recv"].curves[(2, 2)]
    t = 1000
    assert pp2.step_time([t], [0]) == pytest.approx(single.step_time([t], [0]) + interp_size(size, ms, t * 8192 * 2)[()] * 1e-3)


@pytest.mark.parametrize("model", ["roofline", "measured"])
def test_parallel_decode_closures_are_bit_identical(model: str) -> None:
    m = build_cost_model({"model": model}, LLAMA2_70B, A100, {"tensor": 2, "pipeline": 2})
    for batch in (1, 33, 256):
        f = m.decode_step_time(batch)
        for cached in (batch * 10, batch * 3000 + 1):
            assert f(cached) == m.step_time_sums(StepSums(batch, batch, cached, cached, batch, batch))


def test_measured_tp_reads_the_tp_table_and_the_node() -> None:
    m = MeasuredCostModel(LLAMA2_70B, "a100_80gb_sxm", tensor=8)
    assert m.linear_source == "measured: a100/meta-llama/Llama-2-70b-hf TP8"
    size, ms = load_profiles().network("a100_dgx")["all_reduce"].curves[(8, 8)]
    assert m._ar[1000] == pytest.approx(2 * interp_size(size, ms, 1000 * 8192 * 2)[()] * 1e-3)
    # The node is the hardware's, overridable: pairwise NVLink has no 8-GPU table -> predicted.
    pair = MeasuredCostModel(LLAMA2_70B, {**_spec(A100), "node": "a100_pairwise_nvlink"}, tensor=8)
    assert any("predicted from its 4-GPU table" in n for n in pair.notes)


def _spec(hw: HardwareSpec) -> dict:
    return {f: getattr(hw, f) for f in hw.__dataclass_fields__}


def test_fitted_and_replayed_models_refuse_parallelism() -> None:
    with pytest.raises(ValueError, match="cost.model=profiled replays or fits one measured engine"):
        build_cost_model({"model": "profiled", "path": "x.json"}, LLAMA3_8B, H100, {"tensor": 2})
    with pytest.raises(ValueError, match="names no node"):
        build_cost_model({"model": "roofline"}, LLAMA3_8B, HardwareSpec.load("h200_sxm"), {"tensor": 2})


def test_simulation_with_tp_and_pp_runs_virtual_engines() -> None:
    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["sim_model=llama2_70b", "hardware=h100_sxm", "parallel.tensor=2",
                                        "parallel.pipeline=2", "workload.limit=60", "cluster.replicas=1"])
    res, row = simulate_config(cfg)
    assert row["finished"] == 60 and row["tensor"] == 2 and row["pipeline"] == 2
    assert len(res.replicas) == 2  # one engine per pipeline stage's in-flight batch
    cap = capacity(LLAMA2_70B, H100, Parallelism(2, 2), 0.9)
    assert row["num_blocks"] == cap.kv_tokens // 16 // 2
    assert all(r.engine.kv.capacity_tokens == row["num_blocks"] * 16 for r in res.replicas)
    assert np.isfinite(row["ttft_p50"])
