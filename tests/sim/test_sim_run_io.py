"""sim.run's shortcuts for a fast whole-trace run. Hydra's composition only to read hydra.mode
is skipped when nothing on the command line can set hydra.mode, and kept otherwise (what Hydra
would have found there is None for this command's config, so skipping it changes nothing).
write_csv writes what DataFrame.to_csv(index=False) writes, byte for byte, with orjson (its fast
number writer) and without it."""

import math

import numpy as np
import pandas as pd
import pytest
from hydra import initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.run as sim_run


@pytest.fixture(params=["orjson", "repr"])
def number_writer(request, monkeypatch):
    """write_csv's numbers by orjson where it is installed, and by repr/str as without it."""
    if request.param == "orjson":
        pytest.importorskip("orjson", reason="orjson is not installed: numbers are written by repr only")
    else:
        monkeypatch.setattr(sim_run, "_ORJSON", None)
    return request.param


@pytest.fixture
def restore_get_mode():
    orig = Hydra.get_mode
    yield orig
    Hydra.get_mode = orig


@pytest.mark.parametrize("args, skipped", [
    ([], True),
    (["hydra.run.dir=/tmp/x", "-m", "scheduler=static,chunked", "workload.rate=1"], True),
    (["hydra.mode=RUN"], False),
    (["hydra/launcher=basic"], False),
    (["+hydra.foo=1"], False),
    (["-cd", "/elsewhere"], False),
    (["--config-name", "other"], False),
])
def test_mode_probe_skipped_only_when_nothing_can_set_it(restore_get_mode, args, skipped):
    sim_run._skip_mode_probe(["sim.run", *args])
    assert (Hydra.get_mode is not restore_get_mode) == skipped


def test_the_probe_would_find_no_mode(restore_get_mode):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        h = GlobalHydra.instance().hydra
        assert h.get_mode("sim", []) is None
        assert h.get_mode("sim", ["scheduler=static,chunked"]) is None


def _frames():
    yield pd.DataFrame({
        "f": [0.1, math.nan, -0.0, 1e16, 1e-5, math.inf, 123456789.123, 2.0, 1 / 3],
        "i": list(range(-4, 5)),
        "s": ["a,b", None, 'q"x', "", "line\nbreak", "x", math.nan, "z", " "],
        "o": pd.Series(["a", None, "b", "c", "d", "e", "f", "g", 1], dtype=object),
        "ns": pd.Series(["a", pd.NA, "b", "c", "d", "e", "f", "g", "h"], dtype="string"),
    })
    yield pd.DataFrame({"b": [True, False], "f": [1.5, 2.5]})  # left to pandas
    # float32: left to pandas, which writes its own repr
    yield pd.DataFrame({"f32": np.array([1e16, 0.1, 123456789.123], np.float32), "f": [1e-5, 0.5, 2.0]})
    yield pd.DataFrame({"f": pd.Series([], dtype=float), "s": pd.Series([], dtype=object)})


@pytest.mark.parametrize("df", list(_frames()))
def test_write_csv_is_to_csv(tmp_path, df, number_writer):
    df.to_csv(tmp_path / "pandas.csv", index=False)
    sim_run.write_csv(df, tmp_path / "ours.csv")
    assert (tmp_path / "ours.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


def _mappings():
    """Tables as sim.run hands them to write_csv: columns as numpy arrays and lists."""
    nan = math.nan
    yield {"f": np.array([0.1, nan, -0.0, 1e16, 1e-5, math.inf, 123456789.123, 2.0, 1 / 3]),
           "i": np.arange(-4, 5), "fl": [0.5, nan, 3.0, 1e-7, 2.0, 0.0, -1.5, 7.25, nan],
           "il": list(range(9)), "s": ["a,b", None, 'q"x', "", "line\nbreak", "x", nan, "z", " "],
           "none": [None] * 9, "b": np.array([True, False] * 4 + [True])}
    yield {"mixed": [1, None, 3], "f": [1.0, 2.0, 3.0]}  # numbers with None: pandas makes floats
    yield {"text_and_numbers": ["a", 1, 2.5], "i": [1, 2, 3]}  # left to pandas
    yield {"f": np.array([], np.float64), "s": []}
    yield {"s": ["", None, "a,b", "x"]}  # one column: a lone empty field is quoted
    yield {"s": ["cr\rhere", 'only"quote', "plain", "tab\there"], "i": [1, 2, 3, 4]}
    yield {"s": ["plain", "", "x y"], "t": ["a", "b", "c"], "i": [1, 2, 3]}  # only text: no array made of it
    # Neighbouring number columns of a kind, written as blocks of rows (a row with NaN, inf or a number
    # in exponent notation written by repr), as requests.csv's are.
    yield {"id": ["a", "b", "c", "d"], "i1": np.array([1, -2, 3, 2 ** 62]), "i2": np.array([4, 5, 6, 7], np.int32),
           "f1": np.array([0.1, nan, 1e-5, 2.5]), "f2": np.array([1 / 3, math.inf, 0.0, -0.0]),
           "f3": np.array([1e16, 7.0, 123456789.123, 1e-4]), "u1": np.array([1, 2, 3, 2 ** 64 - 1], np.uint64),
           "u2": np.array([0, 9, 8, 7], np.uint8), "b": np.array([True, False, True, True])}
    yield {"f1": np.array([0.5]), "f2": np.array([nan]), "i1": np.array([3]), "i2": np.array([-3])}  # one row
    yield {"f32": np.array([1e16, 0.1, 123456789.123], np.float32), "f": np.array([1e-5, 0.5, 2.0])}  # left to pandas
    yield {"f1": np.array([], np.float64), "f2": np.array([], np.float64), "i": np.array([], np.int64)}


@pytest.mark.parametrize("table", list(_mappings()))
def test_write_csv_of_columns_is_to_csv(tmp_path, table, number_writer):
    pd.DataFrame(table).to_csv(tmp_path / "pandas.csv", index=False)
    sim_run.write_csv(table, tmp_path / "ours.csv")
    assert (tmp_path / "ours.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


EDGES = [0.0, -0.0, 1e-4, -1e-4, float(np.nextafter(1e-4, 0)), 1e16, float(np.nextafter(1e16, 0)), -1e16, 5e-324,
         1.7976931348623157e308, 2.0 ** 53, 2.0 ** 53 + 2, 0.1, 1 / 3, 123456789.123, math.nan, math.inf, -math.inf]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(EDGES), max_size=60))
