"""The compiled package kept in the engine store, on the CPU (AOTInductor's C++ kernels stand
in for its Triton ones: the store round trip, the key and the loader are the same code).

Each start is a fresh Python process with its own empty Inductor cache directory, as a
restarted pod on a new node would be: only the engine store is shared between them. The
first start compiles (once, for the module); the other tests reuse its package, with a
stand-in compiler that copies it and counts its calls.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tests.conftest import TINY_BIAS, TINY_WEIGHTS, run_python, tiny_onnx

torch = pytest.importorskip(
    "torch", reason="compiling is torch code: torch (the reference extra) is not installed"
)

from engines.backends.torch import compiled  # noqa: E402
from engines.backends.torch.convert import convert  # noqa: E402
from engines.store import EngineStore  # noqa: E402

MAX_BATCH = 4

START = """
import json, sys
from pathlib import Path

import torch

from engines.backends.torch import compiled
from engines.backends.torch.convert import convert
from engines.store import EngineStore

calls = {"compile": 0, "export": 0, "aoti": 0}


def counting(name, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return counted


compiled.compile_package = counting("compile", compiled.compile_package)
torch.export.export = counting("export", torch.export.export)
torch._inductor.aoti_compile_and_package = counting(
    "aoti", torch._inductor.aoti_compile_and_package
)
source, root = Path(sys.argv[1]), Path(sys.argv[2])
store = EngineStore(root)
key = compiled.package_key(source, "tiny", "fp32", "default", torch.device("cpu"), 4, {})
module = convert(source).eval()
call = compiled.load_or_compile(
    store, key, module, lambda: (torch.zeros(4, 4),), torch.device("cpu")
)
answers = {}
with torch.no_grad():
    for rows in (1, 3, 4):
        x = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) / 7 - 1
        y, s = call(x)
        answers[rows] = {"x": x.tolist(), "y": y.tolist(), "s": s.tolist()}
print(json.dumps({"calls": calls, "phases": store.phases.of("tiny"), "answers": answers}))
"""


def start(source: Path, store: Path, cache: Path) -> dict[str, Any]:
    return run_python(START, str(source), str(store), env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})


def check_answers(answers: dict[str, Any]) -> None:
    """The compiled tiny model's outputs against numpy's arithmetic of the same graph, at
    every batch size the one package serves (1 to its max)."""
    assert sorted(answers) == ["1", "3", "4"]
    for rows, got in answers.items():
        x = np.array(got["x"], dtype=np.float32)
        assert x.shape == (int(rows), 4)
        np.testing.assert_allclose(got["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["s"], x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def check(call: Any) -> None:
    """The loaded package's answers at 3 rows against numpy's."""
    x = torch.randn(3, 4)
    with torch.no_grad():
        y, s = call(x)
    want = x.numpy() @ TINY_WEIGHTS + TINY_BIAS
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.numpy(), x.sum(1, keepdim=True).numpy(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The first start on an empty store: it compiles."""
    folder = tmp_path_factory.mktemp("compiled")
    source = folder / "tiny.onnx"
    onnx.save(tiny_onnx(), source)
    result = start(source, folder / "store", folder / "inductor-first")
    return {"source": source, "store": folder / "store", "result": result, "folder": folder}


def package_of(store: Path) -> Path:
    stored = list(store.rglob("aoti-*.pt2"))
    assert len(stored) == 1
    return stored[0]


def test_a_restart_with_a_filled_store_compiles_and_traces_nothing(first: dict[str, Any]) -> None:
    result = first["result"]
    assert result["calls"] == {"compile": 1, "export": 1, "aoti": 1}
    assert result["phases"]["compile"] > 0
    check_answers(result["answers"])
    package = package_of(first["store"])
    manifest = json.loads(Path(f"{package}.manifest.json").read_text())
    assert manifest["key"]["kind"] == "aoti" and manifest["key"]["profile"] == [MAX_BATCH]

    again = start(first["source"], first["store"], first["folder"] / "inductor-second")
    assert again["calls"] == {"compile": 0, "export": 0, "aoti": 0}  # loaded, nothing traced
    assert "compile" not in again["phases"] and again["phases"]["load"] >= 0
    check_answers(again["answers"])


class CopyingCompiler:
    """Stands in for ``compile_package``: copies the first start's package, and counts."""

    def __init__(self, package: Path) -> None:
        self.package, self.calls = package, 0

    def __call__(self, module: Any, example: Any, mode: str, path: Path, max_batch: int) -> None:
        self.calls += 1
        shutil.copyfile(self.package, path)


def a_start(
    first: dict[str, Any], root: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[CopyingCompiler, Any]:
    compiler = CopyingCompiler(package_of(first["store"]))
    monkeypatch.setattr(compiled, "compile_package", compiler)
    source = first["source"]
    key = compiled.package_key(source, "tiny", "fp32", "default", torch.device("cpu"), 4, {})
    call = compiled.load_or_compile(
        EngineStore(root), key, convert(source).eval(), lambda: (torch.zeros(4, 4),),
        torch.device("cpu"),
    )  # fmt: skip
    return compiler, call


def test_an_entry_of_another_torch_version_is_compiled_again(
    first: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    shutil.copytree(first["store"], root)
    compiler, _ = a_start(first, root, monkeypatch)
    assert compiler.calls == 0  # the same versions: found
    monkeypatch.setattr(compiled, "versions", lambda: "torch 9.9.9 triton 9.9")
    compiler, call = a_start(first, root, monkeypatch)
    assert compiler.calls == 1  # another key: compiled, beside the old entry
    assert len(list(root.rglob("aoti-*.pt2"))) == 2
    check(call)


def test_a_corrupt_entry_is_refused_and_compiled_again(
    first: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    shutil.copytree(first["store"], root)
    package = package_of(root)
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    compiler, call = a_start(first, root, monkeypatch)
    assert compiler.calls == 1
    check(call)


def test_an_entry_that_verifies_but_does_not_load_is_discarded_and_compiled_again(
    first: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A package whose manifest and checksum match (written by a broken build, say) but
    that AOTInductor's loader refuses: discarded under its lock, compiled again, loaded."""
    root = tmp_path / "store"
    store = EngineStore(root)
    source = first["source"]
    key = compiled.package_key(source, "tiny", "fp32", "default", torch.device("cpu"), 4, {})

    def broken_build(path: Path) -> None:
        path.write_bytes(b"not a package")

    store.get_or_build(key, broken_build, compiled.SUFFIX)
    with caplog.at_level("WARNING"):
        compiler, call = a_start(first, root, monkeypatch)
    assert compiler.calls == 1
    assert "the compiled package did not load" in caplog.text
    check(call)
