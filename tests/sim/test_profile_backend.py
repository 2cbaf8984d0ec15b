"""sim.profile times the attention backend a user's run computes: `--backend auto` (the default) resolves to
what `backend=auto` picks for the model here, and the attention table covers both of torch_paged's paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


def test_a_named_backend_is_taken_as_given_without_loading_the_model(tmp_path: Path) -> None:
    from sim.profile import resolve_backend

    # No model in the folder: a named backend must not need one.
    assert resolve_backend("torch_sdpa", tmp_path / "absent") == ("torch_sdpa", "backend: torch_sdpa")


def test_auto_resolves_to_what_backend_auto_picks_here() -> None:
    from sim.profile import resolve_backend
    from varlen.backend_choice import choose
    from varlen.tiny_model import ensure_tiny_model

    name, line = resolve_backend("auto", ensure_tiny_model("qwen3"))
    assert name == choose("cpu", torch.float32, 16, frozenset())[0]
    assert line.startswith(f"backend: auto -> {name} (cpu float32")


def test_auto_reads_the_models_layers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A model whose layers soft-cap (gemma2) needs a backend that can: with torch_sdpa first (which cannot),
    auto passes it over for the model and keeps it for one without soft-capping."""
    import varlen.backend_choice
    from sim.profile import resolve_backend
    from varlen.tiny_model import ensure_tiny_model, write_tiny_model

    monkeypatch.setitem(varlen.backend_choice.PREFERENCE, "cpu", ("torch_sdpa", "torch_ref"))
    gemma2 = write_tiny_model(tmp_path / "gemma2", "gemma2")
    name, line = resolve_backend("auto", gemma2)
    assert name == "torch_ref" and "torch_sdpa: lacks softcap" in line
    assert resolve_backend("auto", ensure_tiny_model("qwen3"))[0] == "torch_sdpa"


