"""Traces: readers against the fixtures (and the real files when present), options, errors,
synthetic workloads and deterministic prompt content."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from varlen.traces import (
    MAX_LENGTH, LengthDist, SyntheticTrace, TraceFormatError, TraceRequest, load_trace, synth_prompt_tokens,
)

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE_CONV = DATA / "azure_conv_small.csv"
AZURE_CODE = DATA / "azure_code_small.csv"
MOONCAKE = DATA / "mooncake_conv_small.jsonl"


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# Readers


def test_azure_fixture_matches_the_file() -> None:
    rows = _csv_rows(AZURE_CONV)
    tr = load_trace(AZURE_CONV)
    assert len(tr) == len(rows) == 40 and tr.stats.kind == "azure"
    t0 = datetime.fromisoformat(rows[0]["TIMESTAMP"][:26])  # stdlib takes 6 fractional digits
    for req, row in zip(tr, rows):
        assert req.prompt_len == int(row["ContextTokens"])
        assert req.output_len == int(row["GeneratedTokens"])
        expect = (datetime.fromisoformat(row["TIMESTAMP"][:26]) - t0).total_seconds()
        assert req.arrival_s == pytest.approx(expect, abs=2e-6)
        assert req.hash_ids is None
    assert tr[0].arrival_s == 0.0
    assert tr.stats.num_reordered == tr.stats.num_dropped == tr.stats.num_clipped == 0
    assert len(load_trace(AZURE_CODE)) == 24


def test_mooncake_fixture_matches_the_file() -> None:
    objs = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    tr = load_trace(MOONCAKE)
    assert len(tr) == len(objs) == 30 and tr.stats.kind == "mooncake"
    for req, o in zip(tr, objs):
        assert req.arrival_s == pytest.approx((o["timestamp"] - objs[0]["timestamp"]) / 1000)
        assert (req.prompt_len, req.output_len) == (o["input_length"], o["output_length"])
        assert req.hash_ids == tuple(o["hash_ids"])
        # One hash id per 512-token block: the fixture must be the format we think it is.
        assert len(req.hash_ids) == -(-req.prompt_len // 512)


def test_azure_2024_timestamps_with_offsets_and_unsorted_rows_are_sorted(tmp_path: Path) -> None:
    p = tmp_path / "azure2024.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:01.500000+00:00,10,5\n"
                 "2024-05-10 00:00:00.009930+00:00,20,6\n"
                 "2024-05-10 00:00:03.000000+00:00,30,7\n")
    tr = load_trace(p)
    assert [r.prompt_len for r in tr] == [20, 10, 30]
    assert [r.req_id for r in tr] == ["1", "0", "2"]  # source rows, so reordering stays traceable
    assert tr[1].arrival_s == pytest.approx(1.49007)
    assert tr.stats.num_reordered == 1


def test_blank_lines_are_skipped_and_zero_outputs_raised_to_one(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0,5,0\n\n2023-11-16 18:15:47.0,6,3\n")
    tr = load_trace(p)
    assert [(r.prompt_len, r.output_len) for r in tr] == [(5, 1), (6, 3)]
    assert tr.stats.num_zero_output == 1
    m = tmp_path / "t.jsonl"
    m.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2}\n\n'
                 '{"timestamp": 1500, "input_length": 4, "output_length": 1, "hash_ids": [7]}\n')
    tr = load_trace(m)
    assert tr[0].hash_ids is None and tr[1].hash_ids == (7,) and tr[1].arrival_s == 1.5


# ---------------------------------------------------------------------------------------------
# Errors name the file, the line and the reason

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize("content, line, reason", [
    ("TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:46.6805900,374\n", 1, "missing column(s) GeneratedTokens"),
    (AZ_HEADER + AZ_OK + "2023-11-16 18:15:47.0,abc,44\n", 3, "non-numeric value 'abc' in column ContextTokens"),
    (AZ_HEADER + AZ_OK + AZ_OK + "\n2023-11-16 18:15:47.0,10,\n", 5, "missing value in column GeneratedTokens"),
    (AZ_HEADER + AZ_OK + "2023-11-16 18:15:47.0,10.5,3\n", 3, "non-integer value '10.5'"),
    (AZ_HEADER + AZ_OK + "2023-11-16 18:15:47.0,10,-3\n", 3, "negative output length -3"),
    (AZ_HEADER + "2023-11-16 18:15:47.0,0,3\n", 2, "zero prompt length"),
    (AZ_HEADER + AZ_OK + "yesterday,10,3\n", 3, "unparseable timestamp 'yesterday'"),
    (AZ_HEADER + AZ_OK + AZ_OK + "2023-11-16 18:15:47.0,1,2,3\n", 4, "malformed CSV row"),
    ("", 1, "empty file"),
    # A column of booleans was typed bool by pandas and read as 1-token prompts.
    (AZ_HEADER + "2023-11-16 18:15:47.0,true,3\n", 2, "non-numeric value 'true' in column ContextTokens"),
    (AZ_HEADER + AZ_OK + "2023-11-16 18:15:47.0,10,false\n", 3, "non-numeric value 'false'"),
    # 20 digits: parsed as uint64, wrapped to a "negative prompt length".
    (AZ_HEADER + "2023-11-16 18:15:47.0,12345678901234567890,3\n", 2, "out of range"),
    (AZ_HEADER + AZ_OK + "2023-11-16 18:15:47.0,10,1e30\n", 3, "out of range"),
])
def test_azure_errors(tmp_path: Path, content: str, line: int, reason: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(content)
    with pytest.raises(ValueError) as e:
        load_trace(p)
    assert isinstance(e.value, TraceFormatError)
    assert str(p) in str(e.value) and f"line {line}:" in str(e.value) and reason in str(e.value)
    assert e.value.line == line


MC_OK = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("content, line, reason", [
    (MC_OK + '{"timestamp": 1, "input_length": 600,\n', 2, "invalid JSON"),
    (MC_OK + "\n" + '{"timestamp": 1, "output_length": 5}\n', 3, "missing field 'input_length'"),
    (MC_OK + '{"timestamp": "soon", "input_length": 6, "output_length": 5}\n', 2, "non-numeric timestamp"),
    (MC_OK + '{"timestamp": 1, "input_length": -6, "output_length": 5}\n', 2, "negative prompt length"),
    (MC_OK + '{"timestamp": 1, "input_length": 6.5, "output_length": 5}\n', 2, "non-integer input_length"),
    (MC_OK + '{"timestamp": 1, "input_length": 6, "output_length": 5, "hash_ids": [1, "x"]}\n', 2,
     "hash_ids must be a list of integers"),
    (MC_OK + "[1, 2]\n", 2, "expected a JSON object"),
    # These raised OverflowError (no file, no line).
    (MC_OK + '{"timestamp": 1, "input_length": 1e30, "output_length": 5}\n', 2, "input_length 1e+30 is out of range"),
    (MC_OK + '{"timestamp": 1, "input_length": 6, "output_length": 99999999999999999999}\n', 2, "out of range"),
    (MC_OK + '{"timestamp": 1, "input_length": 6, "output_length": 5, "hash_ids": [%d]}\n' % 2**64, 2,
     "hash id 18446744073709551616 is out of range"),
    (MC_OK + '{"timestamp": %d, "input_length": 6, "output_length": 5}\n' % 10**400, 2, "out of range"),
])
def test_mooncake_errors(tmp_path: Path, content: str, line: int, reason: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert str(p) in str(e.value) and f"line {line}:" in str(e.value) and reason in str(e.value)


def test_hash_ids_of_64_bits_signed_or_unsigned_are_blocks(tmp_path: Path) -> None:
    """Ids >= 2**63 (unsigned 64-bit hashes) raised OverflowError when prompts were synthesised;
    an unsigned id and the signed id of the same bits are the same block."""
    p = tmp_path / "u64.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [%d, 7]}\n'
                 '{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [-1, 7]}\n' % (2**64 - 1))
    a, b = (synth_prompt_tokens(r, 1000) for r in load_trace(p))
    assert len(a) == 600 and np.array_equal(a[:512], b[:512])


def test_compressed_traces_load_by_name_and_misnamed_ones_are_said(tmp_path: Path) -> None:
    for name, fixture in (("t.csv.gz", AZURE_CONV), ("t.jsonl.gz", MOONCAKE)):
        p = tmp_path / name
        p.write_bytes(gzip.compress(Path(fixture).read_bytes()))
        got, want = load_trace(p, limit=50), load_trace(fixture, limit=50)
        assert got.columns()["prompt_len"].tolist() == want.columns()["prompt_len"].tolist()
        assert got.stats.kind == want.stats.kind
    plain = tmp_path / "gz.csv"
    plain.write_bytes(gzip.compress((AZ_HEADER + AZ_OK).encode()))
    with pytest.raises(TraceFormatError, match=r"gz\.csv: line 1: gzip-compressed data in a file named \.csv"):
        load_trace(plain)
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text(MC_OK)
    with pytest.raises(TraceFormatError, match="not gzip-compressed"):
        load_trace(fake)


def test_a_utf8_bom_before_jsonl_is_not_json(tmp_path: Path) -> None:
    """Was "unknown line: invalid JSON": the BOM broke the joined parse, and every line alone parsed."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (MC_OK * 2).encode())
    assert [r.prompt_len for r in load_trace(p)] == [600, 600]


