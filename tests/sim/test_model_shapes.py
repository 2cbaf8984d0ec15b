"""Hugging Face decoder configs beyond the gated-MLP family: their shapes, FLOPs and shipped yamls."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.cost.hardware import HardwareSpec, ModelShape
from sim.cost.roofline import RooflineCostModel
from sim.parallel import shard_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def sim_model(name: str) -> dict:
    return yaml.safe_load((CONF / "sim_model" / f"{name}.yaml").read_text())["config"]


# Published config.json fields (the ones that set the cost), as the Hub ships them.
GPT2 = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_inner=None, n_positions=1024,
            vocab_size=50257)
NEOX = dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
            num_attention_heads=16, vocab_size=50304, use_parallel_residual=True, max_position_embeddings=2048)
FALCON_7B = dict(model_type="falcon", hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                 multi_query=True, parallel_attn=True, new_decoder_architecture=False, vocab_size=65024)
FALCON_40B = dict(model_type="falcon", hidden_size=8192, num_hidden_layers=60, num_attention_heads=128,
                  num_kv_heads=8, new_decoder_architecture=True, parallel_attn=True, vocab_size=65024)
PHI2 = dict(model_type="phi", hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=None, vocab_size=51200, partial_rotary_factor=0.4,
            max_position_embeddings=2048)


@pytest.mark.parametrize("cfg", [sim_model("opt_13b"), GPT2, NEOX, FALCON_7B, FALCON_40B, PHI2],
                         ids=["opt", "gpt2", "gpt_neox", "falcon_7b", "falcon_40b", "phi2"])
def test_non_gated_configs_cost_without_error(cfg: dict) -> None:
    m = RooflineCostModel(cfg, "a100_80gb_sxm", overhead_s=0.0)  # the model's work alone
    assert not m.shape.gated and m.shape.mlp_matrices == 2
    prefill, decode = m.step_time([512], [0]), m.step_time([1] * 8, [256] * 8)
    assert prefill > decode > 0


def test_mlp_width_fields_and_defaults() -> None:
    assert ModelShape.from_config(sim_model("opt_13b")).intermediate == 4 * 5120  # ffn_dim
    assert ModelShape.from_config(GPT2).intermediate == 4 * 768  # n_inner unset: GPT-2's 4 x hidden
    assert ModelShape.from_config({**GPT2, "n_inner": 1000}).intermediate == 1000
    assert ModelShape.from_config(FALCON_7B).intermediate == 4 * 4544
    assert ModelShape.from_config({**FALCON_40B, "ffn_hidden_size": 9000}).intermediate == 9000
    assert ModelShape.from_config(NEOX).intermediate == 8192
    assert ModelShape.from_config(FALCON_7B).kv_heads == 1  # multi-query
    assert ModelShape.from_config(FALCON_40B).kv_heads == 8
    g = ModelShape.from_config(GPT2)
    assert (g.hidden, g.layers, g.heads, g.position_embeddings) == (768, 12, 12, 1024)


def test_two_mlp_matrices_cost_two_thirds_of_three() -> None:
    """OPT's MLP is fc1 + fc2: 2 matrices x hidden x ffn multiply-adds a token; the same widths gated take 3."""
    opt = sim_model("opt_13b")
    h, ffn = opt["hidden_size"], opt["ffn_dim"]
    plain = RooflineCostModel(opt, "a100_80gb_sxm")
    gated = RooflineCostModel({**opt, "model_type": "llama"}, "a100_80gb_sxm")
    attention_flops = 2.0 * 4 * h * h  # q, k, v, o projections (multi-head)
    assert plain.linear_work(1.0)[0] == attention_flops + 2.0 * 2 * h * ffn
    assert gated.linear_work(1.0)[0] == attention_flops + 2.0 * 3 * h * ffn
    assert gated.step_time([4096], [0]) > plain.step_time([4096], [0])


