"""The mypyc-compiled scheduling core (varlen/compiled.py) decides exactly as the pure-Python one.

Each simulation runs in two fresh interpreters, one with the compiled core and one with
VARLEN_PURE=1, and every request's token times, finish and preemptions, and the summary, must
be identical. When no build exists for these sources the comparison is skipped with the reason
(`python -m varlen.compile` builds one; scripts/setup.sh does, so CI runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import varlen.compiled as compiled
from varlen.promises import PromiseWarning

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"

# Prints, as JSON, the core in use and a fingerprint of one simulation per configuration.
SCRIPT = r"""
import json, sys
from hydra import compose, initialize_config_dir
import varlen.compiled, varlen.engine, varlen.scheduler_api, sim.simulator
from sim.run import CONF, simulate_config

out = {"status": varlen.compiled.status(),
       "files": [m.__file__ for m in (varlen.engine, varlen.scheduler_api, sim.simulator)], "runs": []}
for overrides in json.loads(sys.argv[1]):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=overrides)
    res, row = simulate_config(cfg)
    row = {k: v for k, v in row.items() if "wall" not in k}
    reqs = [(r.req_id, r.token_times, r.finish_reason.value, r.finish_time, r.num_preemptions,
             r.num_prefix_hit_tokens) for r in res.requests]
    out["runs"].append({"row": row, "requests": reqs, "steps": len(res.steps)})
print(json.dumps(out))
"""

# output.token_times: the Request objects (their token times) kept for the fingerprint.
SMALL = ["output.requests=false", "workload.limit=150", "output.token_times=true"]
CONFIGS = [
    # chunked prefill, paged with prefix caching, Mooncake's shared blocks, a pool small enough to preempt
    ["scheduler=chunked", "allocator=paged", "workload=mooncake_conv", f"workload.source={DATA / 'mooncake_conv_small.jsonl'}",
     "engine.num_blocks=600", "workload.rate=2", *SMALL],
    ["scheduler=continuous", "allocator=paged", "allocator.enable_prefix_caching=false", "workload=azure_conv",
     f"workload.source={DATA / 'azure_conv_small.csv'}", "engine.num_blocks=300", "workload.rate=8", *SMALL],
    ["scheduler=static", "allocator=contiguous", "workload=azure_conv",
     f"workload.source={DATA / 'azure_conv_small.csv'}", "workload.rate=4", *SMALL],
    ["scheduler=priority", "workload=synthetic", "workload.rate=6", "cluster.replicas=2",
     "cluster.router=least_outstanding", *SMALL],
]


def run_sim(pure: bool, **env_extra: str) -> dict:
    env = {**os.environ, "VARLEN_PURE": "1" if pure else "", **env_extra}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIGS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_user_classes_subclass_every_shipped_plug_in():
    # A researcher's first move is to subclass a shipped policy, allocator or cost model; the
    # compiled core must allow it (mypyc refuses interpreted subclasses unless told, and only
    # says so when the subclass is instantiated). Runs under whichever core this process got:
    # in CI, the compiled one.
    from varlen import registry
    from sim.cost.fitted import ProfiledCostModel
    from sim.cost.replay import ReplayCostModel
    from sim.cost.roofline import RooflineCostModel
    from sim.executor import CostModelExecutor
    from sim.fast_forward import FastForwardEngine
    from sim.simulator import simulate
    from varlen.clock import SimClock
    from varlen.kv import ContiguousAllocator, PagedAllocator
    from varlen.sampling_params import SamplingParams
    from varlen.traces import SyntheticTrace, load_trace
    from varlen.workload import trace_requests

    for cls in map(registry.target, ["scheduler"] * 99, registry.names("scheduler")):
        type("Mine", (cls,), {})()
    type("Mine", (PagedAllocator,), {})(16, 4)
    type("Mine", (ContiguousAllocator,), {})(16, 4, 64)
    type("Mine", (RooflineCostModel,), {})()
    type("Mine", (ProfiledCostModel,), {})()
    type("Mine", (ReplayCostModel,), {})([0.1])

    seen = []

    class ShortestFirst(registry.target("scheduler", "chunked")):  # a user policy: admit the shortest prompt first
        def waiting_order(self):
            seen.append(len(self.waiting))
            return sorted(self.waiting, key=lambda r: (r.num_prompt_tokens, r.arrival))

    class CountingPaged(PagedAllocator):
        frees = 0

        def free(self, req):
            type(self).frees += 1
            super().free(req)

    class MyEngine(FastForwardEngine):  # the simulator's engine, subclassed as the real one may be
        pass

    class MyExecutor(CostModelExecutor):
        pass

    def make_engine(clock: SimClock):
        exe = MyExecutor(RooflineCostModel(), clock)
        return MyEngine(ShortestFirst(max_num_seqs=4, max_num_batched_tokens=64), CountingPaged(64, 16), exe,
                        clock, max_model_len=512), exe

    tr = load_trace(SyntheticTrace(requests=30, rate=1e5, prompt_len="uniform:8:200",
                                   output_len="uniform:1:20", seed=3), max_model_len=512)
    reqs = trace_requests(tr, 512, SamplingParams(ignore_eos=True), token_ids=True)
    # Its waiting_order breaks the decode promise ChunkedPolicy declares: said once, steps run one by one.
    with pytest.warns(PromiseWarning, match="ShortestFirst.waiting_order"):
        res = simulate(reqs, make_engine)
    assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in res.requests)
    assert max(seen) > 1  # the override decided among several waiting requests
    assert CountingPaged.frees >= len(reqs)


def test_every_core_package_looks_in_the_build_first():
    """PACKAGES comes from MODULES; each one's __init__ must put the build's folder on its path, or
    its compiled modules would never be imported (silently pure)."""
    assert set(compiled.PACKAGES) == {".".join(Path(m).parent.parts) for m in compiled.MODULES}
    every = [rel for mods in compiled.GROUPS.values() for rel in mods]
    for rel in every:
        assert (REPO / rel).is_file(), rel
    for pkg in {".".join(Path(m).parent.parts) for m in every}:
        init = (REPO.joinpath(*pkg.split(".")) / "__init__.py").read_text()
        assert "__path__ = package_path(__name__, __path__)" in init, pkg


# Request's constructor takes numpy scalars where ints and floats go (traces and user code hold
# them) and refuses the rest with one line; compiled, a field would otherwise raise TypeError.
BOUNDARY = r"""
import json, numpy as np
import varlen.compiled, varlen.request
from varlen.request import Request
r = Request("a", np.arange(3), priority=np.int64(2), arrival=np.float32(0.5), expected_output_len=np.int32(7))
errors = []
for kw in (dict(priority=1.5), dict(priority=np.bool_(True)), dict(arrival="soon"), dict(expected_output_len=-1)):
    try:
        Request("b", [1], **kw)
    except ValueError as e:
        errors.append(str(e))
