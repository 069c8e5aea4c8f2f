"""The torch backend on a real GPU, against ONNX Runtime on the CPU as the reference."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch")

from engines.backends.onnxruntime import read_spec  # noqa: E402
from engines.backends.torch.convert import UnsupportedModel  # noqa: E402
from engines.backends.torch.engine import TorchEngine, TorchOptions, buckets  # noqa: E402
from engines.base import EngineOptions  # noqa: E402
from engines.devices.options import GpuOptions  # noqa: E402
from engines.preprocess import ImagePreprocess  # noqa: E402
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, run_python, tiny_onnx  # noqa: E402

MAX_BATCH = 8


def engine(path: Path, max_batch: int = MAX_BATCH, **options: object) -> TorchEngine:
    """A torch engine of ``path``, uncompiled unless ``gpu`` says otherwise: these tests are
    of the conversion and the runner; the compiled path (the served default) has its own."""
    spec = read_spec(path, path.parent.name, max_batch)
    options.setdefault("gpu", GpuOptions(compile="none"))
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


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-graph"])
def test_padding_never_reaches_a_response(efficientnet_onnx: Path, split: bool) -> None:
    """Every row count up to the max batch, as one padded graph (the default) and as graphs
    of its rows (``gpu.split_batches: true``)."""
    options = GpuOptions(compile="none", split_batches=split)
    runner = engine(efficientnet_onnx, precision="fp32", gpu=options).new_runner()
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


def test_a_batch_split_into_graphs_answers_as_one_graph(efficientnet_onnx: Path) -> None:
    """``gpu.split_batches``: 33, 45 and 100 rows run as two or three graphs (100: 64, 32
    and 4), each later graph's rows moved to the front of the input on the device; every
    row's answer is the reference's and in its place (a row answered from the wrong piece,
    or before its move, would not match). UINT8 pixels, the image input's second buffer."""
    split = engine(
        efficientnet_onnx,
        128,
        precision="fp32",
        image=ImagePreprocess(),
        gpu=GpuOptions(compile="none", split_batches=True),
    ).new_runner()
    try:
        assert split.pieces(45) == [32, 13] and split.rows_padded_to(45) == 48
        assert split.pieces(100) == [64, 32, 4]
        for rows in (33, 45, 100, 128):
            pixels = images(rows)
            got = split.run({"input": pixels})["logits"]
            assert got.shape == (rows, 1000)
            want = reference(efficientnet_onnx, normalized(pixels))
            for row in range(rows):  # each row its own answer, in its place
                assert relative_error(got[row], want[row]) < 1e-4, row
    finally:
        split.close()


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
    from app.engine.batcher import Batcher
    from app.engine.pool import RunnerPool
    from app.engine.repository import DynamicBatching
    from app.metrics import ModelMetrics

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


def gpu_run(script: str, *args: str, cache: Path | None = None) -> dict[str, Any]:
    """``run_python``; given ``cache``, with an empty Inductor cache of its own."""
    # Compiled in the process itself: a tiny graph's kernels compile faster than Inductor's
    # pool of compile workers starts.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return run_python(script, *args, env=env if cache is not None else None)


def test_compiled_matches_onnxruntime(efficientnet_onnx: Path) -> None:
    """``gpu.compile: default``: the module compiled by Inductor, then captured per bucket;
    float and UINT8 inputs, every row count, within the fp16 tolerance of the CPU reference."""
    compiled_engine = engine(
        efficientnet_onnx,
        precision="fp16",
        image=ImagePreprocess(),
        batch_buckets=(4, MAX_BATCH),
        gpu=GpuOptions(compile="default"),
    )
    runner = compiled_engine.new_runner()
    try:
        for rows in (1, 4, 5, MAX_BATCH):
            pixels = images(rows)
            want = reference(efficientnet_onnx, normalized(pixels))
            from_floats = runner.run({"input": normalized(pixels)})["logits"]
            from_pixels = runner.run({"input": pixels})["logits"]
            assert from_floats.shape == (rows, 1000)
            assert relative_error(from_floats, want) < 1e-2
            assert relative_error(from_pixels, want) < 1e-2
    finally:
        runner.close()
        compiled_engine.close()


ROUND_TRIP = """
import json, sys, time
from pathlib import Path

import numpy as np

from engines.backends.onnxruntime import read_spec
from engines.backends.torch import compiled
from engines.backends.torch.engine import TorchEngine, TorchOptions
from engines.base import EngineOptions
from engines.devices.options import GpuOptions
from engines.store import EngineStore

calls = []
compile_package = compiled.compile_package
compiled.compile_package = lambda *args: calls.append(1) or compile_package(*args)
source, root = Path(sys.argv[1]), Path(sys.argv[2])
started = time.perf_counter()
options = TorchOptions(precision="fp32", batch_buckets=(2, 4), gpu=GpuOptions(compile="default"))
store = EngineOptions(store=EngineStore(root))
engine = TorchEngine(source, read_spec(source, "tiny", 4), store, options)
runner = engine.new_runner()
ready_s = time.perf_counter() - started
x = np.arange(12, dtype=np.float32).reshape(3, 4) / 5 - 1
out = runner.run({"x": x})
print(json.dumps({"ready_s": ready_s, "x": x.tolist(), "y": out["y"].tolist(),
                  "compiles": len(calls), "packaged": engine.call(0) is not engine.module(0)}))
"""