def test_the_cli_profiles_the_auto_choice_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sim.profile
    from varlen.backend_choice import choose

    timed: list[str] = []

    def fake_attention(folder: Path, backend: str, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        timed.append(backend)
        return [{"kind": "decode", "backend": backend}]

    monkeypatch.setattr(sim.profile, "profile_model", lambda *a, **k: [{"num_tokens": 1}])
    monkeypatch.setattr(sim.profile, "profile_attention", fake_attention)
    assert sim.profile.main(["--no-engine", "--out", str(tmp_path), "--tokens", "1", "--repeats", "1"]) == 0
    assert timed == [choose("cpu", torch.float32, 16, frozenset())[0]]
    assert sim.profile.main(["--no-engine", "--out", str(tmp_path), "--tokens", "1", "--repeats", "1",
                             "--backend", "torch_ref"]) == 0
    assert timed[-1] == "torch_ref"


def test_the_attention_table_times_both_paths_of_torch_paged() -> None:
    """torch_paged sends prompts of LONG_SDPA_MIN new tokens or more to SDPA and shorter ones (a chunk's tail,
    decodes) to its C kernel: the table holds prefill cases on both sides, with and without a cached prefix."""
    from backends.torch_paged import LONG_SDPA_MIN, load_kernel
    from sim.profile import model_folder, profile_attention

    if load_kernel() is None:
        pytest.skip("torch_paged's C kernel is unavailable here (no C compiler)")
    rows = profile_attention(model_folder("tiny"), "torch_paged", 1, passes=1)
    prefills = [(r["batch_size"], r["new_tokens"], r["cached_tokens"]) for r in rows if r["kind"] == "prefill"]
    kernel = [p for p in prefills if p[1] < LONG_SDPA_MIN]
    sdpa = [p for p in prefills if p[1] >= LONG_SDPA_MIN]
    assert any(c > 0 for _, _, c in kernel) and any(b > 1 for b, _, _ in kernel), kernel
    assert any(c > 0 for _, _, c in sdpa) and any(b > 1 for b, _, _ in sdpa), sdpa
    assert all(r["backend"] == "torch_paged" and r["time_stats.attention.median"] > 0 for r in rows)


def test_each_timed_attention_call_follows_a_read_of_one_layers_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the engine a layer's linears stream its weights between two attention calls, so the KV and the
    kernel's data are no longer in cache: the profile reads a buffer that large before each timed forward
    (off the clock), and not before the prepare; evict_bytes=0 times back to back."""
    import sim.profile
    from transformers import AutoModelForCausalLM

    folder = sim.profile.model_folder("tiny")
    model = AutoModelForCausalLM.from_pretrained(folder)
    linears = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    assert sim.profile.layer_weight_bytes(model.config, torch.float32) == 4 * linears

    seen: list[Any] = []
    real_timer = sim.profile._timer

    def spy(fn: Any, repeats: int, sync: Any, clock: Any = None, before: Any = None) -> list[float]:
        seen.append(before)
        return real_timer(fn, repeats, sync, clock, before)

    monkeypatch.setattr(sim.profile, "_timer", spy)
    monkeypatch.setattr(sim.profile, "DECODE_GRID", ((2, 64),))
    monkeypatch.setattr(sim.profile, "PREFILL_GRID", ((1, 16, 0),))
    sim.profile.profile_attention(folder, "torch_ref", 1, passes=1)
    forwards, prepares = seen[0::2], seen[1::2]
    assert all(b is not None for b in forwards) and all(b is None for b in prepares)
    assert forwards[0].__self__.numel() * 4 == 4 * linears  # the buffer's bytes: one layer's weights
    seen.clear()
    sim.profile.profile_attention(folder, "torch_ref", 1, passes=1, evict_bytes=0)
    assert all(b is None for b in seen)


def test_the_timed_calls_take_turns_over_one_kv_cache_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a step a layer's KV was last read a whole cycle of layers ago: with eviction the timed calls rotate over
    the model's layers' caches (at most KV_COPIES), so what stays in the CPU's cache does not hinge on the
    machine's other work; back to back (evict_bytes=0) one cache."""
    import sim.profile
    from backends.torch_ref import TorchRefBackend
    from transformers import AutoConfig

    folder = sim.profile.model_folder("tiny")
    layers = AutoConfig.from_pretrained(folder).num_hidden_layers
    used: list[int] = []
    real_forward = TorchRefBackend.forward

    def spy(self: Any, q: Any, k: Any, v: Any, kv_cache: torch.Tensor, *args: Any, **kw: Any) -> Any:
        used.append(kv_cache.data_ptr())
        return real_forward(self, q, k, v, kv_cache, *args, **kw)

    monkeypatch.setattr(TorchRefBackend, "forward", spy)
    monkeypatch.setattr(sim.profile, "DECODE_GRID", ((2, 64),))
    monkeypatch.setattr(sim.profile, "PREFILL_GRID", ())
    sim.profile.profile_attention(folder, "torch_ref", 2 * layers, passes=1)
    assert len(set(used)) == min(layers, sim.profile.KV_COPIES) > 1
    assert all(a != b for a, b in zip(used, used[1:]))  # never the same cache twice in a row
    used.clear()
    sim.profile.profile_attention(folder, "torch_ref", 2 * layers, passes=1, evict_bytes=0)
    assert len(set(used)) == 1


def _count(layer_ops: Any) -> int:
    """The token count a profile_model visit times (its first layer's add returns a [1, t, hidden] tensor)."""
    return int(layer_ops[0]["add"]().shape[1])


def test_the_operator_table_is_timed_in_rounds_in_their_own_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_model times every token count in each of passes x repeats rounds, the first round in order and
    the later ones shuffled, decode sizes SMALL_VISITS times a round, and pools the samples over each round's
    speed: a slow first round (the machine, for a second) does not set the table, not even its max."""
    import sim.profile

    order: list[int] = []
    per_round = 4 * sim.profile.SMALL_VISITS

    def drifting(layer_ops: Any, repeats: int, sync: Any, clock: Any, untimed: int = 2) -> dict[str, list[float]]:
        if repeats:
            order.append(_count(layer_ops))
        slow = 0 < len(order) <= per_round  # the first round runs at half speed
        return {op: [2.0 if slow else 1.0] * repeats for op in sim.profile.OPS if op != "emb"}

    monkeypatch.setattr(sim.profile, "_time_in_step_order", drifting)
    rows = sim.profile.profile_model(sim.profile.model_folder("tiny"), (1, 2, 3, 4), 2, passes=3)
    assert len(order) == 6 * per_round
    assert order[:4] == [1, 2, 3, 4]
    rounds = [order[i:i + per_round] for i in range(0, len(order), per_round)]
    assert all(sorted(r) == sorted([1, 2, 3, 4] * sim.profile.SMALL_VISITS) for r in rounds)
    assert any(r != rounds[0] for r in rounds[1:])
    assert [r["num_tokens"] for r in rows] == [1, 2, 3, 4]
    # (each round's speed counts the embedding's real time beside the mocked 1.0 / 2.0 ms: within 1%)
    assert all(r["time_stats.mlp_up_proj.median"] == pytest.approx(1.0, rel=0.01)
               and r["time_stats.mlp_up_proj.max"] == pytest.approx(1.0, rel=0.01) for r in rows)


def test_a_table_timed_on_a_drifting_machine_keeps_the_counts_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's speed moving from second to second (a VM's drift, another core's memory traffic) must not
    land on one token count: timed in blocks, each count carried its block's speed and two tables disagreed
    10-20% per count; in rounds, every count shares each round's speed and the shape holds."""
    import math

    import sim.profile

    calls = [0]
    base = {1: 1.0, 2: 1.3, 3: 1.1, 4: 1.2, 24: 2.0, 64: 4.0}

    def drifting(layer_ops: Any, repeats: int, sync: Any, clock: Any, untimed: int = 2) -> dict[str, list[float]]:
        t = _count(layer_ops)
        out = []
        for _ in range(repeats):
            calls[0] += 1
            out.append(base[t] * (1.0 + 0.3 * math.sin(calls[0] / 40.0)))  # a swing over a few rounds
        return {op: list(out) for op in sim.profile.OPS if op != "emb"}

    monkeypatch.setattr(sim.profile, "_time_in_step_order", drifting)
    rows = sim.profile.profile_model(sim.profile.model_folder("tiny"), tuple(base), 5, passes=3)
    got = {r["num_tokens"]: r["time_stats.mlp_up_proj.median"] for r in rows}
    shape = [got[t] / got[1] / (base[t] / base[1]) for t in base]
    assert max(shape) / min(shape) < 1.03


def test_round_speeds_are_each_rounds_median_over_its_entries() -> None:
    from sim.profile import round_speeds

    rounds = [{1: 1.0, 2: 10.0, 3: 5.0}, {1: 1.5, 2: 15.0, 3: 7.5}, {1: 1.0, 2: 10.0, 3: 50.0}]
    assert round_speeds(rounds) == pytest.approx([1.0, 1.5, 1.0])  # one entry's outlier does not move its round


def test_attention_rows_name_the_backends_long_prompt_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_paged sends requests of >= LONG_SDPA_MIN new tokens to SDPA: its rows say so (the measured model
    fits that path's rates apart); a backend with one path writes 0."""
    import sim.profile
    from backends.torch_paged import LONG_SDPA_MIN

    monkeypatch.setattr(sim.profile, "DECODE_GRID", ((2, 64),))
    monkeypatch.setattr(sim.profile, "PREFILL_GRID", ((1, 64, 16),))
    folder = sim.profile.model_folder("tiny")
    paged = sim.profile.profile_attention(folder, "torch_paged", 1, passes=1)
    assert [r["long_query_min"] for r in paged] == [LONG_SDPA_MIN] * 2
    assert [r["long_query_min"] for r in sim.profile.profile_attention(folder, "torch_ref", 1, passes=1)] == [0, 0]
