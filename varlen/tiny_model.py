"""Tiny Hugging Face model folders written locally, so nothing is ever downloaded. A large
`initializer_range` gives greedy decoding clear top-1 margins, so equality tests do not flip on noise."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Byte-level BPE: any text round-trips; the corpus only shapes the merges.
_CORPUS = [
    "varlen batches every request's new tokens end to end in one flat array.",
    "Prefill, a chunk of a prefill and a decode are all n new tokens after k cached ones.",
    "The scheduler decides, the allocator hands out blocks, the backend does attention.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Hello world! Once upon a time there was a tiny model that needed no download.",
    "def forward(self, x): return self.proj(x) + x  # residual",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" @ # $ % ^ & _ ~",
]

# A minimal chat template, so that chat endpoints work on the default model: each message on its own
# line after its role, ended by the eos token; with add_generation_prompt the assistant's turn opens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"  # where transformers reads a folder's chat template

# Attention features get values that bite on short prompts, so coverage tests exercise them.
WINDOW = 8
ARCHITECTURES: dict[str, dict] = {
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", head_dim=16,
        rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", head_dim=16, sliding_window=WINDOW),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2),
    # Qwen2 with its per-layer window switch: layer 0 full attention, layer 1 windowed.
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
                  sliding_window=WINDOW, max_window_layers=1),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=16),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=30.0),
    # Every layer windowed: the case where the allocator may free blocks behind the window.
    "gemma3_text": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
                        sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention"],
                        query_pre_attn_scalar=24),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=WINDOW),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2"),
    "granite": dict(architectures=["GraniteForCausalLM"], model_type="granite", attention_multiplier=0.2,
                    logits_scaling=2.0, residual_multiplier=0.5, embedding_multiplier=2.0),
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2),
    "cohere": dict(architectures=["CohereForCausalLM"], model_type="cohere", logit_scale=0.5),
    "cohere2": dict(architectures=["Cohere2ForCausalLM"], model_type="cohere2", sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
    "starcoder2": dict(architectures=["Starcoder2ForCausalLM"], model_type="starcoder2", sliding_window=WINDOW),
    "ministral": dict(architectures=["MinistralForCausalLM"], model_type="ministral", head_dim=16,
                      sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], model_type="olmo3", sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"]),
    "exaone4": dict(architectures=["Exaone4ForCausalLM"], model_type="exaone4", head_dim=16, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    "phi": dict(architectures=["PhiForCausalLM"], model_type="phi", partial_rotary_factor=0.5),
    "olmo": dict(architectures=["OlmoForCausalLM"], model_type="olmo"),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", num_local_experts=4,
                       num_experts_per_tok=2, attention_multiplier=0.2),
    "glm4": dict(architectures=["Glm4ForCausalLM"], model_type="glm4", head_dim=16),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", head_dim=16),
    "seed_oss": dict(architectures=["SeedOssForCausalLM"], model_type="seed_oss", head_dim=16),
    # Multi-head (their modules ignore a KV head count): the cache takes the probed shape.
    "gpt2": dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", num_key_value_heads=4),
    "gpt_neox": dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", num_key_value_heads=4),
    "opt": dict(architectures=["OPTForCausalLM"], model_type="opt", num_key_value_heads=4, ffn_dim=128,
                word_embed_proj_dim=64),
}

# Architectures varlen refuses, each with a tiny config that shows it (tests assert the refusal).
REFUSED_ARCHITECTURES: dict[str, dict] = {
    "deepseek_v3": dict(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "mamba": dict(model_type="mamba", state_size=4, expand=2, conv_kernel=2),
    "jamba": dict(model_type="jamba", attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  num_experts=2, mamba_d_state=4, mamba_dt_rank=8, use_mamba_kernels=False),
    "falcon_h1": dict(model_type="falcon_h1", mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                      mamba_chunk_size=8),
    "qwen3_next": dict(model_type="qwen3_next", head_dim=16, layer_types=["linear_attention", "full_attention"],
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "llama4_text": dict(model_type="llama4_text", head_dim=16, attention_chunk_size=8, num_local_experts=2,
                        intermediate_size_mlp=128, layer_types=["chunked_attention", "full_attention"]),
    "bloom": dict(model_type="bloom", num_key_value_heads=4),  # ALiBi, built into its own attention
    "mpt": dict(model_type="mpt", num_key_value_heads=4),  # ALiBi bias passed where no mask is built
    "stablelm": dict(model_type="stablelm"),  # its attention gets no forward keywords
}

TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
)


def default_model_dir(arch: str = "qwen3") -> Path:
    """Where the embedded default model lives (created on first use)."""
    root = os.environ.get("VARLEN_HOME", os.path.join(os.path.expanduser("~"), ".cache", "varlen"))
    return Path(root) / f"tiny-{arch}"


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    if not (path / TEMPLATE_FILE).exists():  # older transformers keep it in tokenizer_config.json instead
        (path / TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    return tok.get_vocab_size()


def tiny_config(arch: str, vocab_size: int = 512, initializer_range: float = 0.1, **overrides):
    """The transformers config of a tiny `arch` (a key of ARCHITECTURES or REFUSED_ARCHITECTURES)."""
    from transformers import AutoConfig

    known = {**ARCHITECTURES, **REFUSED_ARCHITECTURES}
    if arch not in known:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    spec = dict(known[arch])
    model_type = spec.pop("model_type")
    cfg = dict(TINY_SHAPE, **spec)
    cfg.update(
        vocab_size=vocab_size, initializer_range=initializer_range,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="float32",
    )
    cfg.update(overrides)
    return AutoConfig.for_model(model_type, **cfg)


def tiny_model(arch: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    """A tiny random-weight `arch` model in memory (no folder, no tokenizer), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.eval()


def write_tiny_model(
    path: str | os.PathLike, arch: str = "qwen3", seed: int = 0, vocab_size: int = 512,
    initializer_range: float = 0.1, **overrides,
) -> Path:
    """Write a random-weight HF model folder for `arch` and return its path; `overrides` replace
    config entries (e.g. hidden_size=512)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    actual_vocab = _write_tokenizer(path, vocab_size)
    # The embedding may outgrow the tokenizer's vocabulary, so benchmark shapes can ask for 32000.
    model = tiny_model(arch, seed, vocab_size=max(vocab_size, actual_vocab),
                       initializer_range=initializer_range, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return path


def ensure_tiny_model(arch: str = "qwen3") -> Path:
    """The embedded default model folder, written on first use to a temporary sibling and renamed
    (never half-written)."""
    path = default_model_dir(arch)
    if (path / "model.safetensors").exists():
        if not (path / TEMPLATE_FILE).exists():  # written before the template shipped: add it, atomically
            tmp = path / f"{TEMPLATE_FILE}.tmp{os.getpid()}"
            tmp.write_text(CHAT_TEMPLATE)
            os.replace(tmp, path / TEMPLATE_FILE)
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    write_tiny_model(tmp, arch)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; its folder is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a tiny random-weight HF model folder.")
    p.add_argument("path")
    p.add_argument("--arch", default="qwen3", choices=sorted(ARCHITECTURES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=INT",
                   help="config overrides, e.g. hidden_size=512 num_hidden_layers=8")
    a = p.parse_args()
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    print(write_tiny_model(a.path, a.arch, a.seed, **overrides))


if __name__ == "__main__":
    main()
