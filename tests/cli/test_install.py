"""An installed varlen (a wheel, not this checkout) runs from any directory: the configs and the
public traces are package data, not paths relative to the source tree."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import varlen
from varlen.traces import NAMED_TRACES, default_traces_dir, load_trace, named_trace_path

ROOT = Path(__file__).resolve().parents[2]
# About 30 s of CPU in all (a wheel build, seven interpreters), minutes of wall time on a loaded
# machine: `slow`, which CI still runs (.ci/run selects every test).
wheel_test = pytest.mark.slow

# Each entry point, small: (module, arguments, a line its output must hold).
COMMANDS = [
    ("varlen.run", ["workload.limit=4", "progress=false"], "finished"),
    ("sim.run", ["workload.limit=40"], "finished"),  # its default trace, shipped gzipped
    ("sim.capacity", ["workload.limit=40", "slo.ttft_s=2", "slo.tpot_s=0.2", "capacity.rel_tol=0.5"], "capacity"),
    ("sim.search", ["workload.limit=30", "capacity.rel_tol=0.5", "search.hardware=[h100_sxm]", "search.tensor=[1]",
                    "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]"], "cheapest"),
    ("sim.explain", [], "attention"),
    ("varlen.demo", [], "max"),
]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of this checkout, installed without dependencies into a folder of its own; the
    test environment's packages (torch, hydra, ...) serve as the dependencies."""
    tmp = tmp_path_factory.mktemp("install")
    # Built from a copy of the tracked layout: setuptools' build/ folder in the checkout may hold
    # stale files that would travel into the wheel (and a build here leaves none behind).
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("varlen", "backends", "schedulers", "sim", "conf"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp / "wheel")],
                   cwd=src, check=True, capture_output=True, text=True)
    (wheel,) = (tmp / "wheel").glob("varlen-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True, text=True)
    return tmp / "site"


def installed_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VARLEN_TRACES_DIR")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    return env


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=installed_env(site), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def entry_points(installed, tmp_path_factory) -> dict[str, tuple[subprocess.Popen[str], Path]]:
    """All the commands started at once, each in an empty directory of its own (mostly they wait
    on imports: together they take about as long as the slowest)."""
    procs = {}
    for module, args, _ in COMMANDS:
        cwd = tmp_path_factory.mktemp(module.replace(".", "_"))
        procs[module] = (subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=installed_env(installed),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), cwd)
    yield procs
    for p, _ in procs.values():
        p.kill()
        p.communicate()


@wheel_test
def test_installed_packages_come_from_the_wheel(installed, tmp_path):
    code = ("import conf, sim, varlen, backends, schedulers\n"
            "from sim.run import CONF\nfrom sim.cost.hardware import hardware_dir\nfrom varlen.traces import default_traces_dir\n"
            "for x in (conf.__file__, sim.__file__, varlen.__file__, backends.__file__, schedulers.__file__, CONF, "
            "hardware_dir(), default_traces_dir()): print(x)")
    out = run_installed(installed, tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert len(paths) == 8 and all(p.startswith(str(installed)) for p in paths), paths
    # The commands' config roots are real folders in the wheel (setuptools copies the links).
    for root, groups in (("run", ["allocator", "backend", "model", "scheduler", "workload", "workload_defaults"]),
                         ("sim", ["allocator", "hardware", "hydra", "scheduler", "sim_model", "workload", "workload_defaults"])):
        assert sorted(p.name for p in (installed / "conf" / root).iterdir() if p.is_dir()) == groups
    assert sorted(p.name for p in (installed / "varlen" / "traces_data").iterdir()) == sorted(
        [f"{f}.gz" for f in NAMED_TRACES.values()] + ["README.md", "AzureLLMInferenceDataset2023.md",
                                                       "LICENSE-Apache-2.0.txt"])


@wheel_test
@pytest.mark.parametrize("module,expect", [(c[0], c[2]) for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_entry_point_runs_from_another_directory(entry_points, module, expect):
    proc, cwd = entry_points[module]
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{module}: rc={proc.returncode}\n{out[-3000:]}"
    assert expect in out, out[-2000:]
    assert not (cwd / "conf").exists()  # nothing read from, or written as, a source tree here


@wheel_test
def test_help_of_an_installed_command_lists_only_its_groups(installed, tmp_path):
    # A Hydra project's own conf/ folder (no __init__.py) in the working directory, which
    # `python -m` puts first on sys.path, must not stand in for the installed configs.
    (tmp_path / "conf" / "run").mkdir(parents=True)
    (tmp_path / "conf" / "run" / "config.yaml").write_text("defaults:\n  - hardware: nothing_here\n")
    out = run_installed(installed, tmp_path, "-m", "varlen.run", "--help")
    groups = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert out.returncode == 0 and "scheduler:" in groups and "hardware:" not in groups and "sim_model:" not in groups


def test_named_traces_ship_gzipped_with_their_licences(monkeypatch) -> None:
    """The public traces travel with the package (no sibling folder needed), compressed, with
    the licence and attribution of each."""
    monkeypatch.delenv("VARLEN_TRACES_DIR", raising=False)
    d = default_traces_dir()
    assert d == Path(varlen.__file__).parent / "traces_data"
    for name, file in NAMED_TRACES.items():
        assert named_trace_path(name) == d / f"{file}.gz" and gzip.open(d / f"{file}.gz").read(1)
    readme = (d / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "Splitwise" in readme and "Apache-2.0" in readme and "Mooncake" in readme
    assert "Apache License" in (d / "LICENSE-Apache-2.0.txt").read_text()
    assert "CC-BY" in (d / "AzureLLMInferenceDataset2023.md").read_text()


def test_traces_dir_override_reads_plain_files_and_does_not_fall_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARLEN_TRACES_DIR", str(tmp_path))
    (tmp_path / NAMED_TRACES["azure_code"]).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                       "2023-11-16 18:15:46.6805900,374,44\n")
    assert len(load_trace("azure_code")) == 1
    with pytest.raises(FileNotFoundError, match="azure_conv"):  # not silently the shipped one
        load_trace("azure_conv")


def test_trace_files_are_located_in_one_place() -> None:
    """Shipped traces are gzipped: code that joins a plain file name onto the traces folder finds
    nothing and falls back or stops (benchmarks did, after the traces moved into the package).
    Only varlen/traces/load.py (named_trace_path) may spell out where a named trace lies."""
    offenders = []
    for path in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("sim/**/*.py"), *ROOT.glob("varlen/**/*.py"),
                 *ROOT.glob("tests/**/*.py")]:
        if (path.name == "load.py" and path.parent.name == "traces") or path.name == "test_install.py":
            continue  # the one place, and this file's tests of the shipped data
        text = path.read_text()
        if "default_traces_dir() /" in text or any(f'"{f}"' in text for f in NAMED_TRACES.values()):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"locate named traces with varlen.traces.named_trace_path: {offenders}"