print(json.dumps({"status": varlen.compiled.status(), "file": varlen.request.__file__,
                  "values": [r.priority, r.arrival, r.expected_output_len],
                  "types": [type(x).__name__ for x in (r.priority, r.arrival, r.expected_output_len)],
                  "errors": errors}))
"""


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_numpy_numbers_are_converted_at_the_request_boundary(core):
    if core == "compiled" and not compiled.is_compiled():
        pytest.skip(f"no compiled core: {compiled.status()}")
    proc = subprocess.run([sys.executable, "-c", BOUNDARY], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "VARLEN_PURE": "1" if core == "pure" else ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["status"].startswith(core) and out["file"].endswith(".so" if core == "compiled" else ".py"), out
    assert out["values"] == [2, 0.5, 7] and out["types"] == ["int", "float", "int"]
    assert out["errors"] == ["request 'b': priority=1.5: must be an integer (lower runs first)",
                             "request 'b': priority=np.True_: must be an integer (lower runs first)",
                             "request 'b': arrival='soon': must be a time in seconds (0 = now)",
                             "request 'b': expected_output_len=-1: must be None or an integer >= 0"]


ABC_CACHES = """
import importlib, json, sys
importlib.import_module(sys.argv[1])  # what is imported first decides which modules load which
import varlen.compiled
from schedulers import ChunkedPolicy
from varlen.kv import ContiguousAllocator, KVAllocator, PagedAllocator
from varlen.scheduler_api import SchedulerPolicy

