"""The shape of the house (issue 18): no import circle at module level, no module over 400 lines
(the fused quant kernels excepted), the scheduler apart from the tiers, and one place that builds them."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "tiered_cache")
TIER_CLASSES = {"HostMirror", "TransferEngine", "HiMambaRadixCache", "HiSWARadixCache", "UnifiedPool",
                "Int8CheckpointPool", "StorageTier"}


def _modules() -> dict[str, str]:
    out = {}
    for folder, dirs, files in os.walk(PKG):
        dirs[:] = [d for d in dirs if not d.startswith("__")]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                out[name] = path
    return out


def _import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module-level imports between the package's modules (``from a import b`` of a submodule ``b`` is
    an edge to ``a.b`` alone; imports inside functions are not edges: they run after both loaded)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiered_cache"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_cycle_finder_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) != []
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_circle():
    assert _cycles(_import_graph(_modules())) == []


def test_no_module_over_400_lines_but_the_quant_kernels():
    long = {m: n for m, p in _modules().items() if (n := len(open(p).read().splitlines())) > 400}
    assert set(long) <= {"tiered_cache.kernels.quant"}, long


def test_the_scheduler_imports_nothing_from_the_tiers_or_transfer():
    tree = ast.parse(open(os.path.join(PKG, "engine", "scheduler.py")).read())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [n for n in names if n.startswith(("tiered_cache.tiers", "tiered_cache.transfer"))] == []


def test_only_the_stack_builds_the_tiers():
    """Inside the package, the tiers and the trees are constructed in stack.py alone (tests of a tier
    and the benchmarks of one tier build that tier themselves; so does ``tiered-cache demo``, a tour
    of T0 alone)."""
    built = []
    for m, path in _modules().items():
        if m == "tiered_cache.stack":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in TIER_CLASSES and (m, name) != ("tiered_cache.cli", "UnifiedPool"):
                    built.append((m, name, node.lineno))
    assert built == []
