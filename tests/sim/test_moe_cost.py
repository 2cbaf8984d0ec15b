"""Mixture-of-experts configs as a sim_model: their shapes, FLOPs and bytes against a hand count from
the config, the limits (top-k = all experts is a dense MLP of the summed width), the measured
model's labelled path, and a run through sim.run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from sim.cost.hardware import ModelShape, expected_experts_touched
from sim.cost.roofline import RooflineCostModel
from sim.parallel import shard_config

CONF = Path(__file__).resolve().parents[2] / "conf"
MIXTRAL = yaml.safe_load((CONF / "sim_model" / "mixtral_8x7b.yaml").read_text())["config"]
# Published config.json fields of Qwen1.5-MoE-A2.7B and DeepSeek-V2-Lite (the ones that set the cost).
QWEN2_MOE = dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                 moe_intermediate_size=1408, shared_expert_intermediate_size=5632, decoder_sparse_step=1,
                 mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False)
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
                        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
                        kv_lora_rank=512, vocab_size=102400)


def test_expected_experts_touched_limits() -> None:
    t = np.arange(0, 200, dtype=np.float64)
    touched = expected_experts_touched(t, 8, 2)
    assert touched[0] == 0 and touched[1] == pytest.approx(2) and touched[-1] == pytest.approx(8)
    assert np.all(np.diff(touched) >= 0) and np.all(np.diff(touched)[:60] > 0)
    assert np.all(touched <= np.minimum(8, 2 * t) + 1e-12)
    assert expected_experts_touched(5.0, 8, 8) == 8  # every token runs every expert
    # Two tokens pick 2 of 8 each: the second's picks are new with probability 6/8 each: 2 + 1.5.
    assert expected_experts_touched(2.0, 8, 2) == pytest.approx(3.5)
    rng = np.random.default_rng(0)
    sims = [len({e for _ in range(5) for e in rng.choice(8, 2, replace=False)}) for _ in range(4000)]
    assert np.mean(sims) == pytest.approx(expected_experts_touched(5.0, 8, 2), rel=0.02)


def test_mixtral_shape_counts_all_experts_in_memory_and_two_per_token() -> None:
    s = ModelShape.from_config(MIXTRAL)
    h, inter, layers = 4096, 14336, 32
    attention = h * (4096 + 2 * 1024) + 4096 * h
    expert = 3 * h * inter
    assert (s.experts, s.experts_per_token, s.expert_intermediate, s.moe_layers, s.dense_layers) == (8, 2, inter, 32, 0)
    assert s.moe_layer_params == attention + h * 8 + 8 * expert + 2 * h  # router hidden x experts, two norms
    assert s.num_params == layers * s.moe_layer_params + 2 * 32000 * h + h
    assert s.num_params == pytest.approx(46.7e9, rel=0.005)  # Mixtral-8x7B's published size
    active = layers * (attention + h * 8 + 2 * expert + 2 * h) + 2 * 32000 * h
    assert active == pytest.approx(12.9e9, rel=0.01)  # and its published active parameters


def test_roofline_moe_flops_and_bytes_match_a_hand_count() -> None:
    m = RooflineCostModel(MIXTRAL, "a100_80gb_sxm")
    h, inter, d = 4096, 14336, 2
    attention = h * (4096 + 2 * 1024) + 4096 * h
    expert = 3 * h * inter
    for t in (1.0, 7.0, 64.0, 2048.0):
        flops, nbytes = m.moe_linear_work(t)
        assert flops == pytest.approx(2 * t * (attention + h * 8 + 2 * expert))
        touched = 8 * (1 - (1 - 2 / 8) ** t)
        act = d * t * (4 * h + 2 * 4096 + 2 * 1024 + 8 + 3 * 2 * inter)
        assert nbytes == pytest.approx(d * (attention + h * 8 + 2 * h + touched * expert) + act)
    # One decode token reads its 2 experts' weights; a batch of 64 reads (nearly) all 8.
    assert m.moe_linear_work(1.0)[1] < 0.3 * m.moe_linear_work(64.0)[1]
    est = m.estimate([300, 1, 1], [0, 40, 90])
    t = 302.0
    head = 2 * 3 * h * 32000  # three logit rows
    pairs = 300 * 301 / 2 + 40 + 1 + 90 + 1
    assert est.flops == pytest.approx(32 * (m.moe_linear_work(t)[0] + 4 * 4096 * pairs) + head)


def test_all_experts_per_token_is_a_dense_mlp_of_the_summed_width_in_flops() -> None:
    every = RooflineCostModel({**MIXTRAL, "num_experts_per_tok": 8}, "a100_80gb_sxm")
    dense_cfg = {k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    dense = RooflineCostModel({**dense_cfg, "intermediate_size": 8 * 14336}, "a100_80gb_sxm")
    assert not dense.shape.is_moe
    for t in (1.0, 33.0, 4096.0):
        router = 2 * t * 4096 * 8
        assert every.moe_linear_work(t)[0] == pytest.approx(dense.linear_work(t)[0] + router)
        # Bytes too, but for the router's weights and logits: every expert is read.
        assert every.moe_linear_work(t)[1] == pytest.approx(dense.linear_work(t)[1] + 2 * (4096 * 8 + t * 8))
    assert every.shape.num_params - dense.shape.num_params == 32 * 4096 * 8


def test_moe_step_time_is_monotone_in_experts_per_token_and_the_batch() -> None:
    times = [RooflineCostModel({**MIXTRAL, "num_experts_per_tok": k}, "h200_sxm").step_time([1] * 4, [500] * 4)
             for k in range(1, 9)]
    assert all(a < b for a, b in zip(times, times[1:]))
    m = RooflineCostModel(MIXTRAL, "h200_sxm")
    decodes = [m.step_time([1] * b, [500] * b) for b in (1, 2, 4, 8, 16, 64)]
    assert all(a < b for a, b in zip(decodes, decodes[1:]))
    # More, thinner experts at the same active width: a batch touches more weights (fine-grained MoE).
    coarse = RooflineCostModel({**MIXTRAL, "num_local_experts": 8, "num_experts_per_tok": 2}, "h200_sxm")
    fine = RooflineCostModel({**MIXTRAL, "num_local_experts": 32, "num_experts_per_tok": 8,
                              "intermediate_size": 14336 // 4}, "h200_sxm")
    assert fine.moe_linear_work(1.0)[0] == pytest.approx(coarse.moe_linear_work(1.0)[0] + 2 * 4096 * 24)
    assert fine.moe_linear_work(4.0)[1] > coarse.moe_linear_work(4.0)[1]


def test_shared_experts_and_first_dense_layers_are_counted() -> None:
    q = ModelShape.from_config(QWEN2_MOE)
    assert (q.moe_layers, q.shared_intermediate, q.router_outputs) == (24, 5632, 61)  # + the shared expert's gate
    assert q.num_params == pytest.approx(14.3e9, rel=0.01)  # Qwen1.5-MoE-A2.7B's published total
    with pytest.raises(ValueError, match="'kv_lora_rank'=512 .* not modelled; set sim_model.config.kv_lora_rank=null"):
        ModelShape.from_config(DEEPSEEK_V2_LITE)
    ds = ModelShape.from_config({**DEEPSEEK_V2_LITE, "kv_lora_rank": None})
    assert (ds.dense_layers, ds.moe_layers, ds.shared_intermediate, ds.experts) == (1, 26, 2 * 1408, 64)
    assert ds.all_layer_params == ds.dense_layer_params + 26 * ds.moe_layer_params
    sparse = ModelShape.from_config({**QWEN2_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert sparse.moe_layers == 12 - 1 and sparse.dense_layers == 13
    m = RooflineCostModel({**DEEPSEEK_V2_LITE, "kv_lora_rank": None}, "h100_sxm")
    lin_f = m.linear_work(10.0)[0]
    moe_f = m.moe_linear_work(10.0)[0]
    want = m.linear_time(10.0) * 27
    assert want == pytest.approx(max(lin_f / m._flops, m.linear_work(10.0)[1] / m._bw)
                                 + 26 * max(moe_f / m._flops, m.moe_linear_work(10.0)[1] / m._bw))


@pytest.mark.parametrize("cfg, message", [
    ({**MIXTRAL, "num_experts_per_tok": None}, "lacks 'num_experts_per_tok'"),
    ({**MIXTRAL, "num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and the 8 experts"),
    ({k: v for k, v in QWEN2_MOE.items() if k not in ("moe_intermediate_size", "intermediate_size")},
     "lacks 'intermediate_size'"),
])
def test_incomplete_moe_configs_are_refused_naming_the_field(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelShape.from_config(cfg)


def test_tensor_parallel_splits_every_expert() -> None:
    for cfg in (MIXTRAL, QWEN2_MOE):
        full, shard = ModelShape.from_config(cfg), ModelShape.from_config(shard_config(cfg, 4))
        assert shard.expert_intermediate == full.expert_intermediate // 4 and shard.experts == full.experts
        assert shard.shared_intermediate == full.shared_intermediate // 4


def test_measured_times_experts_by_their_gemm_shape_and_says_so() -> None:
    """Mixtral's expert is Llama-3-8B's MLP shape: the A100 table times it at each expert's rows; the router
    (an N=8 GEMM no table holds) is the roofline; the notes, and so sim.explain, say which."""
    from sim.cost.measured import MeasuredCostModel
    from sim.cost.gemm import MLP_OPS, layer_op_ms
    from sim.cost.profiles import LAYER_OPS, PER_LAYER, load_profiles

    m = MeasuredCostModel(MIXTRAL, "a100_80gb_sxm", tensor=2)
    note = m.notes[0]
    assert note.startswith("linear: mixture of experts: 2 of 8 experts per token")
    assert "measured: a100/meta-llama/Meta-Llama-3-8B TP2" in note and "router: roofline" in note
    llama = MeasuredCostModel({**{k: v for k, v in MIXTRAL.items() if k not in ("num_local_experts", "num_experts_per_tok")},
                               "vocab_size": 128256}, "a100_80gb_sxm", tensor=2)
    ops, _ = layer_op_ms(load_profiles(), "a100", llama.key, 128, 2, np.array([1.0]))
    mlp = sum(float(ops[op][0]) for op in MLP_OPS) * 1e-3
    router = float(m._router_ms(np.array([1.0]))[0]) * 1e-3
    # One decode token: the dense layer's operators with its MLP run twice (two experts, one row each) + router.
    assert m._layer[1] == pytest.approx(llama._layer[1] + mlp + router, rel=1e-9)
    assert m.step_time([1] * 64, [300] * 64) > m.step_time([1] * 8, [300] * 8) > m.step_time([1], [300])
    h100 = MeasuredCostModel(MIXTRAL, "h100_sxm", tensor=2)
    assert "predicted from GEMM shapes on h100" in h100.notes[0]
    assert set(PER_LAYER) == set(LAYER_OPS)


def test_mixtral_runs_through_sim_run_and_explain() -> None:
    from hydra import compose, initialize_config_dir

    from sim.explain import explain_config
    from sim.run import CONF as RUN_CONF, simulate_config

    with initialize_config_dir(RUN_CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["sim_model=mixtral_8x7b", "hardware=h200_sxm", "workload.limit=20",
                                        "output.requests=false"])
    _, row = simulate_config(cfg)
    assert row["finished"] == 20
    from omegaconf import OmegaConf

    with initialize_config_dir(RUN_CONF, version_base="1.3"):
        ex = compose("explain", overrides=["sim_model=mixtral_8x7b", "hardware=a100_80gb_sxm", "parallel.tensor=2",
                                           "cost.model=measured", "step.new=[512,1]", "step.cached=[0,100]"])
    d = explain_config(OmegaConf.to_container(ex, resolve=True))
    assert any("mixture of experts" in n for n in d["notes"]) and d["linear_s"] > 0
    # A dense shape Vidur's tables lack (OPT): sim.explain labels its layers as predicted from GEMM shapes.
    with initialize_config_dir(RUN_CONF, version_base="1.3"):
        ex = compose("explain", overrides=["sim_model=opt_13b", "hardware=a100_40gb_sxm", "cost.model=measured"])
    notes = explain_config(OmegaConf.to_container(ex, resolve=True))["notes"]
    assert any(n.startswith("linear: predicted from GEMM shapes on a100") for n in notes), notes
    assert "lm_head: predicted from its GEMM shape" in notes
