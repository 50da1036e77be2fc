"""The package's layers: every import (module level and the lazy ones inside functions) goes to a
package on the same floor or below (FLOORS, the order docs/architecture.md and the README's Layout
show), and the graph has no cycle, so each module can be understood, and imported, after the ones
it uses. Every module also imports alone in a fresh interpreter (spot-checked here on the leaves of
each package; the closing note of issue 19 ran it on all of them)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fivefold"

# Bottom to top. A package (or top-level module) imports only from its own floor or the floors
# below; packages sharing a floor import each other without a cycle (the cycle test).
FLOORS = (
    ("errors", "paths", "platform"),  # the ground floor
    ("kernels",),  # C++ kernels built on first use
    ("models",),  # architectures, layers (float, packed, int8), loaders and writers
    ("quant", "compress", "fuse"),  # the lever libraries: a module in, a module out
    ("engine", "sampling_params", "batching", "cache", "kernel_report"),  # the engines and their parts
    ("eval",),  # accuracy and speed measures
    ("llm", "fivefold"),  # the Python API (the package root exports it)
    ("jobs", "profile"),  # quantize / compress / fuse jobs and their reports; the profiler
    ("serve",),  # HTTP
    ("bench",),  # benchmarks, registry, demo
    ("cli", "__main__"),  # one module per command
)
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def package_of(module: str) -> str:
    """``fivefold.quant.config`` -> ``quant``; the root package -> ``fivefold``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as "a -> b"."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if FLOOR[package_of(b)] > FLOOR[package_of(a)])


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(include_lazy: bool = True) -> dict[str, set[str]]:
    """module -> the fivefold modules it imports (``from a import b`` counts a.b when that is a
    module, else a)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if include_lazy else tree.body
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in nodes:
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("fivefold"):
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert cycles(graph) == []


def test_every_package_has_a_floor_and_no_import_goes_up():
    graph = import_graph()
    assert sorted({package_of(m) for m in graph} - set(FLOOR)) == []  # a new package is placed in FLOORS
    assert upward_imports(graph) == []


def test_an_upward_import_would_be_found():
    graph = {"fivefold.models.loader": {"fivefold.quant.config", "fivefold.kernels"},
             "fivefold.quant.config": {"fivefold.errors"}, "fivefold.kernels": set(), "fivefold.errors": set()}
    assert upward_imports(graph) == ["fivefold.models.loader -> fivefold.quant.config"]


def test_a_cycle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_modules_import_alone():
    names = ["fivefold.paths", "fivefold.eval.language", "fivefold.cache.redis_cache", "fivefold.serve.tool_calls",
             "fivefold.engine.llm_engine", "fivefold.models.int8_backends", "fivefold.models.tiled_attention"]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    for name in names:  # one interpreter each: nothing imported before it
        subprocess.run([sys.executable, "-c", code, name], check=True, timeout=120)