shared = []
for name in sorted(varlen.compiled.MODULE_NAMES):
    for obj in vars(importlib.import_module(name)).values():
        if isinstance(obj, type) and hasattr(obj, "_abc_impl") and obj.__module__ == name:
            shared += [f"{name}.{obj.__name__}" for b in obj.__mro__[1:] if getattr(b, "_abc_impl", None) is obj._abc_impl]
# Answers that leaked between classes when the caches were shared, in the order that showed it.
answers = [issubclass(PagedAllocator, KVAllocator), issubclass(PagedAllocator, SchedulerPolicy),
           issubclass(ContiguousAllocator, KVAllocator), isinstance(ContiguousAllocator(10, 4, 40), PagedAllocator),
           issubclass(ChunkedPolicy, SchedulerPolicy), issubclass(ChunkedPolicy, KVAllocator)]
print(json.dumps({"status": varlen.compiled.status(), "file": sys.modules["varlen.kv.paged"].__file__,
                  "shared": shared, "answers": answers}))
"""


@pytest.mark.parametrize("first", ["varlen.kv", "sim.fast_forward", "sim.simulator"])
@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_isinstance_and_issubclass_answer_alike_on_both_cores(core, first):
    """mypyc builds classes without ABCMeta.__new__: each compiled class shared abc.ABC's caches,
    and issubclass(PagedAllocator, SchedulerPolicy) became True after issubclass(PagedAllocator,
    KVAllocator). varlen.compiled gives each its own; every class of the core has its own caches."""
    if core == "compiled" and not compiled.is_compiled():
        pytest.skip(f"no compiled core: {compiled.status()}")
    proc = subprocess.run([sys.executable, "-c", ABC_CACHES, first], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "VARLEN_PURE": "1" if core == "pure" else ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["status"].startswith(core) and out["file"].endswith(".so" if core == "compiled" else ".py"), out
    assert out["shared"] == []
    assert out["answers"] == [True, False, True, False, True, False]


def test_build_key_follows_the_sources(tmp_path, monkeypatch):
    # Any edit of a compiled module names another build, so a build never runs stale code.
    for rel in compiled.MODULES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((compiled.ROOT / rel).read_bytes())
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    key = compiled.build_key()
    assert key == compiled.build_key()
    with open(tmp_path / "schedulers/chunked.py", "a") as f:
        f.write("\n# an edit\n")
    assert compiled.build_key() != key


def _builds(cache: Path, n: int) -> None:
    """n complete builds in `cache`, build i stamped at time 1000 + i."""
    for i in range(n):
        done = cache / f"core-{i:020d}" / "COMPLETE"
        done.parent.mkdir()
        done.touch()
        os.utime(done, (1000 + i, 1000 + i))


def test_prune_keeps_the_newest_builds(tmp_path, monkeypatch):
    from varlen.compile import prune

    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path))
    _builds(tmp_path, 7)
    (tmp_path / "unrelated").mkdir()
    prune(keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"core-{i:020d}" for i in (4, 5, 6)] + ["unrelated"]


def test_a_build_in_use_outlives_newer_builds(tmp_path, monkeypatch):
    """Builds made by other checkouts never evict the one an import keeps loading (least recently used go)."""
    from varlen.compile import prune

    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path))
    _builds(tmp_path, 5)
    compiled.mark_used(tmp_path / f"core-{0:020d}")  # the oldest build, loaded again
    prune(keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"core-{i:020d}" for i in (0, 4)]


def test_loading_the_core_marks_it_used(tmp_path):
    """An import that finds a build stamps it (a subprocess on a cache of its own holding an empty build of
    these sources: the decision is made once per process and nothing is imported from it)."""
    code = ("import os, varlen.compiled as c; d = c.build_dir(); d.mkdir(parents=True); (d / 'COMPLETE').touch(); "
            "os.utime(d / 'COMPLETE', (1000, 1000)); c._state = None; c._decide(); print(c.status()); "
            "print(os.stat(d / 'COMPLETE').st_mtime)")
    env = {**os.environ, "VARLEN_CACHE_DIR": str(tmp_path)}
    env.pop("VARLEN_PURE", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    status, mtime = proc.stdout.splitlines()
    assert status.startswith("compiled") and str(tmp_path) in status
    assert float(mtime) > 1000


def test_pure_when_asked():
    proc = subprocess.run([sys.executable, "-c", "import varlen.compiled as c, varlen.engine as e; print(c.status()); print(e.__file__)"],
                          cwd=REPO, env={**os.environ, "VARLEN_PURE": "1"}, capture_output=True, text=True, check=True)
    status, engine_file = proc.stdout.splitlines()
    assert status == "pure Python (VARLEN_PURE is set)"
    assert engine_file.endswith("engine.py")


@pytest.mark.skipif(not compiled.is_compiled(), reason=f"no compiled core: {compiled.status()}")
def test_compiled_core_decides_exactly_as_pure_python():
    fast, pure = run_sim(pure=False), run_sim(pure=True)
    assert fast["status"].startswith("compiled"), fast["status"]
    assert all(f.endswith(".so") for f in fast["files"]), fast["files"]
    assert all(f.endswith(".py") for f in pure["files"]), pure["files"]
    for config, a, b in zip(CONFIGS, fast["runs"], pure["runs"]):
        assert a["steps"] == b["steps"], config
        assert a["requests"] == b["requests"], config  # token times bit for bit (JSON keeps floats exactly)
        assert a["row"] == b["row"], config
    # The configurations do exercise what they are meant to.
    rows = [r["row"] for r in fast["runs"]]
    assert rows[0]["preemptions"] > 0 and rows[1]["preemptions"] > 0, rows
    assert any(req[5] > 0 for req in fast["runs"][0]["requests"])  # prefix cache hits


def test_core_groups_are_checked():
    assert compiled.core_groups("") == compiled.DEFAULT_GROUPS
    assert compiled.core_groups("cost, policies") == ("policies", "cost")  # GROUPS order
    with pytest.raises(ValueError, match=r"unknown group\(s\) \['kv'\]; choose from engine, policies"):
        compiled.core_groups("policies,kv")
    with pytest.raises(ValueError, match="group 'simulator' subclasses \\['engine'\\]'s classes; add engine"):
        compiled.core_groups("simulator,cost")
    for group, needs in compiled.NEEDS.items():
        assert group in compiled.GROUPS and set(needs) <= set(compiled.GROUPS)


@pytest.mark.slow
def test_a_partial_build_decides_exactly_as_pure_python(tmp_path):
    """VARLEN_CORE compiles some groups only: the allocators compiled, everything calling them pure
    (compiled code takes interpreted instances: what it does not compile is untyped to it)."""
    env = {"VARLEN_CACHE_DIR": str(tmp_path), "VARLEN_CORE": "allocators"}
    # C at -O0 (mypyc's MYPYC_OPT_LEVEL; the build is this test's own): what it decides, not how fast;
    # ~8 CPU s instead of ~18.
    subprocess.run([sys.executable, "-m", "varlen.compile"], cwd=REPO,
                   env={**os.environ, **env, "VARLEN_PURE": "", "MYPYC_OPT_LEVEL": "0"},
                   check=True, capture_output=True, timeout=900)
    part, pure = run_sim(pure=False, **env), run_sim(pure=True)
    assert part["status"].startswith("compiled (groups allocators, "), part["status"]
    assert all(f.endswith(".py") for f in part["files"]), part["files"]  # engine, policy, simulator: pure
    kv = subprocess.run([sys.executable, "-c", "import varlen.kv.paged as m, varlen.request as r; print(m.__file__, r.__file__)"],
                        cwd=REPO, env={**os.environ, **env, "VARLEN_PURE": ""}, capture_output=True, text=True, check=True)
    paged, request = kv.stdout.split()
    assert paged.endswith(".so") and request.endswith(".py")
    for config, a, b in zip(CONFIGS, part["runs"], pure["runs"]):
        assert (a["steps"], a["requests"], a["row"]) == (b["steps"], b["requests"], b["row"]), config


def test_every_shipped_plug_in_is_compiled_or_deliberately_interpreted():
    from varlen import registry

    left_out = {rel for g, mods in compiled.GROUPS.items() if g not in compiled.DEFAULT_GROUPS for rel in mods}
    seen = set()
    for group in ("scheduler", "allocator", "cost", "router"):
        for name in registry.names(group):
            rel = registry.target(group, name).__module__.replace(".", "/") + ".py"
            seen.add(rel)
            assert (rel in compiled.MODULES) != (rel in compiled.INTERPRETED or rel in left_out), (group, name, rel)
    assert set(compiled.INTERPRETED) <= seen  # no stale entry
