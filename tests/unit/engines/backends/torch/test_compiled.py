"""Compiled graphs kept in the engine store, on the CPU (Inductor's C++ kernels stand in for
its Triton ones: the store round trip is the same code on both).

Each start is a fresh Python process with its own empty Inductor cache directory, as a
restarted pod on a new node would be: only the engine store is shared between them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from tests.conftest import TINY_BIAS, TINY_WEIGHTS, run_python, tiny_onnx

pytest.importorskip(
    "torch", reason="compiling is torch code: torch (the reference extra) is not installed"
)


START = """
import json, sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from engines.backends.torch import compiled
from engines.backends.torch.convert import convert
from engines.store import EngineStore

source, root = Path(sys.argv[1]), Path(sys.argv[2])
store = EngineStore(root)
key = compiled.artifact_key(source, "tiny", "fp32", "default", torch.device("cpu"), (1, 4), {})
loaded = compiled.load_artifacts(store, key)
module = compiled.compile_module(convert(source).eval(), "default", 2)
answers = {}
with torch.no_grad():
    for rows in (1, 4):
        x = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) / 7 - 1
        y, s = module(x)
        answers[rows] = {"x": x.tolist(), "y": y.tolist(), "s": s.tolist()}
saved = False if loaded else compiled.save_artifacts(store, key)
print(json.dumps({
    "loaded": loaded,
    "saved": saved,
    "hits": counters["inductor"]["fxgraph_cache_hit"],
    "misses": counters["inductor"]["fxgraph_cache_miss"],
    "answers": answers,
}))
"""


def start(source: Path, store: Path, cache: Path) -> dict[str, Any]:
    return run_python(START, str(source), str(store), env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})


def check_answers(answers: dict[str, Any]) -> None:
    """The compiled tiny model's outputs against numpy's arithmetic of the same graph."""
    assert sorted(answers) == ["1", "4"]
    for rows, got in answers.items():
        x = np.array(got["x"], dtype=np.float32)
        assert x.shape == (int(rows), 4)
        np.testing.assert_allclose(got["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["s"], x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_restart_loads_the_compiled_kernels_from_the_store(tmp_path: Path) -> None:
    source = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), source)
    store = tmp_path / "store"

    first = start(source, store, tmp_path / "inductor-first")
    assert first["loaded"] is False and first["saved"] is True
    assert first["misses"] >= 2 and first["hits"] == 0  # one graph per batch size, generated
    check_answers(first["answers"])
    stored = list(store.rglob("inductor-*.inductor"))
    assert len(stored) == 1 and stored[0].stat().st_size > 0
    manifest = json.loads(Path(f"{stored[0]}.manifest.json").read_text())
    assert manifest["key"]["kind"] == "inductor" and manifest["key"]["profile"] == [1, 4]

    second = start(source, store, tmp_path / "inductor-second")
    assert second["loaded"] is True and second["saved"] is False
    assert second["misses"] == 0 and second["hits"] >= 2  # nothing generated again
    check_answers(second["answers"])


def test_several_compiled_models_in_one_process_stay_compiled(tmp_path: Path) -> None:
    """Every converted model runs the same ``OnnxModule.forward``, and Dynamo counts all of
    their graphs against one limit per code object (8 by default), past which it refuses to
    compile (an error with ``fullgraph``). Two engines of one model (FP32 and FP64, as two
    precisions are) with five buckets each, in this process after whatever other tests
    compiled: each engine adds its buckets to the limit."""
    import torch

    from engines.backends.torch import compiled
    from engines.backends.torch.convert import convert

    source = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), source)
    for dtype in (torch.float32, torch.float64):
        module = compiled.compile_module(convert(source).eval().to(dtype), "default", 5)
        for rows in range(1, 6):
            x = torch.arange(rows * 4, dtype=dtype).reshape(rows, 4) / 5
            with torch.no_grad():
                y, _ = module(x)
            want = x.numpy() @ TINY_WEIGHTS.astype(np.float64) + TINY_BIAS
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