_FIELD_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(alphabet="0123456789eE+-.xtrufalsTRUFALS ", max_size=25))


@given(st.sampled_from(["input_length", "output_length", "timestamp"]), _FIELD_VALUES)
def test_any_mooncake_field_value_loads_exactly_or_names_its_line(field: str, value: object) -> None:
    import tempfile

    obj = {"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    obj[field] = value
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        p.write_text(MC_OK + json.dumps(obj) + "\n")
        try:
            t = load_trace(p)
        except TraceFormatError as e:
            assert e.line == 2 and str(p) in str(e)
            return
    first, r = sorted(t.requests, key=lambda x: x.req_id)  # by line: arrivals are sorted and re-zeroed
    if field == "timestamp":
        assert r.arrival_s - first.arrival_s == pytest.approx(float(value) / 1000.0)
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        assert int(value) == value and 0 <= value <= MAX_LENGTH
        want = max(int(value), field == "output_length")  # an output length 0 is raised to 1
        assert getattr(r, "prompt_len" if field == "input_length" else "output_len") == want
        if r.prompt_len <= 10**5:
            assert len(synth_prompt_tokens(r, 100)) == r.prompt_len


@given(st.sampled_from(["ContextTokens", "GeneratedTokens"]),
       st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str), st.sampled_from(
           ["true", "false", "True", "1e30", "1.0", "1.5", "nan", "inf", "-0", "0x10", "", "1_000"]),
           st.text(alphabet="0123456789.eE+-", min_size=1, max_size=22)))
