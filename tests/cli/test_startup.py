"""`python -m sim.run` starts faster without changing what it reads or writes: yaml through libyaml's
C parser and emitter with OmegaConf's own loader and representer rules, and no Ray launcher import
for a single run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf, _utils

from sim import run as sim_run
from varlen.registry import conf_dir

ROOT = Path(__file__).resolve().parents[2]
needs_libyaml = pytest.mark.skipif(not getattr(yaml, "__with_libyaml__", False),
                                   reason="PyYAML built without libyaml: the Python parser stays")


@needs_libyaml
def test_every_shipped_yaml_reads_the_same_through_libyaml(monkeypatch, tmp_path):
    files = sorted(Path(conf_dir()).rglob("*.yaml"))
    assert len(files) > 40
    python = [OmegaConf.to_container(OmegaConf.load(f)) for f in files]
    monkeypatch.setattr(_utils, "get_yaml_loader", _utils.get_yaml_loader)  # restored after the test
    monkeypatch.setattr(OmegaConf, "to_yaml", OmegaConf.to_yaml)  # the loader's call patches the writer too
    sim_run._libyaml_loader()
    assert getattr(_utils.get_yaml_loader(), "__module__", None) == "sim.run"
    assert [OmegaConf.to_container(OmegaConf.load(f)) for f in files] == python
    # OmegaConf's own rules: 1e-3 a float, a date a string, a duplicate key refused.
    odd = tmp_path / "odd.yaml"
    odd.write_text("a: 1e-3\nb: 2001-12-14\nc: ${a}\n")
    assert OmegaConf.to_container(OmegaConf.load(odd)) == {"a": 0.001, "b": "2001-12-14", "c": "${a}"}
    odd.write_text("a: 1\na: 2\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="found duplicate key a"):
        OmegaConf.load(odd)


@needs_libyaml
def test_configs_are_written_as_pyyaml_writes_them(monkeypatch):
    files = sorted(Path(conf_dir()).rglob("*.yaml"))
    odd = {"s": "a: b", "yes": "yes", "n": "1e3", "u": "héllo ✓", "emoji": "\U0001F600", "long": "x " * 300,
           "ml": "a  \n  b\n\n", "ctrl": "a\x07\x00b\x1b", "cr": "a\r\nb", "q": "it's \"q\"", "e": "", "none": None,
           "f": [1.5, float("inf"), -0.0, 10**30], "k" * 200: {"1": 2, "a b": [None, True]}, "bytes": b"\x00\xff"}
    configs = [OmegaConf.load(f) for f in files] + [OmegaConf.create(odd), OmegaConf.create({"x": "\U0001F600"})]
    monkeypatch.setattr(OmegaConf, "to_yaml", OmegaConf.to_yaml)  # restored after the test
    to_yaml = getattr(OmegaConf.to_yaml, "pyyaml", OmegaConf.to_yaml)  # OmegaConf's own, whatever ran before
    python = [to_yaml(c) for c in configs] + [to_yaml(configs[0], resolve=True, sort_keys=True)]
    monkeypatch.setattr(OmegaConf, "to_yaml", staticmethod(to_yaml))
    sim_run._libyaml_dumper()
    assert getattr(OmegaConf.to_yaml, "libyaml", False)
    assert [OmegaConf.to_yaml(c) for c in configs] + [OmegaConf.to_yaml(configs[0], resolve=True, sort_keys=True)] \
        == python


def _plugins_after(argv: list[str]) -> set[str]:
    code = ("import sys; from sim import run; run._skip_unused_launchers(sys.argv); "
            "from hydra.core.plugins import Plugins; Plugins.instance(); "
            "print(' '.join(m for m in sys.modules if m.startswith('hydra_plugins.')))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return set(out.stdout.split())


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="the Ray launcher plug-in is not installed (the cluster extra)")
def test_a_single_run_leaves_the_ray_launcher_out_of_hydras_plugin_scan():
    single = _plugins_after(["workload.limit=5"])
    assert "hydra_plugins.hydra_ray_launcher.ray_launcher" not in single
    assert "hydra_plugins.hydra_joblib_launcher.joblib_launcher" in single  # sim.yaml's launcher config
    for argv in (["-m", "workload.limit=5"], ["hydra/launcher=ray"], ["--info", "plugins"]):
        assert "hydra_plugins.hydra_ray_launcher.ray_launcher" in _plugins_after(argv), argv



def _modules_after_run(tmp_path: Path, overrides: list[str]) -> set[str]:
    """Every module a `python -m sim.run` imported (-X importtime lists each on stderr; the command
    ends by os._exit, so nothing can be asked of it at exit)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "sim.run", f"hydra.run.dir={tmp_path}",
                          "progress.enabled=false", *overrides], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and (tmp_path / "summary.json").exists(), out.stderr[-2000:]
    return {ln.rsplit("|", 1)[1].strip() for ln in out.stderr.splitlines() if ln.startswith("import time:")}


def test_a_single_run_imports_neither_numpy_ma_nor_sim_cells(tmp_path):
    # enough steps that kv_usage.csv is thinned to kv_points (its de-duplication of the kept steps)
    mods = _modules_after_run(tmp_path / "one", ["workload.limit=300", "output.kv_points=50"])
    assert "varlen.metrics" in mods and "numpy" in mods  # the list is whole (sim.run itself runs as __main__)
    assert "numpy.ma" not in mods and "sim.cells" not in mods
    assert "sim.cells" in _modules_after_run(tmp_path / "two", ["workload.limit=20", "cluster.cells=2"])
