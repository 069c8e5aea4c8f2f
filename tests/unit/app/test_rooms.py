"""Two rooms, one narrow door: the front end's code loads none of the engine's, the shared
floor (app/'s top-level modules) holds only what both rooms import, no import goes round in a
circle, ``engines/`` never imports the service and the service never imports the tooling."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.conftest import run_python

ROOT = Path(__file__).resolve().parents[3]
ROOMS = ("app.engine", "app.frontend")
SUPERVISOR = {"app.__main__", "app.cli", "app.processes", "app.control"}
"""The top: the command line and the supervisor, which start the rooms; no room imports them."""
ENGINE_ONLY = (
    "onnx",
    "onnxruntime",
    "torch",
    "PIL",
    "app.engine",
    "engines.precision",
    "engines.backends",
)


def test_importing_the_front_end_loads_no_engine_code() -> None:
    found = run_python(
        "import json, sys\n"
        "import app.frontend.server, app.frontend.routes, app.frontend.plane\n"
        "import app.frontend.remote, app.frontend.arena, app.processes, app.wire\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = [
        name
        for name in found
        if any(name == root or name.startswith(root + ".") for root in ENGINE_ONLY)
    ]
    assert loaded == []
    # The check sees imports at all: the front end's own modules are there.
    assert "app.frontend.remote" in found and "app.wire" in found


def test_the_engine_room_imports_nothing_of_the_front_end() -> None:
    for path in sorted((ROOT / "app" / "engine").glob("*.py")):
        imported = modules_imported(path)
        assert not [m for m in imported if m.startswith("app.frontend")], path.name


def test_the_service_never_imports_the_tooling() -> None:
    for path in sorted((ROOT / "app").rglob("*.py")):
        imported = modules_imported(path)
        assert not [m for m in imported if m == "bench" or m.startswith(("bench.", "scripts"))], (
            path.name
        )


def modules_imported(path: Path) -> list[str]:
    """Every module a file imports, at its top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_no_import_goes_round_in_a_circle() -> None:
    graph = import_graph()
    circles = [sorted(group) for group in strongly_connected(graph) if len(group) > 1]
    assert circles == []
    # The graph holds the imports that matter here: TYPE_CHECKING ones and those in functions.
    assert "app.engine.local" in graph["app.frontend.server"]  # in a function
    assert "app.metrics" in graph["app.tracing"]  # under TYPE_CHECKING


def test_the_floor_holds_only_what_both_rooms_import() -> None:
    graph = import_graph()
    floor = {m for m in graph if m.count(".") == 1 and m.startswith("app.")} - set(ROOMS)
    floor -= SUPERVISOR
    for module in sorted(floor):
        into_rooms = [m for m in graph[module] if m.startswith(ROOMS)]
        assert into_rooms == [], f"{module} (the floor) imports {into_rooms}"
    for room in ROOMS:
        reached = reachable(graph, [m for m in graph if m.startswith(room + ".")], floor)
        assert floor - reached == set(), f"floor modules {room} never imports"
    for module in sorted(graph):
        if module not in SUPERVISOR:
            assert not graph[module] & SUPERVISOR, f"{module} imports the supervisor"


def test_the_engines_package_never_imports_the_service() -> None:
    graph = import_graph()
    for module in sorted(m for m in graph if m.startswith("engines")):
        assert not [m for m in graph[module] if m.startswith("app")], module


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of app/ and engines/ it imports: at its top, inside functions
    and under TYPE_CHECKING alike (an import of a package's name is of its module)."""
    paths = {}
    for top in ("app", "engines"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        named = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named += [f"{node.module}.{alias.name}" for alias in node.names]
        found = {known(name, paths) for name in named}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def known(name: str, modules: Iterable[str]) -> str | None:
    """The longest of ``modules`` that ``name`` is or lies in (None: outside them)."""
    modules = set(modules)
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def reachable(graph: dict[str, set[str]], starts: list[str], through: set[str]) -> set[str]:
    """The modules of ``through`` that ``starts`` import, directly or through others of it."""
    seen: set[str] = set()
    todo = [m for start in starts for m in graph[start] if m in through]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [m for m in graph[module] if m in through]
    return seen


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components: a group of two or more is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while True:
                other = stack.pop()
                group.add(other)
                if other == module:
                    break
            groups.append(group)

    for module in graph:
        if module not in index:
            visit(module)
    return groups
