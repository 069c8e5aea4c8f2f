"""The TensorRT backend's build path with a real TensorRT: TensorRT for RTX, from PyPI.

TensorRT for RTX parses and builds strongly typed plans without a GPU (it specialises them
for the GPU when they load), so these tests run the project's own build code on the CPU:
``stoker build --backend tensorrt`` builds FP32, FP16 and INT8 (S8S8 Q/DQ) plans of the
default model into the engine store. Nothing here executes a plan: that needs a GPU of
compute capability 8.0, 8.6, 8.9 or 12.x (tests/gpu/test_tensorrt.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from app.cli import main
from engines.backends.tensorrt import build as tensorrt_build
from engines.backends.tensorrt import runtime as tensorrt_runtime
from tests.conftest import configure

rtx = pytest.importorskip(
    "tensorrt_rtx_bindings",
    reason="TensorRT for RTX is not installed (pip install -e '.[tensorrt-rtx]'; make test does)",
)
pytestmark = pytest.mark.skipif(
    tensorrt_runtime.flavour(tensorrt_runtime.tensorrt_module()) != tensorrt_runtime.TENSORRT_RTX,
    reason="TensorRT proper is installed and takes precedence; these tests are for RTX",
)


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, efficientnet_dir: Path
) -> tuple[Path, Path, str]:
    """(repository, store, what the first build printed), every precision built once."""
    root = tmp_path_factory.mktemp("rtx")
    folder = root / "repo" / "efficientnet_lite0"
    shutil.copytree(efficientnet_dir, folder)
    configure(
        folder,
        {
            "precisions": ["fp32", "fp16", "int8"],
            "int8": {"samples": 24, "calibrator": "minmax"},
            "accuracy": {"evaluation_samples": 16},
        },
    )
    store = root / "store"
    buffer = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(buffer):
        patch.setenv("STOKER_STORE__PATH", str(store))
        code = main(["build", "--repository", str(folder.parent), "--backend", "tensorrt"])
    assert code == 0, buffer.getvalue()
    return folder.parent, store, buffer.getvalue()


def manifests(store: Path) -> dict[str, dict[str, Any]]:
    """Precision -> the manifest of its stored plan."""
    found = {}
    for path in (store / "efficientnet_lite0").glob("*.plan.manifest.json"):
        manifest = json.loads(path.read_text())
        found[manifest["key"]["precision"]] = manifest
    return found


def test_every_precision_is_built_into_a_stored_plan(built: tuple[Path, Path, str]) -> None:
    _, store, out = built
    plans = manifests(store)
    assert set(plans) == {"fp32", "fp16", "int8"}
    version = f"tensorrt-rtx {rtx.__version__}"
    for precision, manifest in plans.items():
        key = manifest["key"]
        assert key["backend"] == "tensorrt" and key["backend_version"] == version
        assert key["device"] == tensorrt_runtime.JIT_DEVICE
        assert key["options"]["strongly_typed"] is True
        # The optimisation profile from the batching config: 1 / the largest preferred size
        # (32) / the max batch size (32).
        assert key["profile"] == [1, 32, 32]
        low, opt, high = key["options"]["shapes"]["input"]
        assert (low, opt, high) == ([1, 3, 224, 224], [32, 3, 224, 224], [32, 3, 224, 224])
        assert manifest["size"] > 1_000_000, precision
        assert f"efficientnet_lite0 {precision}: {version} plan for" in out
    # Half-precision and INT8 weights: the plans are about half of FP32's.
    assert plans["fp16"]["size"] < 0.7 * plans["fp32"]["size"]
    assert plans["int8"]["size"] < 0.7 * plans["fp32"]["size"]
    assert "specialised for the GPU when it loads" in out


def stored_variant(store: Path, precision: str) -> Path:
    (path,) = (store / "efficientnet_lite0").glob(f"engine-{precision}-tensorrt-*.onnx")
    return path


def test_the_networks_run_in_the_precision_of_their_variant(
    built: tuple[Path, Path, str], efficientnet_dir: Path
) -> None:
    _, store, _ = built
    fp32 = tensorrt_build.describe_network(efficientnet_dir / "model.onnx")
    fp16 = tensorrt_build.describe_network(stored_variant(store, "fp16"))
    int8 = tensorrt_build.describe_network(stored_variant(store, "int8"))
    for summary in (fp32, fp16, int8):
        assert summary.inputs == (("input", "FLOAT", (-1, 3, 224, 224)),)
        assert summary.outputs == (("logits", "FLOAT", (-1, 1000)),)
        assert summary.layers["CONVOLUTION"] == fp32.layers["CONVOLUTION"]
    assert "HALF" not in fp32.tensor_types and "INT8" not in fp32.tensor_types
    # FP16: nearly every tensor in half precision, the graph's inputs and outputs in FP32.
    assert fp16.tensor_types["HALF"] > 0.9 * fp32.tensor_types["FLOAT"]
    # INT8: explicit Q/DQ around the convolutions, symmetric (TensorRT takes no other).
    assert int8.layers["QUANTIZE"] >= fp32.layers["CONVOLUTION"]
    assert int8.layers["DEQUANTIZE"] >= int8.layers["QUANTIZE"]
    # Every QuantizeLinear's output, and the INT8 weights, are INT8 tensors.
    assert int8.tensor_types["INT8"] > int8.layers["QUANTIZE"]
    zero_points = [
        init
        for init in onnx.load(str(stored_variant(store, "int8"))).graph.initializer
        if init.name.endswith("_zero_point")
    ]
    assert zero_points
    assert all(not onnx.numpy_helper.to_array(z).any() for z in zero_points)


def test_a_second_build_loads_every_plan_from_the_store(
    built: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    repository, store, _ = built
    before = {p: m["sha256"] for p, m in manifests(store).items()}
    calls: list[str] = []
    monkeypatch.setattr(tensorrt_build, "build_plan", lambda *a, **k: calls.append("built"))
    monkeypatch.setenv("STOKER_STORE__PATH", str(store))
    assert main(["build", "--repository", str(repository), "--backend", "tensorrt"]) == 0
    assert calls == []
    assert {p: m["sha256"] for p, m in manifests(store).items()} == before


def test_parser_errors_name_the_node(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="fine"),
            helper.make_node("Unique", ["r"], ["y"], name="no_such_layer_in_tensorrt"),
        ],
        "unparseable",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "unparseable.onnx"
    onnx.save(model, str(path))
    with pytest.raises(tensorrt_build.BuildError, match=r"node 1 \(Unique 'no_such_layer_in"):
        tensorrt_build.describe_network(path)


@pytest.mark.parametrize(
    ("gpu", "capability", "runs"),
    [
        ("NVIDIA H200", (9, 0), False),
        ("NVIDIA GeForce RTX 3070", (8, 6), True),
        ("NVIDIA A100", (8, 0), True),
        ("NVIDIA RTX PRO 6000", (12, 0), True),
        ("Tesla T4", (7, 5), False),
    ],
)
def test_tensorrt_for_rtx_serves_only_the_gpus_it_runs_on(
    gpu: str, capability: tuple[int, int], runs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``auto`` asks before it picks TensorRT: a plan for no GPU where RTX runs, else a
    refusal that says which GPU and why."""
    from engines.devices import cuda

    monkeypatch.setattr(cuda, "device_properties", lambda device: (gpu, capability))
    if runs:
        target = tensorrt_runtime.current_target(0)
        assert target.jit and target.device_key() == tensorrt_runtime.JIT_DEVICE
    else:
        with pytest.raises(tensorrt_runtime.TensorRTUnavailable, match=f"does not run on {gpu}"):
            tensorrt_runtime.current_target(0)
    assert tensorrt_runtime.current_target(None).jit  # building needs no GPU at all