def test_any_azure_length_loads_exactly_or_names_its_line(column: str, raw: str) -> None:
    import tempfile

    row = {"ContextTokens": "374", "GeneratedTokens": "44", column: raw}
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.csv"
        p.write_text(AZ_HEADER + AZ_OK + f"2023-11-16 18:15:47.0,{row['ContextTokens']},{row['GeneratedTokens']}\n")
        try:
            t = load_trace(p)
        except TraceFormatError as e:
            assert e.line == 3 and str(p) in str(e)
            return
    v = float(raw)  # what loaded must be exactly the number written
    r = next(x for x in t.requests if x.req_id == "1")
    got = r.prompt_len if column == "ContextTokens" else r.output_len
    assert v == int(v) and 0 <= v <= MAX_LENGTH and got == max(int(v), column == "GeneratedTokens")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="not both"):
        load_trace(AZURE_CONV, time_scale=2, rate=3)
    with pytest.raises(ValueError, match="over_length"):
        load_trace(AZURE_CONV, max_model_len=100, over_length="truncate")
    with pytest.raises(FileNotFoundError):
        load_trace(DATA / "nope.csv")
    with pytest.raises(ValueError, match="kind"):
        load_trace(DATA / "README.md")
    with pytest.raises(ValueError, match="arrival"):
        load_trace(SyntheticTrace(arrival="weibull"))


