"""Shared fixtures: small real ONNX models, a model repository, real photos."""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
# Servers the tests start (subprocesses inherit this) serve gRPC only where a test gives them
# a free port (tests/integration/test_grpc.py): on the default 8001, servers started side by
# side, or beside a developer's own, would collide.
os.environ.setdefault("STOKER_SERVER__GRPC_PORT", "0")
# And one process unless a test asks for front ends: ``front_ends: auto`` would start four per
# GPU on a GPU machine, where the tests' servers are meant to be the one-process server.
os.environ.setdefault("STOKER_SERVER__FRONT_ENDS", "1")


@pytest.fixture(autouse=True)
def _thawed_heap() -> Any:
    """A test that loads models freezes the collector's view of the heap, as the engine does
    (``engines.heap.freeze_heap``); the next test starts with it thawed."""
    yield
    gc.unfreeze()


def run_python(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``script`` in a fresh Python (this repository importable, ``env`` added to this
    process's environment); what it printed last, as JSON. A fresh process is what a
    restarted engine starts with: its own caches, its own allocator cap."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


TINY_WEIGHTS = np.random.default_rng(7).standard_normal((4, 3)).astype(np.float32)
TINY_BIAS = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def tiny_onnx() -> onnx.ModelProto:
    """y = x @ W + b and s = sum(x) per row: a batched model small enough for exact checks."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 1]),
        ],
        initializer=[
            numpy_helper.from_array(TINY_WEIGHTS, "W"),
            numpy_helper.from_array(TINY_BIAS, "b"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def slow_onnx(
    width: int,
    layers: int,
    tail: Sequence[onnx.NodeProto] = (),
    extra: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    """A model whose compute time is set by ``width`` and ``layers`` and whose answer is known:
    x of shape [batch, m, 1] is broadcast to width, multiplied by the identity ``layers``
    times and summed, so ``total`` is width * sum(x) per row. ``tail`` nodes (with ``extra``
    initializers) may turn ``total`` into ``y``; without them ``total`` is the output ``y``."""
    out = "total" if tail else "y"
    nodes = [helper.make_node("Mul", ["x", "ones"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "eye"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("ReduceSum", [f"h{layers}", "axes"], [out], keepdims=1))
    graph = helper.make_graph(
        [*nodes, *tail],
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "m", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 1])],
        initializer=[
            numpy_helper.from_array(np.ones((1, width), np.float32), "ones"),
            numpy_helper.from_array(np.eye(width, dtype=np.float32), "eye"),
            numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
            *extra,
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def jpeg_bytes(array: np.ndarray, **save: Any) -> bytes:
    """An RGB or greyscale array as a JPEG (quality 90; ``save`` adds Pillow options)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90, **save)
    return buffer.getvalue()


def sample_jpegs() -> list[bytes]:
    """scikit-image's public-domain photos as JPEGs of different sizes and kinds."""
    from skimage import data

    return [
        jpeg_bytes(data.astronaut()),  # 512x512
        jpeg_bytes(data.coffee()),  # 600x400
        jpeg_bytes(data.chelsea()),  # 451x300
        jpeg_bytes(data.camera()),  # greyscale
        jpeg_bytes(data.rocket(), progressive=True),
    ]


TINY_CONFIG = """\
max_batch_size: 16
runners: 2
dynamic_batching:
  max_queue_delay_us: 1000
  max_queue_size: 256
"""


def tiny_model(folder: Path, config: str = TINY_CONFIG) -> Path:
    """``folder`` (made with its parents) holding the tiny model and ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(config)
    return folder


@pytest.fixture(scope="session")
def efficientnet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's folder (config from the repo, ONNX and labels generated once)."""
    import zoo

    folder = tmp_path_factory.mktemp("efficientnet") / "efficientnet_lite0"
    folder.mkdir()
    shutil.copy(ROOT / "models" / "efficientnet_lite0" / "config.yaml", folder)
    zoo.GENERATORS["efficientnet_lite0"](folder)
    return folder


def configure(folder: Path, overrides: dict[str, Any]) -> None:
    """Merge ``overrides`` into a model folder's config.yaml (nested mappings merge)."""

    def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        merged = dict(base)
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merged[key] = merge(base[key], value)
            else:
                merged[key] = value
        return merged

    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), overrides)))


# Every precision of the default model, with calibration small enough for a test run; the
# budgets are loose because a few dozen augmented photos calibrate INT8 only roughly.
ALL_PRECISIONS: dict[str, Any] = {
    "precisions": ["fp32", "fp16", "int8"],
    "int8": {"samples": 32, "calibrator": "minmax"},
    "accuracy": {
        "evaluation_samples": 16,
        "budgets": {"fp16": {"min_top1_agreement": 0.9}, "int8": {"min_top1_agreement": 0.5}},
    },
}


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory, efficientnet_dir: Path) -> Path:
    """A model repository with the default model (every precision) and the tiny model."""
    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    configure(repo / "efficientnet_lite0", ALL_PRECISIONS)
    tiny_model(repo / "tiny")
    return repo


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    """scikit-image's coffee photo (CC0), a cup of espresso, as a JPEG."""
    from PIL import Image
    from skimage import data

    buffer = io.BytesIO()
    Image.fromarray(data.coffee()).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def astronaut_png() -> bytes:
    from PIL import Image
    from skimage import data

    buffer = io.BytesIO()
    Image.fromarray(data.astronaut()).save(buffer, format="PNG")
    return buffer.getvalue()