def test_compiled_kernels_survive_a_restart_through_the_store(tmp_path: Path) -> None:
    """Two engine processes, each with an empty Inductor cache, sharing only the engine
    store: the first compiles one package for both buckets and stores it, the second loads
    it and compiles nothing. Both answer as numpy computes the graph."""
    from onnx import save

    source = tmp_path / "tiny.onnx"
    save(tiny_onnx(), str(source))
    store = tmp_path / "store"
    first = gpu_run(ROUND_TRIP, str(source), str(store), cache=tmp_path / "inductor-1")
    assert first["compiles"] == 1 and first["packaged"]  # one for buckets 2 and 4
    assert len(list(store.rglob("aoti-*.pt2"))) == 1
    second = gpu_run(ROUND_TRIP, str(source), str(store), cache=tmp_path / "inductor-2")
    assert second["compiles"] == 0 and second["packaged"]
    for result in (first, second):
        x = np.array(result["x"], dtype=np.float32)
        np.testing.assert_allclose(result["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


FIT = """
import json, sys
from pathlib import Path

import numpy as np
import torch

from engines.backends.onnxruntime import read_spec
from engines.backends.torch.engine import TorchEngine, TorchOptions
from engines.base import EngineOptions, ModelDoesNotFit
from engines.devices.options import GpuOptions

source, mode, gib = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
fraction = gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
# Uncompiled (as run on the H200 before compiling became the default): the fit is the point.
gpu = GpuOptions(compile="none", memory_fraction=fraction, on_out_of_memory=mode)
options = TorchOptions(precision="fp32", batch_buckets=(1, 16, 256), gpu=gpu)
engine = TorchEngine(source, read_spec(source, "resnet50", 256), EngineOptions(), options)
try:
    runner = engine.new_runner()
except ModelDoesNotFit as refused:
    print(json.dumps({"refused": str(refused)}))
    sys.exit(0)
rows = engine.spec.max_batch_size
x = np.random.default_rng(1).standard_normal((rows, 3, 224, 224)).astype(np.float32)
y = runner.run({"input": x})["logits"]
try:
    runner.run({"input": np.zeros((rows + 1, 3, 224, 224), np.float32)})
    over = "ran"
except ValueError as error:
    over = str(error)
print(json.dumps({"max_batch": rows, "buckets": engine.buckets, "over": over, "y": y.tolist(),
                  "reserved_gib": torch.cuda.memory_reserved(0) / 2**30}))
"""


def test_a_max_batch_that_does_not_fit_is_refused_or_shrunk(resnet50_onnx: Path) -> None:
    """ResNet-50 FP32 with batches up to 256 in 1.5 GiB of the GPU (the engine process's
    allocator capped by ``gpu.memory_fraction``): batch 256 (over 0.8 GB for one activation
    of the first convolution) cannot fit; refused, the message names the largest batch that
    does; shrunk, the engine serves that batch, refuses one more row, and stays under the cap."""
    refused = gpu_run(FIT, str(resnet50_onnx), "refuse", "1.5")
    message = refused["refused"]
    assert "a batch of 256 does not fit" in message
    largest = int(message.split("the largest that fits is ")[1].split(":")[0])
    assert largest in (1, 16)

    served = gpu_run(FIT, str(resnet50_onnx), "shrink", "1.5")
    assert served["max_batch"] == largest and max(served["buckets"]) == largest
    assert "exceeds the max batch size" in served["over"]
    assert served["reserved_gib"] <= 1.5
    x = np.random.default_rng(1).standard_normal((largest, 3, 224, 224)).astype(np.float32)
    assert relative_error(np.array(served["y"]), reference(resnet50_onnx, x)) < 1e-3


def test_a_graph_inductor_cannot_compile_is_served_uncompiled(
    efficientnet_onnx: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Compiling failing on a graph (here: a compiler that raises, standing in for an
    Inductor error) leaves the model served as converted, with a warning that says so."""
    from engines.backends.torch import compiled

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Inductor: no kernel for this op")

    monkeypatch.setattr(compiled, "compile_package", broken)
    plain = engine(
        efficientnet_onnx,
        precision="fp32",
        batch_buckets=(4, MAX_BATCH),
        gpu=GpuOptions(compile="default"),
    )
    with caplog.at_level("WARNING"):
        runner = plain.new_runner()
    try:
        x = normalized(images(3))
        assert (
            relative_error(runner.run({"input": x})["logits"], reference(efficientnet_onnx, x))
            < 1e-4
        )
    finally:
        runner.close()
        plain.close()
    assert "compiling failed on GPU 0 (RuntimeError: Inductor: no kernel" in caplog.text