def test_float_texts_are_repr(xs):
    """Each number as repr writes it (orjson's digits and repr's notation), also from float32/float16
    and strided arrays; the same where orjson is not installed."""
    a = np.array(xs + EDGES, np.float64)
    assert sim_run.float_texts(a) == list(map(repr, a.tolist()))
    assert sim_run.float_texts(a[::2]) == list(map(repr, a[::2].tolist()))
    with np.errstate(over="ignore"):
        for dtype in (np.float32, np.float16):
            b = a.astype(dtype)
            assert sim_run.float_texts(b) == list(map(repr, b.tolist()))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=40), st.lists(st.integers(0, 2 ** 64 - 1), max_size=40))
def test_int_texts_are_str(signed, unsigned):
    for a in (np.array(signed + [0, -1], np.int64), np.array(unsigned + [0, 2 ** 64 - 1], np.uint64),
              np.array(signed, np.int64).astype(np.int32), np.array(unsigned, np.uint64).astype(np.uint8)):
        assert sim_run.int_texts(a) == list(map(str, a.tolist()))


def test_an_orjson_writing_otherwise_than_repr_is_not_used(monkeypatch, tmp_path):
    """A version of orjson whose notation differs (here: exponents from 1e15) is left unused."""
    import sys
    import types

    real = pytest.importorskip("orjson", reason="orjson is not installed")
    def dumps(a, option=0):
        return real.dumps(a, option=option).replace(b"1000000000000000.0", b"1e15")

    fake = types.SimpleNamespace(OPT_SERIALIZE_NUMPY=real.OPT_SERIALIZE_NUMPY, dumps=dumps)
    monkeypatch.setitem(sys.modules, "orjson", fake)
    monkeypatch.setattr(sim_run, "_ORJSON", False)
    assert sim_run._orjson() is None
    a = np.array([1e15, 0.5])
    assert sim_run.float_texts(a) == ["1000000000000000.0", "0.5"]
    monkeypatch.setattr(sim_run, "_ORJSON", False)
    monkeypatch.setitem(sys.modules, "orjson", real)
    assert sim_run._orjson() is real


def test_write_csv_refuses_columns_of_different_lengths(tmp_path):
    with pytest.raises(ValueError, match="different lengths.*a: 2, b: 3"):
        sim_run.write_csv({"a": [1, 2], "b": [1.0, 2.0, 3.0]}, tmp_path / "x.csv")


@pytest.mark.parametrize("args, collecting", [(["--help"], False), (["-m", "--help"], True)])
def test_single_run_starts_without_the_collector_and_a_sweep_with_it(args, collecting):
    """`python -m sim.run` turns the cyclic collector off while it imports and Hydra composes (main
    turns it on again; --help never reaches main); a sweep, whose jobs may share the process, keeps it."""
    import subprocess
    import sys

    code = ("import gc, runpy, sys\nsys.argv = ['sim.run', *sys.argv[1:]]\ntry:\n"
            "    runpy.run_module('sim.run', run_name='__main__', alter_sys=True)\nexcept SystemExit:\n    pass\n"
            "print('collecting', gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"collecting {collecting}"