def test_learned_positions_add_weights_and_embedding_reads() -> None:
    opt = sim_model("opt_13b")
    learned = ModelShape.from_config(opt)
    rope = ModelShape.from_config({**opt, "model_type": "gpt_neox", "intermediate_size": opt["ffn_dim"]})
    assert learned.num_params - rope.num_params == 2048 * 5120
    assert 12.7e9 < learned.num_params < 13.0e9  # OPT-13B (biases and layer norms aside)
    t, d = 100.0, 2
    plain = RooflineCostModel({**opt, "model_type": "gpt_neox", "intermediate_size": opt["ffn_dim"]}, "a100_80gb_sxm")
    assert RooflineCostModel(opt, "a100_80gb_sxm").head_work(t, 1)[1] - plain.head_work(t, 1)[1] == t * 5120 * d


def test_tensor_parallel_shard_divides_the_mlp_width_of_any_field() -> None:
    for cfg in (sim_model("opt_13b"), GPT2, FALCON_7B):
        full = ModelShape.from_config(cfg)
        assert ModelShape.from_config(shard_config(cfg, 4)).intermediate == full.intermediate // 4


@pytest.mark.parametrize("cfg, field", [
    (dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=10),
     "intermediate_size"),
    (dict(model_type="opt", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=10),
     "intermediate_size"),
    (dict(model_type="opt", ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=10), "hidden_size"),
])
def test_a_config_without_a_needed_field_is_refused_naming_it(cfg: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"model config lacks '{field}'.*add it to sim_model.config"):
        ModelShape.from_config(cfg)


def test_experts_with_plain_mlps_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="experts with plain .* not modelled; give the config a gated model_type"):
        ModelShape.from_config({**NEOX, "num_local_experts": 8, "num_experts_per_tok": 2})


def test_other_families_aliases_and_multi_query() -> None:
    bloom = dict(model_type="bloom", n_embed=1024, n_layer=24, n_head=16, vocab_size=250880)
    b = ModelShape.from_config(bloom)  # BLOOM's config.json names its width n_embed; its MLP is 4 x hidden
    assert (b.hidden, b.intermediate, b.gated, b.position_embeddings) == (1024, 4096, False, 0)
    santacoder = dict(model_type="gpt_bigcode", n_embd=2048, n_layer=24, n_head=16, n_positions=2048,
                      vocab_size=49280)  # StarCoder / SantaCoder: multi-query unless multi_query=false
    assert ModelShape.from_config(santacoder).kv_heads == 1
    assert ModelShape.from_config({**santacoder, "multi_query": False}).kv_heads == 16


def test_shipped_paper_models_have_their_published_sizes() -> None:
    sizes = {"opt_13b": 12.9e9, "opt_66b": 65.7e9, "opt_175b": 174.6e9, "mistral_7b": 7.24e9, "yi_34b": 34.4e9}
    for name, params in sizes.items():
        assert ModelShape.from_config(sim_model(name)).num_params == pytest.approx(params, rel=0.01), name
    a100_40 = HardwareSpec.load("a100_40gb_sxm")
    assert (a100_40.memory_gb, a100_40.mem_bandwidth_gbs) == (40, 1555)


def test_measured_costs_opt_by_its_gemm_shapes_and_says_so() -> None:
    from sim.cost.measured import MeasuredCostModel

    m = MeasuredCostModel(sim_model("opt_13b"), "a100_40gb_sxm")
    assert m.step_time([512], [0]) > m.step_time([1], [512]) > 0
    assert any(n.startswith("linear: predicted from GEMM shapes") for n in m.notes)


@pytest.mark.parametrize("model", ["opt_13b", "mistral_7b"])
def test_new_yamls_run_through_sim_run(model: str) -> None:
    from hydra import compose, initialize_config_dir

    from sim.run import CONF as RUN_CONF, simulate_config

    with initialize_config_dir(RUN_CONF, version_base="1.3"):
        cfg = compose("sim", overrides=[f"sim_model={model}", "hardware=a100_40gb_sxm", "workload.limit=20",
                                        "output.requests=false"])
    _, row = simulate_config(cfg)
    assert row["finished"] == 20


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_state_space_models_are_refused_by_name(model_type: str) -> None:
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' has state-space or recurrent layers"):
        ModelShape.from_config({**NEOX, "model_type": model_type})
