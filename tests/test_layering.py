"""Dependencies point one way (README, "Layout"), checked on the sources and on real imports.

    veritrain/ (cli, demo, swarm)          the layer on top: composes everything
    workers/   validators/                 the two roles; neither imports the other
    ledger/                                the ledger, its API and its client; no torch
    protocol/                              the rules, sans I/O: no network, no database
    aggregation/                           tensor math: imports nothing of the protocol

The static checks read every ``import`` in the five folders, function-level ones included,
so an import hidden inside a function cannot dodge them; the dynamic checks import the
packages in a fresh interpreter and look at what got loaded.
"""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"protocol": "veritrain.protocol", "workers": "veritrain.workers",
           "validators": "veritrain.validators", "aggregation": "veritrain.aggregation",
           "ledger": "veritrain.ledger", "veritrain": "veritrain"}
LAYERS = ("protocol", "workers", "validators", "aggregation", "ledger")
NETWORK_OR_DATABASE = {"socket", "http", "asyncio", "aiohttp", "sqlalchemy", "sqlite3", "urllib",
                       "urllib3", "requests", "psycopg", "alembic", "ssl"}


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _sources() -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if "migrations" not in path.parts:
                out[_module_name(path)[0]] = path
    return out


SOURCES = _sources()


def _imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports: absolute names, relative ones resolved, and
    ``from package import submodule`` counted as an import of the submodule alone."""
    name, is_package = _module_name(path)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names} & SOURCES.keys()
            found |= submodules
            if len(submodules) < len(node.names):  # some names are the package's own
                found.add(module)
    return found


GRAPH = {name: _imports_of(path) for name, path in SOURCES.items()}


def _folder(module: str) -> str | None:
    """The top folder a veritrain module lives in (None for other packages)."""
    parts = module.split(".")
    if parts[0] != "veritrain":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "veritrain"


def _imports_of_folder(folder: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in GRAPH.items() if _folder(m) == folder}


@pytest.mark.parametrize("folder", ["protocol", "aggregation"])
def test_rules_and_math_import_no_network_or_database_module(folder):
    bad = {m: sorted(d.split(".")[0] for d in deps if d.split(".")[0] in NETWORK_OR_DATABASE)
           for m, deps in _imports_of_folder(folder).items()}
    assert not {m: d for m, d in bad.items() if d}


def test_aggregation_imports_nothing_else_of_veritrain():
    bad = {m: sorted(d for d in deps if _folder(d) not in (None, "aggregation"))
           for m, deps in _imports_of_folder("aggregation").items()}
    assert not {m: d for m, d in bad.items() if d}


def test_ledger_imports_no_torch_nor_a_package_that_needs_it():
    bad = {m: sorted(d for d in deps if d.split(".")[0] in ("torch", "numpy", "safetensors")
                     or _folder(d) in ("aggregation", "workers", "validators", "veritrain"))
           for m, deps in _imports_of_folder("ledger").items()}
    assert not {m: d for m, d in bad.items() if d}


def test_the_two_roles_do_not_import_each_other():
    for role, other in (("workers", "validators"), ("validators", "workers")):
        bad = {m: sorted(d for d in deps if _folder(d) == other)
               for m, deps in _imports_of_folder(role).items()}
        assert not {m: d for m, d in bad.items() if d}, role


@pytest.mark.parametrize("folder", LAYERS)
def test_no_layer_imports_the_top_layer(folder):
    """cli, demo, swarm, local, ... (the ``veritrain/`` folder) compose the layers below."""
    bad = {m: sorted(d for d in deps if _folder(d) == "veritrain" and d != "veritrain")
           for m, deps in _imports_of_folder(folder).items()}
    assert not {m: d for m, d in bad.items() if d}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    out.append(sorted(component))
    return out


def test_no_import_circle_between_modules():
    graph = {m: {d for d in deps if d in GRAPH and d != m} for m, deps in GRAPH.items()}
    assert _cycles(graph) == []


def test_no_import_circle_between_folders():
    graph: dict[str, set[str]] = {f: set() for f in FOLDERS}
    for m, deps in GRAPH.items():
        graph[_folder(m)] |= {f for d in deps if (f := _folder(d)) not in (None, _folder(m))}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


LOADED = """
import importlib, pkgutil, sys
import {package} as pkg
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if ".migrations" not in info.name:
        importlib.import_module(info.name)
print(",".join(sorted({{m.split(".")[0] for m in sys.modules}} & {forbidden!r})))
"""


@pytest.mark.parametrize(("package", "forbidden"), [
    ("veritrain.protocol", {"aiohttp", "sqlalchemy", "alembic", "psycopg", "urllib3", "requests"}),
    ("veritrain.aggregation", {"aiohttp", "sqlalchemy", "alembic", "psycopg", "urllib3",
                               "requests"}),
    ("veritrain.ledger", {"torch"}),
])
def test_importing_every_module_of_a_package_loads_nothing_forbidden(package, forbidden):
    out = subprocess.run([sys.executable, "-c", LOADED.format(package=package,
                                                              forbidden=forbidden)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} loads {out.stdout.strip()}"


def test_every_source_module_is_seen_by_the_static_checks():
    """The walk above covers what the package installs (a module the static graph missed
    would escape every rule here)."""
    installed = set()
    for folder in LAYERS:
        pkg = __import__(FOLDERS[folder], fromlist=["_"])
        installed |= {i.name for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
                      if ".migrations" not in i.name}
    assert installed <= set(GRAPH)
