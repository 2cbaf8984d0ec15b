"""The packages' layers (README: layers), read from the sources' import statements.

Floors, lowest first. A module may import from a lower floor, or from its own group on its own
floor; never upwards, never across groups on one floor (the engine and the plug-ins it runs know
each other only through the interfaces). Every import counts, a function's lazy one too. The
second half: the scheduling core and the simulator import no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("varlen", "schedulers", "backends", "sim")

#: (floor, {group: module names or "prefix.*" patterns}), lowest first. The most specific
#: entry names a module's group; a module no entry names fails test_every_module_has_a_layer.
FLOORS: list[tuple[str, dict[str, tuple[str, ...]]]] = [
    ("core", {"core": (
        "varlen.compiled", "varlen.sampling_params", "varlen.request", "varlen.clock", "varlen.steplog",
        "varlen.promises", "varlen.interrupt", "varlen.batch", "varlen.settings", "varlen.registry",
        "varlen.traces", "varlen.traces.*", "varlen.workload", "varlen.metrics", "varlen.tiny_model", "varlen.cli",
        "varlen.timeline",  # timeline.json from step logs and request times
        "varlen.outputs",  # what generate and the server return: completions, logprobs
        "varlen.c_build",  # compiles the C kernels (torch_paged, layer kernels) into the cache
        "sim",  # the package marker only (sim.cost.profiles finds its data next to it)
    )}),
    ("interfaces", {"interfaces": (
        "varlen.scheduler_api", "varlen.attention_api", "varlen.kv.base", "sim.cost.base",
    )}),
    ("implementations", {
        "schedulers": ("schedulers", "schedulers.*"),
        "backends": ("backends", "backends.*"),
        "allocators": ("varlen.kv", "varlen.kv.*"),
        "cost models": ("sim.cost", "sim.cost.*", "sim.parallel"),  # parallel: TP/PP timing and memory
        "engine": ("varlen.engine", "varlen.engine_loop", "varlen.assembly", "varlen.executor", "varlen.model_runner",
                   "varlen.linear_kernels", "varlen.layer_kernels", "varlen.model_attention", "varlen.sampler",
                   "varlen.backend_choice"),  # backend=auto: reaches backends through the registry only
    }),
    ("simulator", {"simulator": ("sim.*",)}),
    ("entry points", {"entry points": (
        "varlen",  # the package's facade: LLM, lazily
        "varlen.llm", "varlen.run", "varlen.demo", "varlen.compile", "varlen.architectures",
        "sim.run", "sim.capacity", "sim.explain", "sim.search", "sim.profile", "sim.fit",
        "sim.slo_scale", "sim.cells",  # a capacity mode, and a run split into cells: both drive sim.run's probes
        "varlen.testing", "varlen.testing.*",  # the property suites: they drive every layer
        "varlen.check", "varlen.check_properties",  # the command that runs them on one plug-in
        "varlen.compare", "sim.callbacks",  # runs side by side; the sweeps' Hydra callbacks print it
        "varlen.serve", "varlen.openai_protocol",  # the OpenAI-compatible server and its wire format
    )}),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def layer_of(module: str) -> tuple[int, str] | None:
    """(floor index, group) of `module`: an exact name wins over a pattern, a longer pattern over a shorter."""
    best: tuple[int, int, str] | None = None  # (specificity, floor, group)
    for floor, (_, groups) in enumerate(FLOORS):
        for group, names in groups.items():
            for name in names:
                if name == module:
                    score = 10_000
                elif name.endswith(".*") and module.startswith(name[:-1]):
                    score = len(name)
                else:
                    continue
                if best is None or score > best[0]:
                    best = (score, floor, group)
    return None if best is None else (best[1], best[2])


def imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, wherever the import statement sits."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = module.split(".")
                pkg = pkg[:len(pkg) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                continue
            while name and name not in known:  # `import a.b.c` of a name inside a module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, m, known) for m, p in known.items()}


def test_every_module_has_a_layer(graph):
    missing = [m for m in graph if layer_of(m) is None]
    assert not missing, f"give these modules a floor and group in tests/plugins/test_layers.py FLOORS: {missing}"


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        here = layer_of(m)
        assert here is not None
        for d in sorted(deps):
            there = layer_of(d)
            assert there is not None
            if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
                bad.append(f"{m} ({FLOORS[here[0]][0]}/{here[1]}) imports {d} ({FLOORS[there[0]][0]}/{there[1]})")
    return bad


def test_no_import_goes_up_or_across(graph):
    bad = violations(graph)
    assert not bad, "imports against the layers (README: layers):\n" + "\n".join(bad)


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph, as a path, or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for d in sorted(edges.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return []

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_no_cycle_among_packages_and_layers(graph):
    """Each package split by floor (varlen's core and its entry points are different nodes): no
    cycle among those, nor among the modules themselves."""
    def node(m: str) -> str:
        floor = layer_of(m)
        assert floor is not None
        return f"{m.split('.')[0]}/{FLOORS[floor[0]][0]}"

    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        edges.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    assert not cycle(edges), " -> ".join(cycle(edges))
    assert not cycle(graph), " -> ".join(cycle(graph))


def test_the_check_sees_a_violation_and_a_cycle(graph, tmp_path):
    """Not vacuous: a lazy upward import, an import across a floor and a loop are caught."""
    assert layer_of("varlen.engine") == (2, "engine") and layer_of("schedulers.chunked") == (2, "schedulers")
    assert layer_of("varlen.kv.base") == (1, "interfaces") and layer_of("varlen.kv.paged") == (2, "allocators")
    assert layer_of("sim.run") == (4, "entry points") and layer_of("sim.simulator") == (3, "simulator")
    probe = tmp_path / "engine.py"  # the engine, with what it must never do
    probe.write_text("from varlen.request import Request\n\ndef f():\n    from sim.run import main\n"
                     "    import schedulers.chunked\n")
    seen = imports(probe, "varlen.engine", modules())
    assert seen == {"varlen.request", "sim.run", "schedulers.chunked"}
    bad = violations({**graph, "varlen.engine": seen})
    assert bad == ["varlen.engine (implementations/engine) imports schedulers.chunked (implementations/schedulers)",
                   "varlen.engine (implementations/engine) imports sim.run (entry points/entry points)"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_scheduling_core_and_simulator_import_no_torch():
    mods = ["sim.run", "sim.simulator", "sim.executor", "sim.fast_forward", "sim.cost.registry", "sim.cost.fitted", "sim.cost.replay", "sim.capacity",
            "sim.validate", "sim.report", "schedulers", "varlen.scheduler_api", "varlen.engine", "varlen.kv",
            "varlen.request", "varlen.metrics", "varlen.workload", "varlen.traces", "varlen.clock"]
    code = f"import sys\nfor m in {mods!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


#: The test kit (properties and the command that runs them on a plug-in) sits above every package
#: it checks: a node of its own, which no other module may import.
TEST_KIT = ("varlen.testing", "varlen.check", "varlen.check_properties")


def node(module: str) -> str:
    return "test kit" if any(module == k or module.startswith(k + ".") for k in TEST_KIT) else module.split(".")[0]


def test_no_cycle_among_the_packages(graph):
    """varlen, backends, schedulers, sim and the test kit as nodes, every import counted: the
    framework package (varlen) imports none of the others, which import it (its interfaces and core)."""
    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        edges.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    assert not cycle(edges), " -> ".join(cycle(edges))
    assert not edges["varlen"], f"varlen imports {sorted(edges['varlen'])}: import their interfaces from varlen"
    assert not any("test kit" in deps for deps in edges.values()), "only tests may import the test kit"
