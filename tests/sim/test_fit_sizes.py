"""profiled's per-size offsets (decode_batch_K, chunk_sampled_K): step time that depends on the exact
small batch, fitted where the log has enough steps of that size, serialized and checked on input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sim.cost.fitted import DEFAULT_FEATURES, LINEAR_FEATURES, ProfiledCostModel, size_features
from sim.fit import FitInputError, expand_features, fit_run

# A decode-only step's time by batch size on top of the linear form: 2 requests slower than 3, as
# a GEMM's kernel path changes with the row count.
DECODE_BUMP = {1: 0.0, 2: 6.7e-3, 3: 2.0e-3, 4: 1.0e-3}
CHUNK_BUMP = {1: 1.5e-3, 2: 3.0e-3}  # the LM head at 1 and 2 sampled rows beside a prompt chunk


def _true_time(new: list[int], cached: list[int], logits: int) -> float:
    t = 20e-3 + 0.1e-3 * sum(new) + 1e-3 * len(new) + 1e-8 * sum(cached)
    if max(new) == 1:
        return t + DECODE_BUMP.get(len(new), 0.0)
    return t + CHUNK_BUMP.get(logits, 0.0)


def _log(seed: int, count: int = 800) -> list[tuple[list[int], list[int], float, int]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        if rng.random() < 0.7:
            k = int(rng.integers(1, 7))
            new, cached, logits = [1] * k, [int(c) for c in rng.integers(10, 500, k)], k
        else:
            d = int(rng.integers(0, 4))
            new = [int(rng.integers(16, 300))] + [1] * d
            cached = [0] + [int(c) for c in rng.integers(10, 500, d)]
            logits = d + int(rng.integers(0, 2))
        rows.append((new, cached, _true_time(new, cached, logits), logits))
    return rows


WITH_SIZES = LINEAR_FEATURES + size_features(8)


@pytest.mark.parametrize("weighting", ["absolute", "relative"])
def test_size_offsets_fit_a_log_the_linear_form_cannot(weighting: str) -> None:
    rows = _log(0)
    linear = ProfiledCostModel.fit(rows, features=LINEAR_FEATURES, weighting=weighting)
    decodes = ProfiledCostModel.fit([r for r in rows if max(r[0]) == 1 or r[3] == 0], weighting=weighting,
                                    features=LINEAR_FEATURES + size_features(8)[:8])
    assert decodes.report.max_ape < 1e-6  # the decode offsets alone fit the decode-only and silent-chunk steps
    sized = ProfiledCostModel.fit(rows, features=WITH_SIZES, weighting=weighting)
    assert linear.report.max_ape > 5.0  # the old form misses the 2-request decodes
    assert sized.report.max_ape < 1e-6
    got = sized.coefficients()
    assert got["decode_batch_2"] - got["decode_batch_3"] == pytest.approx(4.7e-3, rel=1e-6)
    assert got["chunk_sampled_2"] - got["chunk_sampled_1"] == pytest.approx(1.5e-3, rel=1e-6)
    # Held out: a fresh log of the same engine.
    assert sized.score(_log(1)).max_ape < 1e-6 and linear.score(_log(1)).max_ape > 5.0
    # Opt-in: the default stays linear (a size with too few training steps is left to the linear terms).
    assert DEFAULT_FEATURES == LINEAR_FEATURES


def test_a_size_with_too_few_steps_keeps_the_linear_form() -> None:
    rows = _log(2)
    fours = [r for r in rows if max(r[0]) == 1 and len(r[0]) == 4]
    rare = [r for r in rows if not (max(r[0]) == 1 and len(r[0]) == 4)] + fours[:5]
    model = ProfiledCostModel.fit(rare, features=WITH_SIZES, min_size_steps=20)
    assert model.coefficients()["decode_batch_4"] == 0.0
    assert "decode_batch_4" in model.meta["size_offsets_unfitted"]
    assert "decode_batch_2" not in model.meta["size_offsets_unfitted"]
    assert model.coefficients()["decode_batch_2"] != 0.0
    # Sizes the log never shows, and sizes beyond the named ones, take the linear form.
    lin = ProfiledCostModel(coef={k: v for k, v in model.coefficients().items() if k in LINEAR_FEATURES})
    for k in (4, 7, 12):
        new, cached = [1] * k, [100] * k
        assert model.step_time(new, cached) == lin.step_time(new, cached)


def test_the_fast_forward_and_explain_see_the_offsets() -> None:
    model = ProfiledCostModel(coef={"const": 1e-3, "decode_batch_2": 5e-3, "chunk_sampled_1": 2e-3})
    assert model.step_time([1, 1], [5, 9]) == pytest.approx(6e-3)
    assert model.step_time([1, 1, 1], [5, 9, 9]) == pytest.approx(1e-3)
    assert model.step_time([40, 1], [0, 9], num_logits=1) == pytest.approx(3e-3)
    assert model.step_time([40, 1], [0, 9], num_logits=2) == pytest.approx(1e-3)
    from sim.explain import breakdown, overhead_terms

    assert breakdown(model, [1, 1], [5, 9])["total_s"] == pytest.approx(6e-3)
    terms = overhead_terms(model, [1, 1])
    assert terms["size_offset"] == "decode_batch_2" and terms["size_offset_s"] == pytest.approx(5e-3)
    assert overhead_terms(model, [1, 1, 1])["size_offset"] is None


def test_round_trip_and_an_old_fit_json_loads(tmp_path: Path) -> None:
    model = ProfiledCostModel.fit(_log(3), features=WITH_SIZES)
    path = tmp_path / "fit.json"
    model.save(path)
    back = ProfiledCostModel.load(path)
    assert back.features == model.features and back.meta == model.meta
    np.testing.assert_array_equal(back.coef, model.coef)
    for new, cached, _, logits in _log(4, 50):
        assert back.step_time(new, cached, logits) == model.step_time(new, cached, logits)
    # A file written before the size offsets existed (version 1, linear features only).
    old = {"format": "varlen.profiled_cost_model", "version": 1, "features": ["const", "new_tokens", "num_seqs"],
           "coef": [2e-3, 1e-4, 5e-4], "report": {"n_steps": 10, "r2": 0.99, "mape": 1.0, "max_ape": 3.0},
           "meta": {"weighting": "absolute", "outliers_dropped": 0}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    m = ProfiledCostModel.load(tmp_path / "old.json")
    assert m.step_time([1, 1], [3, 4]) == pytest.approx(2e-3 + 2e-4 + 1e-3)


@pytest.mark.parametrize("bad", ["decode_batch_0", "decode_batch_x", "decode_batch_02", "chunk_sampled_65", "batch_2"])
def test_a_bad_name_is_one_line_naming_the_known_ones(bad: str) -> None:
    with pytest.raises(ValueError) as e:
        ProfiledCostModel(features=["const", bad])
    msg = str(e.value)
    assert bad in msg and "decode_batch_K" in msg and "chunk_sampled_K" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="at most once"):
        ProfiledCostModel(features=["const", "decode_batch_2", "decode_batch_2"])


def test_sim_fit_expands_ranges_and_rejects_bad_names(tmp_path: Path) -> None:
    assert expand_features("const,decode_batch_1..3") == ["const", "decode_batch_1", "decode_batch_2", "decode_batch_3"]
    (tmp_path / "run").mkdir()
    with pytest.raises(FitInputError, match="--features: unknown features"):
        fit_run(tmp_path / "run", features=["const", "decode_batch_zero"])


def test_sim_fit_refuses_chunk_sampled_without_sampled_rows(tmp_path: Path) -> None:
    import pandas as pd

    (tmp_path / "run").mkdir()
    pd.DataFrame(dict(start=[0.0, 1.0, 2.0], duration=[1e-3] * 3, num_waiting=[0] * 3, new_tokens=["40 1", "1 1", "1"],
                      cached_tokens=["0 5", "41 6", "42"])).to_csv(tmp_path / "run" / "steps.csv", index=False)
    with pytest.raises(FitInputError, match="no num_sampled column"):
        fit_run(tmp_path / "run", features=["const", "chunk_sampled_1"])
    assert fit_run(tmp_path / "run", features=["const", "decode_batch_1"]).report.n_steps == 3
