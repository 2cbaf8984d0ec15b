"""benchmarks/throughput.py's forward breakdown: the parts it times belong to the step it names, and
the shapes it bounds them with are the step's own (a wrong bound would mislabel what limits a step)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import forward_split  # noqa: E402


def test_decode_and_mixed_steps_are_split_with_their_own_shapes(tiny_model_dirs):
    from transformers import AutoConfig

    path = tiny_model_dirs["qwen3"]
    cfg = AutoConfig.from_pretrained(path)
    # 3 prompts of 200 tokens: a 512-token chunk (two prompts whole, 112 of the third: 2 rows sampled),
    # then the third's last 88 with the two's first decodes, then a decode of all three.
    prompts = [[5 + i] * 200 for i in range(3)]
    rows = forward_split(path, prompts, [4, 4, 4], "torch_paged", repeats=2)
    assert set(rows) == {"decode", "mixed"}
    dec, mix = rows["decode"], rows["mixed"]
    assert (dec["tokens"], dec["seqs"], dec["keys"]) == (3, 3, 202 + 202 + 201)
    assert (mix["tokens"], mix["seqs"], mix["keys"], mix["sampled"]) == (512, 3, 512, 2)  # 200 + 200 + 112
    hd = cfg.head_dim
    per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * (
        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd  # q, k, v
        + cfg.num_attention_heads * hd  # o
        + 3 * cfg.intermediate_size)  # gate, up, down
    head = 2 * cfg.hidden_size * cfg.vocab_size
    # Every new token through the decoder's linear layers, the LM head at the rows sampled.
    assert dec["linear_flops"] == 3 * per_token + 3 * head
    assert mix["linear_flops"] == 512 * per_token + mix["sampled"] * head
    kv_per_key = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * 4
    assert dec["kv_bytes"] == kv_per_key * 605 and mix["kv_bytes"] == kv_per_key * 512
    for r in (dec, mix):
        assert 0 < r["linear"] and 0 < r["attention"] and r["linear"] + r["attention"] < r["total"]
        assert r["alone"] > 0 and r["plain"] > 0 and r["calls"] > cfg.num_hidden_layers
