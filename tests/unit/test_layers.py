"""The package's layers, read from its source with ``ast``: no import cycle between its modules; the
online path (what ``block_sparse_attention`` runs) imports nothing offline (corpus, profiling,
benchmarks, CLI, test helpers) and nothing of the diffusers integration; and the rest of the core
(context parallelism, sparsifiers) imports nothing of the integration either.

Every import counts: module-level ones, those under ``if TYPE_CHECKING``, and those inside
functions (a deferred import still runs, and a cycle through one only moves the failure to the
first call that takes it)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tessera_diffusers"
# Source folders of the package: tessera_diffusers.processors lives in processors/ (setup.py's package_dir).
SOURCES = {PACKAGE: ROOT / "tessera_diffusers", f"{PACKAGE}.processors": ROOT / "processors"}

# The modules a request runs through, and what they must not reach, directly or through each other.
ONLINE = ("errors", "mask", "mask_state", "plans", "catalog", "kernel_table", "eligibility", "reference",
          "executor", "prepare", "prepared", "regroup", "native_prepare", "ops", "plan_table", "selector",
          "cost_model", "runtime", "validation", "library", "mask_counts", "config")
OFFLINE = ("corpus", "profile", "bench", "processors", "sparsifiers", "parallel", "demo", "cli", "testing")
# The diffusers-free rest of the core beside the online path: the context parallelism the processors
# build on, and the sparsifiers (with their subpackage's modules).
CORE = ("parallel", "peer_exchange", "sparsifiers")
INTEGRATION = ("processors",)


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (``tessera_diffusers.x.__init__`` as
    ``tessera_diffusers.x``)."""
    modules = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def imported_names(module: str, path: Path) -> set[tuple[str, str]]:
    """What ``module`` imports anywhere in its source, as ``(name, owner)`` pairs of absolute names:
    ``import a.b`` gives ``(a.b, a.b)``; ``from a import b`` gives ``(a.b, a)``: the module ``a.b``
    if there is one, else the name ``b`` of ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update((alias.name, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.update((f"{source}.{alias.name}", source) for alias in node.names)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(edges, external)``: per module, the package modules it imports (each imported name's
    longest module prefix, itself excluded) and the names outside the package it imports."""
    modules = package_modules()
    edges, external = defaultdict(set), defaultdict(set)
    for module, path in modules.items():
        for name, owner in imported_names(module, path):
            if not is_under(owner, PACKAGE):
                external[module].add(owner)
                continue
            target = name if name in modules else owner
            while target not in modules:
                target = target.rpartition(".")[0]
            if target != module:
                edges[module].add(target)
    return {m: edges[m] for m in modules}, {m: external[m] for m in modules}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reachable(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches through imports, each with the module that imports it on one path."""
    seen, todo = {start: ""}, [start]
    while todo:
        node = todo.pop()
        for child in sorted(edges.get(node, ())):
            if child not in seen:
                seen[child] = node
                todo.append(child)
    return seen


def path_to(parents: dict[str, str], module: str) -> str:
    chain = [module]
    while parents[chain[-1]]:
        chain.append(parents[chain[-1]])
    return " -> ".join(reversed(chain))


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_the_package():
    """A guard for the tests below: the graph holds the modules and edges they are about."""
    edges, external = import_graph()
    assert {f"{PACKAGE}.{m}" for m in ONLINE} <= set(edges)
    assert f"{PACKAGE}.processors.processor" in edges and f"{PACKAGE}.sparsifiers.layout" in edges
    assert f"{PACKAGE}.runtime" in edges[f"{PACKAGE}.processors.backends"]
    assert f"{PACKAGE}.ops" in edges[f"{PACKAGE}.runtime"]  # a function-level import
    assert any(is_under(name, "diffusers") for name in external[f"{PACKAGE}.processors.compat"])


def test_no_import_cycle():
    edges, _ = import_graph()
    found = cycles(edges)
    described = []
    for component in found:
        inside = set(component)
        described.append("\n".join(f"  {a} -> {b}" for a in component for b in sorted(edges[a] & inside)))
    assert not found, "import cycles:\n" + "\n\n".join(described)


def forbidden_reaches(edges, external, starts: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """The import paths from a module of ``starts`` to a package module under one of ``forbidden``
    or to diffusers."""
    problems = set()
    for start in starts:
        parents = reachable(edges, start)
        for module in parents:
            if any(is_under(module, f) for f in forbidden):
                problems.add(path_to(parents, module))
            problems.update(f"{path_to(parents, module)} -> {name}" for name in external.get(module, ())
                            if is_under(name, "diffusers"))
    return sorted(problems)


def test_the_online_path_imports_nothing_offline_nor_diffusers():
    edges, external = import_graph()
    problems = forbidden_reaches(edges, external, [f"{PACKAGE}.{name}" for name in ONLINE],
                                 tuple(f"{PACKAGE}.{name}" for name in OFFLINE))
    assert not problems, "the online path reaches:\n" + "\n".join(problems)


def test_the_core_imports_nothing_of_the_diffusers_integration():
    edges, external = import_graph()
    core = [m for m in edges if any(is_under(m, f"{PACKAGE}.{name}") for name in ONLINE + CORE)]
    problems = forbidden_reaches(edges, external, core, tuple(f"{PACKAGE}.{name}" for name in INTEGRATION))
    assert not problems, "the core reaches the integration:\n" + "\n".join(problems)