# ---------------------------------------------------------------------------------------------
# Options


def test_clip_keeps_prefix_and_bounds_total() -> None:
    full = load_trace(MOONCAKE)
    M = 8192
    tr = load_trace(MOONCAKE, max_model_len=M, over_length="clip")
    over = [r for r in full if r.prompt_len + r.output_len > M]
    long_prompt = [r for r in full if r.prompt_len >= M]
    assert len(tr) == len(full)
    assert tr.stats.num_clipped == len(over) > 0 and tr.stats.num_prompt_clipped == len(long_prompt) > 0
    for a, b in zip(full, tr):
        assert b.prompt_len + b.output_len <= M and b.output_len >= 1
        if a.prompt_len + a.output_len <= M:
            assert (b.prompt_len, b.output_len, b.hash_ids) == (a.prompt_len, a.output_len, a.hash_ids)
        else:
            assert b.prompt_len == min(a.prompt_len, M - 1)
            # The kept blocks are the prompt's prefix, one per 512 tokens of what remains.
            assert b.hash_ids == a.hash_ids[: -(-b.prompt_len // 512)]


def test_drop_and_limit_counts() -> None:
    full = load_trace(MOONCAKE)
    M = 8192
    fits = [r for r in full if r.prompt_len + r.output_len <= M]
    tr = load_trace(MOONCAKE, max_model_len=M, over_length="drop")
    assert [r.req_id for r in tr] == [r.req_id for r in fits]
    assert tr.stats.num_dropped == len(full) - len(fits) > 0
    # With a limit, only the requests looked at before the limit was reached are counted.
    lim = 5
    tr = load_trace(MOONCAKE, max_model_len=M, over_length="drop", limit=lim)
    assert [r.req_id for r in tr] == [r.req_id for r in fits[:lim]]
    last = int(fits[lim - 1].req_id)
    assert tr.stats.num_dropped == sum(r.prompt_len + r.output_len > M for r in full[: last + 1])
    assert tr[0].arrival_s == 0.0
    assert len(load_trace(AZURE_CONV, limit=0)) == 0


def test_time_scale_and_rate() -> None:
    base = load_trace(AZURE_CONV)
    half = load_trace(AZURE_CONV, time_scale=0.5)
    np.testing.assert_allclose(half.columns()["arrival_s"], base.columns()["arrival_s"] * 0.5)
    assert half.stats.mean_rate == pytest.approx(2 * base.stats.mean_rate)
    tr = load_trace(AZURE_CONV, rate=20.0)
    assert tr.stats.mean_rate == pytest.approx(20.0)
    assert tr.stats.time_scale == pytest.approx(base.stats.mean_rate / 20.0)


def test_rate_on_a_long_synthetic_trace() -> None:
    tr = load_trace(SyntheticTrace(requests=20_000, rate=4.0, seed=1), rate=25.0)
    arr = tr.columns()["arrival_s"]
    assert tr.stats.mean_rate == pytest.approx(25.0, rel=1e-9)
    # Measured independently: arrivals per second over the middle of the trace.
    lo, hi = arr[len(arr) // 4], arr[3 * len(arr) // 4]
    inside = np.count_nonzero((arr >= lo) & (arr < hi))
    assert inside / (hi - lo) == pytest.approx(25.0, rel=0.03)


def test_a_synthetic_trace_keeps_its_rate_when_requests_are_dropped() -> None:
    """over_length=drop removes generated requests; the ones kept still arrive at the rate asked for
    (before: rate x the share kept, while sim.capacity reports the rate it asked for)."""
    spec = SyntheticTrace(requests=20_000, rate=8.0, seed=2, prompt_len=LengthDist("uniform", low=1, high=1000),
                          output_len=LengthDist("fixed", value=100))
    kept = load_trace(spec, max_model_len=600, over_length="drop")
    assert 0.4 < len(kept) / 20_000 < 0.6 and kept.stats.num_dropped == 20_000 - len(kept)
    assert kept.stats.mean_rate == pytest.approx(8.0, rel=0.03)
    clipped = load_trace(spec, max_model_len=600, over_length="clip")  # nothing dropped: arrivals as generated
    np.testing.assert_array_equal(clipped.columns()["arrival_s"], load_trace(spec).columns()["arrival_s"])


# ---------------------------------------------------------------------------------------------
# Synthetic


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_synthetic_arrivals(arrival: str, cv: float) -> None:
    tr = load_trace(SyntheticTrace(requests=20_000, rate=8.0, arrival=arrival, cv=cv, seed=3))
    gaps = np.diff(tr.columns()["arrival_s"])
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    assert tr[0].arrival_s == 0.0 and (gaps >= 0).all()


def test_synthetic_is_seeded_and_streams_are_independent() -> None:
    a = load_trace(SyntheticTrace(requests=50, rate=2, prompt_len="uniform:10:20", seed=7))
    b = load_trace(SyntheticTrace(requests=50, rate=2, prompt_len="uniform:10:20", seed=7))
    c = load_trace(SyntheticTrace(requests=50, rate=2, prompt_len="uniform:10:20", seed=8))
    d = load_trace(SyntheticTrace(requests=50, rate=2, prompt_len="lognormal:300:1", seed=7))
    assert a.requests == b.requests and a.requests != c.requests
    # Changing the prompt distribution leaves arrivals and outputs as they were.
    assert [(r.arrival_s, r.output_len) for r in a] == [(r.arrival_s, r.output_len) for r in d]


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    assert (LengthDist.parse(37).sample(rng, 5) == 37).all()
    assert LengthDist.parse("fixed:12") == LengthDist.parse("12") == LengthDist("fixed", value=12)
    u = LengthDist.parse("uniform:5:9").sample(rng, 10_000)
    assert u.min() == 5 and u.max() == 9
    ln = LengthDist.parse({"kind": "lognormal", "mean": 800, "sigma": 0.7}).sample(rng, 200_000)
    assert ln.mean() == pytest.approx(800, rel=0.02) and ln.min() >= 1
    capped = LengthDist.parse("lognormal:800:2:1000").sample(rng, 10_000)
    assert capped.max() == 1000
    for bad in ("gauss:1:2", "uniform:5", "uniform:9:5", "lognormal:-1:1", {"kind": "fixed", "value": -1}):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_empirical_lengths_resample_whole_rows() -> None:
    src = load_trace(AZURE_CONV)
    pairs = {(r.prompt_len, r.output_len) for r in src}
    emp = f"empirical:{AZURE_CONV}"
    tr = load_trace(SyntheticTrace(requests=500, prompt_len=emp, output_len=emp, seed=2))
    assert {(r.prompt_len, r.output_len) for r in tr} <= pairs
    assert len({(r.prompt_len, r.output_len) for r in tr}) > 20  # actually resampled
    # Mixed with another distribution, the empirical column is still drawn from its source.
    tr = load_trace(SyntheticTrace(requests=200, prompt_len=emp, output_len=64, seed=2))
    assert {r.prompt_len for r in tr} <= {p for p, _ in pairs} and {r.output_len for r in tr} == {64}


# ---------------------------------------------------------------------------------------------
# Prompt content


def test_identical_hash_ids_give_identical_tokens_wherever_they_appear() -> None:
    a = TraceRequest(0.0, 1024, 1, hash_ids=(5, 6), req_id="a")
    b = TraceRequest(0.0, 1536, 1, hash_ids=(9, 5, 6), req_id="b")
    ta, tb = synth_prompt_tokens(a, 32000), synth_prompt_tokens(b, 32000)
    np.testing.assert_array_equal(ta, tb[512:1536])
    assert not np.array_equal(ta[:512], tb[:512])


def test_shared_hash_prefixes_in_the_mooncake_fixture() -> None:
    tr = load_trace(MOONCAKE)
    found = 0
    for i, a in enumerate(tr):
        for b in tr.requests[:i]:
            k = 0
            while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
                k += 1
            ta, tb = synth_prompt_tokens(a, 151_936), synth_prompt_tokens(b, 151_936)
            shared = min(k * 512, a.prompt_len, b.prompt_len)
            np.testing.assert_array_equal(ta[:shared], tb[:shared])
            if k < min(len(a.hash_ids), len(b.hash_ids)):
                assert (ta[k * 512:(k + 1) * 512][:50] != tb[k * 512:(k + 1) * 512][:50]).any()
            found += k >= 5
    assert found >= 4  # the fixture was cut to include long shared prefixes


def test_prompt_tokens_deterministic_unique_and_sized() -> None:
    r1 = TraceRequest(1.0, 700, 3, req_id="1")
    r2 = TraceRequest(1.0, 700, 3, req_id="2")
    t1 = synth_prompt_tokens(r1, 1000)
    assert t1.dtype == np.int64 and t1.shape == (700,) and 0 <= t1.min() and t1.max() < 1000
    np.testing.assert_array_equal(t1, synth_prompt_tokens(TraceRequest(1.0, 700, 3, req_id="1"), 1000))
    assert (t1 != synth_prompt_tokens(r2, 1000)).mean() > 0.99
    assert (t1 != synth_prompt_tokens(r1, 1000, seed=1)).mean() > 0.99
    # Without ids, the request's own numbers key the content.
    anon = [synth_prompt_tokens(TraceRequest(t, 64, 1), 50_000) for t in (0.0, 0.5)]
    assert (anon[0] != anon[1]).mean() > 0.99
    # Hash ids covering less than the prompt: the rest is per-request, not repeated blocks.
    short = TraceRequest(0.0, 1000, 1, hash_ids=(3,), req_id="x")
    ts = synth_prompt_tokens(short, 50_000)
    assert ts.shape == (1000,) and (ts[512:1000] != ts[:488]).mean() > 0.99
    # Cut to prompt_len when the blocks cover more.
    assert synth_prompt_tokens(TraceRequest(0.0, 10, 1, hash_ids=(3, 4)), 50_000).shape == (10,)
    # Tokens are spread over the vocabulary rather than clustered.
    big = synth_prompt_tokens(TraceRequest(0.0, 100_000, 1, req_id="u"), 100)
    assert np.bincount(big, minlength=100).min() > 800


# ---------------------------------------------------------------------------------------------
# The real traces


def test_full_azure_conv_trace_loads() -> None:
    tr = load_trace("azure_conv")  # as shipped: gzipped package data
    s = tr.stats
    assert len(tr) == 19_366 and s.num_reordered == 0
    # The statistics the traces README reports.
    assert round(s.prompt_mean) == 1155 and s.prompt_p50 == 1020 and round(s.prompt_p99) == 4142
    assert round(s.output_mean) == 211 and s.output_p50 == 129
    assert s.duration_s == pytest.approx(3501.72, abs=0.01)


def test_full_azure_code_and_mooncake_traces_load() -> None:
    code = load_trace("azure_code")
    assert len(code) == 8_819 and round(code.stats.prompt_mean) == 2048 and code.stats.output_p50 == 13
    mc = load_trace("mooncake_conv")
    assert len(mc) == 12_031 and mc.stats.prompt_p50 == 6909 and mc.stats.output_p50 == 350
    # Block reuse with an unbounded cache, as the README measured it: blocks seen before.
    seen: set[int] = set()
    reused = total = 0
    for r in mc:
        reused += sum(h in seen for h in r.hash_ids)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    assert reused / total == pytest.approx(0.366, abs=0.001)


# ---------------------------------------------------------------------------------------------
# The decoded-trace cache


@pytest.fixture(autouse=True, scope="module")
def _own_trace_cache(tmp_path_factory):
    """This module's CSVs are cached in a folder of its own, not the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VARLEN_TRACE_CACHE", str(tmp_path_factory.mktemp("trace_cache")))
        yield


def _as_tuple(t):
    return [tuple(dataclasses.astuple(r)) for r in t.requests], t.stats.as_dict()


def test_cached_trace_loads_as_a_fresh_read_and_skips_the_parse(tmp_path, monkeypatch):
    import varlen.traces as traces
    from varlen.traces import named_trace_path

    monkeypatch.setenv("VARLEN_TRACE_CACHE", str(tmp_path / "cache"))
    options = [{}, {"limit": 500, "max_model_len": 2048}, {"rate": 3.0, "max_model_len": 4096,
                                                             "over_length": "drop"}]
    for n, (source, options) in enumerate(((AZURE_CODE, options), (named_trace_path("azure_conv"), options[1:2]))):
        monkeypatch.setenv("VARLEN_TRACE_CACHE", "off")
        fresh = [_as_tuple(load_trace(source, **o)) for o in options]
        assert len(list((tmp_path / "cache").glob("*"))) == n  # "off" wrote nothing
        monkeypatch.setenv("VARLEN_TRACE_CACHE", str(tmp_path / "cache"))
        assert [_as_tuple(load_trace(source, **o)) for o in options] == fresh  # the first writes the entry
        with monkeypatch.context() as m:
            m.setattr(traces.cache, "read_azure_csv", lambda path: pytest.fail("parsed again"))
            assert [_as_tuple(load_trace(source, **o)) for o in options] == fresh
    assert len(list((tmp_path / "cache").glob("azure-*.npz"))) == 2


def test_a_damaged_or_stale_cache_entry_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("VARLEN_TRACE_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "t.csv"
    p.write_text(AZ_HEADER + AZ_OK + "2023-11-16 18:15:48.0,20,4\n")
    first = _as_tuple(load_trace(p))
    (entry,) = (tmp_path / "cache").glob("azure-*.npz")
    entry.write_bytes(b"PK\x03\x04 not a whole archive")
    assert _as_tuple(load_trace(p)) == first
    p.write_text(AZ_HEADER + AZ_OK + "2023-11-16 18:15:48.0,21,4\n")  # the same size, another length
    assert load_trace(p).requests[1].prompt_len == 21
    p.write_text(AZ_HEADER + AZ_OK + "2023-11-16 18:15:48.0,-21,4\n")  # errors are never cached
    for _ in range(2):
        with pytest.raises(TraceFormatError, match="line 3: negative prompt length -21"):
            load_trace(p)
    assert len(list((tmp_path / "cache").glob("azure-*.npz"))) == 2


def test_a_forged_cache_entry_is_read_again_saying_so(tmp_path, monkeypatch, capsys):
    """A valid .npz with other columns (or another file's whole entry) under an entry's name is
    caught by the entry's digest: the source is read again, in one line on stderr, and cached anew."""
    monkeypatch.setenv("VARLEN_TRACE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(AZ_HEADER + AZ_OK + "2023-11-16 18:15:48.0,20,4\n")
    b.write_text(AZ_HEADER + AZ_OK + "2023-11-16 18:15:49.0,30,7\n")
    first = _as_tuple(load_trace(a))
    (entry_a,) = (tmp_path / "cache").glob("azure-*.npz")
    _as_tuple(load_trace(b))
    (entry_b,) = set((tmp_path / "cache").glob("azure-*.npz")) - {entry_a}
    capsys.readouterr()
    forgeries = {
        "other columns": lambda: np.savez(entry_a, arrival=np.array([0.0, 5.0]), prompt=np.array([1, 2], np.int64),
                                          output=np.array([3, 4], np.int64)),
        "another file's entry": lambda: entry_a.write_bytes(entry_b.read_bytes()),
    }
    for what, forge in forgeries.items():
        forge()
        assert _as_tuple(load_trace(a)) == first, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "does not match its digest" in err[0] and str(a) in err[0], (what, err)
        assert _as_tuple(load_trace(a)) == first  # cached anew: read without a word
        assert capsys.readouterr().err == ""


def test_a_cached_gzip_trace_under_a_plain_name_is_still_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VARLEN_TRACE_CACHE", str(tmp_path / "cache"))
    gz = tmp_path / "t.csv.gz"
    gz.write_bytes(gzip.compress((AZ_HEADER + AZ_OK).encode()))
    assert len(load_trace(gz)) == 1  # cached now
    plain = tmp_path / "t.csv"
    plain.write_bytes(gz.read_bytes())
    with pytest.raises(TraceFormatError, match="gzip-compressed data in a file named .csv"):
        load_trace(plain)


# ---------------------------------------------------------------------------------------------
# The workload config group, shared by varlen.run and sim.run


def _compose(root: str, name: str, overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import varlen.cli  # noqa: F401  (registers the configs' resolvers)
    from varlen.registry import conf_dir

    with initialize_config_dir(str(conf_dir(root)), version_base="1.3"):
        return OmegaConf.to_container(compose(name, overrides=overrides).workload)


def test_each_command_keeps_its_own_defaults_for_one_workload_group() -> None:
    run, sim = _compose("run", "config", ["workload=azure_conv"]), _compose("sim", "run", ["workload=azure_conv"])
    assert (run["limit"], run["replay"], "token_ids" in run) == (64, "arrivals", False)
    assert (sim["limit"], sim["token_ids"], "replay" in sim) == (None, False, False)
    assert _compose("sim", "run", ["workload=mooncake_conv"])["token_ids"] is True
    run, sim = _compose("run", "config", []), _compose("sim", "run", ["workload=synthetic"])
    assert (run["limit"], run["rate"], sim["limit"], sim["rate"]) == (32, 16.0, 1000, 4.0)


def test_workload_limit_and_rate_mean_the_same_for_every_source() -> None:
    from varlen.workload import load_workload

    synth = dict(source="synthetic", limit=7, rate=3.0, prompt_len="uniform:4:9", seed=5, over_length="clip")
    trace, _ = load_workload(synth)
    want = load_trace(SyntheticTrace(requests=7, rate=3.0, prompt_len="uniform:4:9", seed=5))
    assert _as_tuple(trace) == _as_tuple(want)
    trace, opts = load_workload(dict(source=str(AZURE_CONV), limit=20, rate=2.0, token_ids=True))
    assert (len(trace), trace.stats.mean_rate, opts) == (20, pytest.approx(2.0), {"token_ids": True})


@pytest.mark.parametrize("cfg, message", [
    (dict(source="synthetic", num_requests=5), "workload.num_requests was renamed to workload.limit"),
    (dict(source="azure_conv", target_rate=5.0), "workload.target_rate was renamed to workload.rate"),
    (dict(source=str(AZURE_CONV), prompt_len=64), "workload.prompt_len is not a setting of workload source"),
])
def test_a_workload_setting_that_cannot_apply_is_named(cfg, message) -> None:
    from varlen.workload import load_workload

    with pytest.raises(ValueError, match=message):
        load_workload(cfg)


@pytest.mark.parametrize("module, arg, line", [
    ("sim.run", "sim_workload=mooncake_conv", "error: sim_workload was renamed to workload: workload=mooncake_conv"),
    ("sim.capacity", "workload.target_rate=3", "error: workload.target_rate was renamed to workload.rate: "
                                               "workload.rate=3"),
    ("varlen.run", "workload.num_requests=5", "error: workload.num_requests was renamed to workload.limit: "
                                              "workload.limit=5"),
    ("sim.run", "workload=prompts", "error: workload=prompts is a prompt file, which only varlen.run serves"),
])
def test_old_names_and_a_workload_the_command_cannot_serve_fail_in_one_line(module, arg, line, tmp_path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", module, arg, f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(line), out.stderr
    assert not list(tmp_path.rglob("summary.json"))  # nothing ran
