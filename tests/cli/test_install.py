"""An installed varlen (a wheel, or an editable install of this checkout) runs from any directory,
one holding a `conf/` folder of its own included: the configs are the package `varlen.conf` and
the public traces package data, not paths relative to the source tree."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import varlen
from varlen.traces import NAMED_TRACES, default_traces_dir, load_trace, named_trace_path

ROOT = Path(__file__).resolve().parents[2]
# About 60 s of CPU in all (a wheel build, an editable install, the commands twice), minutes of
# wall time on a loaded machine: `slow`, which CI still runs (.ci/run selects every test).
wheel_test = pytest.mark.slow

# Each entry point, small: (module, arguments, a line its output must hold).
COMMANDS = [
    ("varlen.run", ["workload.limit=4", "progress=false"], "finished"),
    ("sim.run", ["workload.limit=40"], "finished"),  # its default trace, shipped gzipped
    ("sim.capacity", ["workload.limit=40", "slo.ttft_s=2", "slo.tpot_s=0.2", "capacity.rel_tol=0.5"], "capacity"),
    ("sim.search", ["workload.limit=30", "capacity.rel_tol=0.5", "search.hardware=[h100_sxm]", "search.tensor=[1]",
                    "search.scheduler=[chunked]", "search.max_num_batched_tokens=[512]"], "cheapest"),
    ("sim.explain", [], "attention"),
    ("sim.profile", ["--help"], "usage"),
    ("varlen.demo", [], "max"),
]


@dataclass(frozen=True)
class Install:
    kind: str  # "wheel" or "editable"
    python: str
    env: dict[str, str]
    root: Path  # where its packages' files lie


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VARLEN_TRACES_DIR", "VARLEN_CONFIG_PATH")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def source_copy(src: Path) -> Path:
    """A copy of the tracked layout: setuptools' build/ folder in the checkout may hold stale files
    that would travel into a wheel (and a build there leaves none behind)."""
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("varlen", "backends", "schedulers", "sim", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return src


# The C sources built at first use and the headers they include (varlen/c_build.py): none may be
# missing from a wheel or an sdist (a missing header only shows as a failed build on a user's machine).
C_FILES = sorted(str(p.relative_to(ROOT)) for d in ("varlen/csrc", "backends/csrc") for p in (ROOT / d).iterdir()
                 if p.suffix in (".c", ".h"))


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, tmp_path_factory) -> Install:
    """This checkout installed without dependencies (the test environment's torch, hydra, ...
    serve): a wheel into a folder of its own, or editable into a venv that sees the environment's
    packages (its own varlen first)."""
    tmp = tmp_path_factory.mktemp(request.param)
    src = source_copy(tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if request.param == "editable":
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp / "venv")],
                       check=True, capture_output=True, text=True)
        python = str(tmp / "venv" / "bin" / "python")
        subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-build-isolation", "-e", str(src)],
                       check=True, capture_output=True, text=True)
        return Install("editable", python, _env(), src)
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp / "wheel")],
                   cwd=src, check=True, capture_output=True, text=True)
    (wheel,) = (tmp / "wheel").glob("varlen-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True, text=True)
    return Install("wheel", sys.executable, _env(PYTHONPATH=str(tmp / "site")), tmp / "site")


def run_installed(inst: Install, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([inst.python, *args], cwd=cwd, env=inst.env, capture_output=True, text=True, timeout=300)


def users_conf(cwd: Path, module: str = "varlen.run") -> Path:
    """A Hydra project's own conf/ (here even a Python package, with configs named like varlen's)
    in the working directory, which `python -m` puts first on sys.path; and bare folders named like
    the framework's other packages (not the command's own: README, installing)."""
    for name in {"backends", "schedulers", "sim"} - {module.split(".")[0]}:
        (cwd / name).mkdir()
    for name in ("run", "sim"):
        (cwd / "conf" / name).mkdir(parents=True)
        (cwd / "conf" / name / f"{'config' if name == 'run' else 'run'}.yaml").write_text(
            "defaults:\n  - hardware: nothing_here\n")
    (cwd / "conf" / "__init__.py").write_text("raise ImportError('the user conf/ package was imported')\n")
    return cwd / "conf"


@pytest.fixture(scope="module")
def entry_points(installed, tmp_path_factory) -> dict[str, tuple[subprocess.Popen[str], Path]]:
    """All the commands started at once, each in a directory of its own holding a user's conf/
    (mostly they wait on imports: together they take about as long as the slowest)."""
    procs = {}
    for module, args, _ in COMMANDS:
        cwd = tmp_path_factory.mktemp(module.replace(".", "_"))
        users_conf(cwd, module)
        procs[module] = (subprocess.Popen([installed.python, "-m", module, *args], cwd=cwd, env=installed.env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), cwd)
    yield procs
    for p, _ in procs.values():
        p.kill()
        p.communicate()


@wheel_test
def test_installed_packages_come_from_the_install(installed, tmp_path):
    users_conf(tmp_path)
    code = ("import varlen, varlen.conf, sim, backends, schedulers\n"  # varlen first: README, installing
            "from sim.run import CONF\nfrom sim.cost.hardware import hardware_dir\n"
            "from varlen.traces import default_traces_dir\n"
            "for x in (varlen.conf.__file__, sim.__file__, varlen.__file__, backends.__file__, schedulers.__file__, CONF, "
            "hardware_dir(), default_traces_dir()): print(x)")
    out = run_installed(installed, tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert len(paths) == 8 and all(p.startswith(str(installed.root)) for p in paths), paths
    conf = Path(paths[0]).parent
    assert conf == installed.root / ("varlen/conf" if installed.kind == "wheel" else "conf")
    # Each group once, found on the commands' search path: the commands' roots hold no copies.
    assert {"allocator", "backend", "hardware", "model", "scheduler", "workload"} <= {p.name for p in conf.iterdir()}
    assert sorted(p.name for p in (conf / "run").iterdir()) == ["config.yaml", "serve.yaml", "workload_defaults"]
    assert sorted(p.name for p in (conf / "sim").iterdir() if p.is_dir()) == ["hydra", "workload_defaults"]
    if installed.kind == "wheel":  # no generic top-level `conf`; Hydra's plug-in namespace
        assert sorted(p.name for p in installed.root.iterdir() if not p.name.endswith(".dist-info")) == [
            "backends", "hydra_plugins", "schedulers", "sim", "varlen"]
        assert sorted(p.name for p in (installed.root / "varlen" / "traces_data").iterdir()) == sorted(
            [f"{f}.gz" for f in NAMED_TRACES.values()] + ["README.md", "AzureLLMInferenceDataset2023.md",
                                                           "LICENSE-Apache-2.0.txt"])


@wheel_test
def test_installed_c_kernels_build_from_the_installed_files(installed, tmp_path, unoptimised_cc):
    """Both C kernels compile from the installed package, with the header they share: it is on the
    include path (varlen/c_build.py) and in the package data. (At -O0: which files a build finds,
    not the code it makes; paged_attention.c takes ~15 CPU s at -O3.)"""
    assert [f for f in C_FILES if not (installed.root / f).is_file()] == []
    code = ("import backends.torch_paged as tp, varlen.layer_kernels as lk\n"
            "for m in (tp, lk): print(m.SOURCE); print(m.build())")
    env = {**installed.env, "VARLEN_CACHE_DIR": str(tmp_path / "cache"), "CC": unoptimised_cc}
    out = run_installed(Install(installed.kind, installed.python, env, installed.root), tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    sources, libs = out.stdout.split()[::2], out.stdout.split()[1::2]
    assert all(s.startswith(str(installed.root)) for s in sources), sources
    assert all(lib.startswith(str(tmp_path / "cache")) and Path(lib).is_file() for lib in libs), libs


@wheel_test
def test_sdist_holds_the_c_sources_and_their_headers(tmp_path):
    src = source_copy(tmp_path / "src")
    code = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    build = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    with tarfile.open(src / "dist" / build.stdout.split()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert [f for f in C_FILES if f not in names] == []


@wheel_test
@pytest.mark.parametrize("module,expect", [(c[0], c[2]) for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_entry_point_runs_from_a_directory_holding_conf(entry_points, module, expect):
    proc, cwd = entry_points[module]
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{module}: rc={proc.returncode}\n{out[-3000:]}"
    assert expect in out and "user conf/ package" not in out, out[-2000:]
    assert sorted(p.name for p in (cwd / "conf").iterdir()) == ["__init__.py", "run", "sim"]  # read, not written
    assert not [p for name in ("backends", "schedulers", "sim") if (cwd / name).is_dir() for p in (cwd / name).iterdir()]


@wheel_test
def test_help_of_an_installed_command_lists_only_its_groups(installed, tmp_path):
    users_conf(tmp_path)
    for module, own in (("varlen.run", "scheduler:"), ("sim.run", "hardware:")):
        out = run_installed(installed, tmp_path, "-m", module, "--help")
        groups = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
        assert out.returncode == 0 and own in groups and "chunked" in groups, out.stdout + out.stderr
        assert ("hardware:" in groups) == (module == "sim.run") and ("backend:" in groups) == (module == "varlen.run")


@wheel_test
def test_user_config_folders_work_installed(installed, tmp_path):
    """VARLEN_CONFIG_PATH adds a user's names next to the shipped ones (pkg://varlen.conf)."""
    mine = tmp_path / "mine"
    (mine / "scheduler").mkdir(parents=True)
    (mine / "scheduler" / "my_fifo.yaml").write_text("_target_: schedulers.continuous.ContinuousPolicy\n")
    inst = Install(installed.kind, installed.python, {**installed.env, "VARLEN_CONFIG_PATH": str(mine)}, installed.root)
    out = run_installed(inst, tmp_path, "-m", "sim.run", "--help")
    assert out.returncode == 0 and "my_fifo" in out.stdout.split("== Config ==")[0], out.stdout + out.stderr


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
