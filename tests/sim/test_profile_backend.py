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


def test_the_operator_table_is_timed_over_passes_in_their_own_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_model times every token count in each pass, the first pass in order and the later ones shuffled,
    and pools the samples: a slow first pass (the machine, for a second) does not set the table."""
    import sim.profile

    order: list[int] = []
    real_timer = sim.profile._timer

    def embedding_timer(fn: Any, repeats: int, sync: Any, clock: Any = None, before: Any = None) -> list[float]:
        order.append(int(fn.args[0].shape[1]))  # the embedding's token ids: this count's call
        return real_timer(fn, repeats, sync, clock, before)

    def drifting(layer_ops: Any, repeats: int, sync: Any, clock: Any) -> dict[str, list[float]]:
        slow = len(order) < 4  # the first pass runs at half speed
        return {op: [2.0 if slow else 1.0] * repeats for op in sim.profile.OPS if op != "emb"}

    monkeypatch.setattr(sim.profile, "_timer", embedding_timer)
    monkeypatch.setattr(sim.profile, "_time_in_step_order", drifting)
    rows = sim.profile.profile_model(sim.profile.model_folder("tiny"), (1, 2, 3, 4), 2, passes=3)
    assert order[:4] == [1, 2, 3, 4] and len(order) == 12
    assert all(sorted(order[i:i + 4]) == [1, 2, 3, 4] for i in (4, 8))
    assert order[4:8] != [1, 2, 3, 4] or order[8:] != [1, 2, 3, 4]
    assert [r["num_tokens"] for r in rows] == [1, 2, 3, 4]
    assert all(r["time_stats.mlp_up_proj.median"] == 1.0 and r["time_stats.mlp_up_proj.max"] == 2.0 for r in rows)
