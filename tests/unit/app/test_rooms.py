"""Two rooms, one narrow door: the front end's code loads none of the engine's, and no
module of the service imports the tooling."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import run_python

ROOT = Path(__file__).resolve().parents[3]
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
