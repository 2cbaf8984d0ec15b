"""sim.run's shortcuts for a fast whole-trace run. Hydra's composition only to read hydra.mode
is skipped when nothing on the command line can set hydra.mode, and kept otherwise (what Hydra
would have found there is None for this command's config, so skipping it changes nothing).
write_csv writes what DataFrame.to_csv(index=False) writes, byte for byte."""

import math

import numpy as np
import pandas as pd
import pytest
from hydra import initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra

import sim.run as sim_run


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
    yield pd.DataFrame({"f": pd.Series([], dtype=float), "s": pd.Series([], dtype=object)})


@pytest.mark.parametrize("df", list(_frames()))
def test_write_csv_is_to_csv(tmp_path, df):
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


@pytest.mark.parametrize("table", list(_mappings()))
def test_write_csv_of_columns_is_to_csv(tmp_path, table):
    pd.DataFrame(table).to_csv(tmp_path / "pandas.csv", index=False)
    sim_run.write_csv(table, tmp_path / "ours.csv")
    assert (tmp_path / "ours.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


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
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"collecting {collecting}"
