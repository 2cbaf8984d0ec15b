"""sim.run settings refused before any work, one line naming the key and the fix, and
over_length=clip clipping to what the engine's pool holds."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from sim.run import CONF, check_settings, config_kv_window, simulate_config
from varlen.cli import SettingError


def sim_cfg(*overrides):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("sim", list(overrides))


@pytest.mark.parametrize("overrides, match", [
    # Today's main freed K/V the model's full-attention layers still read; the real engine refuses it.
    (["allocator=paged_window", "allocator.sliding_window=4096"],
     r"allocator.sliding_window=4096 frees K/V that sim_model llama3_8b still reads \(some layers attend to the "
     r"whole context, so nothing may be freed early\); use allocator=paged"),
    (["sim_model=tiny", "sim_model.config=tiny-mistral", "allocator=paged_window", "allocator.sliding_window=4"],
     r"allocator.sliding_window=4 frees K/V .* \(its widest window is 8\); set allocator.sliding_window=8"),
    (["sim_model=tiny", "sim_model.config=tiny-gemma2", "allocator=paged_window", "allocator.sliding_window=8"],
     r"some layers attend to the whole context"),
    # Today's main took 2.5 as 2, and ran parallel.tensor=1.5/true as TP 1.
    (["sim_model=tiny", "sim_model.config=tiny-mistral", "allocator=paged_window", "allocator.sliding_window=2.5"],
     r"allocator.sliding_window=2.5 is not valid: it must be an integer >= 1"),
    (["parallel.tensor=1.5"], r"parallel.tensor=1.5 is not valid: it must be an integer >= 1"),
    (["parallel.tensor=true"], r"parallel.tensor=True is not valid: it must be an integer >= 1"),
    (["parallel.tensor=abc"], r"parallel.tensor='abc' is not valid: it must be an integer >= 1"),
    (["parallel.pipeline=0"], r"parallel.pipeline=0 is not valid"),
    # Today's main ignored it silently.
    (["cluster.mode=disaggregated", "cluster.replicas=8"],
     r"cluster.replicas=8 sizes a colocated cluster; with cluster.mode=disaggregated use cluster.prefill_replicas "
     r"and cluster.decode_replicas"),
])
def test_nonsense_settings_are_refused_in_one_line(overrides, match):
    with pytest.raises(SettingError, match=match) as e:
        check_settings(sim_cfg(*overrides))
    assert "\n" not in str(e.value)


def test_a_sliding_window_model_takes_the_windowed_allocator():
    check_settings(sim_cfg("sim_model=tiny", "sim_model.config=tiny-mistral", "allocator=paged_window",
                           "allocator.sliding_window=8"))
    assert config_kv_window({"sliding_window": 4096, "model_type": "mistral"}) == 4096
    assert config_kv_window({"sliding_window": 4096, "use_sliding_window": False}) is None
    assert config_kv_window({"model_type": "llama"}) is None


def test_over_length_clip_clips_to_what_the_pool_holds():
    """Today's main clipped to engine.max_model_len (8192) and the pool of 64 x 16 = 1024 slots
    rejected every longer prompt."""
    cfg = sim_cfg("engine.num_blocks=64", "workload=synthetic", "workload.limit=40", "workload.rate=50",
                  "workload.prompt_len=uniform:600:2000", "workload.output_len=uniform:1:40")
    res, row = simulate_config(cfg)
    assert row["rejected"] == 0 and row["finished"] == 40
    assert row["trace_num_clipped"] > 0
    results = res.results  # their columns: output.token_times=false released the Request objects
    assert ((results.prompt_tokens + results.output_tokens) <= 1024).all()
