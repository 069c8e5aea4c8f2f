"""The torch backend on a real GPU, against ONNX Runtime on the CPU as the reference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch")

from engines.backends.onnxruntime import read_spec  # noqa: E402
from engines.backends.torch.convert import UnsupportedModel  # noqa: E402
from engines.backends.torch.engine import TorchEngine, TorchOptions, buckets  # noqa: E402
from engines.base import EngineOptions  # noqa: E402
from engines.preprocess import ImagePreprocess  # noqa: E402

MAX_BATCH = 8


def engine(path: Path, max_batch: int = MAX_BATCH, **options: object) -> TorchEngine:
    spec = read_spec(path, path.parent.name, max_batch)
    return TorchEngine(path, spec, EngineOptions(), TorchOptions(**options))  # type: ignore[arg-type]


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    result: np.ndarray = session.run(None, {session.get_inputs()[0].name: x})[0]
    return result


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def images(rows: int) -> np.ndarray:
    """Fresh random pixels each call: the check must hold on any valid input."""
    return np.random.default_rng().integers(0, 256, (rows, 3, 224, 224), dtype=np.uint8)


def normalized(pixels: np.ndarray) -> np.ndarray:
    return ((pixels.astype(np.float32) - 127.0) / 128.0).astype(np.float32)


@pytest.fixture(scope="module")
def efficientnet_onnx(efficientnet_dir: Path) -> Path:
    return efficientnet_dir / "model.onnx"


def test_buckets_cover_powers_of_two_preferred_and_max() -> None:
    assert buckets(48, (24,)) == [1, 2, 4, 8, 16, 24, 32, 48]
    assert buckets(1) == [1]


@pytest.mark.parametrize(
    ("precision", "tolerance"), [("fp32", 1e-4), ("tf32", 1e-2), ("fp16", 1e-2), ("bf16", 1e-1)]
)
def test_matches_onnxruntime(efficientnet_onnx: Path, precision: str, tolerance: float) -> None:
    x = normalized(images(5))
    want = reference(efficientnet_onnx, x)
    runner = engine(efficientnet_onnx, precision=precision).new_runner()
    try:
        got = runner.run({"input": x})["logits"]
    finally:
        runner.close()
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    assert relative_error(got, want) < tolerance
    if precision in ("fp32", "tf32", "fp16"):
        assert (got.argmax(1) == want.argmax(1)).mean() >= 0.8


def test_resnet50_fp16_channels_last(resnet50_onnx: Path) -> None:
    x = normalized(images(3))
    runner = engine(resnet50_onnx, precision="fp16").new_runner()
    try:
        got = runner.run({"input": x})["logits"]
    finally:
        runner.close()
    assert relative_error(got, reference(resnet50_onnx, x)) < 2e-2


def test_padding_never_reaches_a_response(efficientnet_onnx: Path) -> None:
    runner = engine(efficientnet_onnx, precision="fp32").new_runner()
    try:
        poison = np.full((MAX_BATCH, 3, 224, 224), np.nan, dtype=np.float32)
        assert np.isnan(runner.run({"input": poison})["logits"]).all()
        x = normalized(images(3))  # bucket 4: one padding row, left over from the NaN batch
        got = runner.run({"input": x})["logits"]
        assert got.shape == (3, 1000) and np.isfinite(got).all()
        for rows in range(1, MAX_BATCH + 1):
            batch = normalized(images(rows))
            out = runner.run({"input": batch})["logits"]
            assert out.shape == (rows, 1000)
            assert relative_error(out, reference(efficientnet_onnx, batch)) < 1e-4
        with pytest.raises(ValueError, match="exceeds the max batch size"):
            runner.run({"input": normalized(images(MAX_BATCH + 1))})
    finally:
        runner.close()


def test_uint8_pixels_are_normalized_on_the_gpu(efficientnet_onnx: Path) -> None:
    runner = engine(efficientnet_onnx, precision="fp32", image=ImagePreprocess()).new_runner()
    try:
        pixels = images(4)
        from_pixels = runner.run({"input": pixels})["logits"]
        from_floats = runner.run({"input": normalized(pixels)})["logits"]
    finally:
        runner.close()
    assert relative_error(from_pixels, from_floats) < 1e-5
    assert relative_error(from_pixels, reference(efficientnet_onnx, normalized(pixels))) < 1e-4


def test_eager_mode_matches_graphs(efficientnet_onnx: Path) -> None:
    x = normalized(images(2))
    eager = engine(efficientnet_onnx, precision="fp32", cuda_graphs=False).new_runner()
    graphs = engine(efficientnet_onnx, precision="fp32").new_runner()
    try:
        assert (
            relative_error(eager.run({"input": x})["logits"], graphs.run({"input": x})["logits"])
            < 1e-5
        )
    finally:
        eager.close()
        graphs.close()


def test_wrong_datatype_is_refused(efficientnet_onnx: Path) -> None:
    runner = engine(efficientnet_onnx, max_batch=2, precision="fp32").new_runner()
    try:
        with pytest.raises(ValueError, match="expected float32"):
            runner.run({"input": np.zeros((1, 3, 224, 224), dtype=np.float64)})
        with pytest.raises(ValueError, match="uint8, expected float32"):
            runner.run({"input": images(1)})
    finally:
        runner.close()


def test_unsupported_op_is_named(tmp_path: Path) -> None:
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Erf", ["x"], ["y"], name="erf0")],
        "erf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "model.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsupportedModel, match=r"Erf .*erf0"):
        engine(path)


def test_pool_and_batcher_drive_torch_runners(efficientnet_onnx: Path) -> None:
    """Concurrent requests through the real batcher and two GPU runners: every request gets
    its own rows back, batches form, and the results match the CPU reference."""
    from app.batcher import Batcher
    from app.metrics import ModelMetrics
    from app.pool import RunnerPool
    from app.repository import DynamicBatching

    torch_engine = engine(efficientnet_onnx, precision="fp32")
    requests = [normalized(images(1 + i % 3)) for i in range(24)]

    async def scenario() -> list[np.ndarray]:
        pool = await RunnerPool.create(torch_engine, 2, "gpu-test")
        await pool.warm()
        metrics = ModelMetrics("gpu-test", "fp32")
        policy = DynamicBatching(max_queue_delay_us=20_000, preferred_batch_size=[8])
        batcher = Batcher(pool, policy, metrics, MAX_BATCH)
        batcher.start()
        try:
            results = await asyncio.gather(
                *(batcher.infer({"input": r}, len(r), ("img",), 30.0) for r in requests)
            )
            assert metrics.execution_count < len(requests)
            return [r["logits"] for r in results]
        finally:
            await batcher.close(5.0)
            await asyncio.to_thread(pool.close)

    outputs = asyncio.run(scenario())
    for request, got in zip(requests, outputs, strict=True):
        assert got.shape == (len(request), 1000)
        assert relative_error(got, reference(efficientnet_onnx, request)) < 1e-4
