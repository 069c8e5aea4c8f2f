"""JPEG uploads decoded on the GPU (nvJPEG through torchvision), the service on the torch
backend end to end, and runners placed on several GPUs."""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch", reason="the GPU tests need torch")

from engines.devices.options import GpuOptions  # noqa: E402
from engines.preprocess import ImagePreprocess, preprocess  # noqa: E402
from tests.conftest import configure, sample_jpegs  # noqa: E402
from tests.integration.conftest import (  # noqa: E402
    Server,
    metric_samples,
    start_server,
    stop_server,
)

if TYPE_CHECKING:
    from engines.backends.torch.images import TorchImageDecoder

ESPRESSO = 967
JPEG = {"Content-Type": "image/jpeg"}


def decoder(spec: ImagePreprocess) -> TorchImageDecoder:
    pytest.importorskip("torchvision", reason="GPU JPEG decode needs torchvision")
    from engines.backends.torch.images import TorchImageDecoder

    return TorchImageDecoder(spec, "cuda:0")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_nvjpeg_batches_give_the_pixels_pillow_gives(layout: Literal["NCHW", "NHWC"]) -> None:
    """nvJPEG's IDCT and chroma upsampling differ from libjpeg's by a level or two; after
    the shared resize and crop the rows stay that close to the CPU path's."""
    spec = ImagePreprocess(layout=layout, datatype="UINT8")
    gpu = decoder(spec)
    uploads = sample_jpegs()
    rows, ok = gpu.decode(uploads)
    assert ok == [True] * len(uploads) and rows.tensor.device.type == "cuda"
    for data, row in zip(uploads, np.asarray(rows), strict=True):
        want = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), spec)
        assert row.shape == want.shape and row.dtype == np.uint8
        diff = np.abs(row.astype(np.int16) - want)
        assert diff.mean() < 2.0 and np.percentile(diff, 99) <= 8, (diff.mean(), diff.max())


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_resize_kernel_gives_the_matrix_forms_rows_on_the_gpu(
    layout: Literal["NCHW", "NHWC"],
) -> None:
    """The one-launch Triton resize (the decoder's default on a GPU) and the matrix products
    on the same nvJPEG images, the sample photos and the labelled photos of many sizes in
    one batch, in either layout: nearly every pixel equal, and fewer than one in 100,000 two
    levels apart (an exact half between the passes rounded one way by each form's float
    sums, over every row of a flat patch, puts the second pass a whole level apart before
    its own rounding; on an H100, 125 photos: 4 of 18.8 M values, mean 0.0014)."""
    pytest.importorskip("triton", reason="the resize kernel needs Triton")
    pytest.importorskip("torchvision", reason="GPU JPEG decode needs torchvision")
    from engines.backends.torch.images import TorchImageDecoder

    spec = ImagePreprocess(layout=layout, datatype="UINT8")
    uploads = sample_jpegs() + [path.read_bytes() for path in photos()[:120]]
    kernel = TorchImageDecoder(spec, "cuda:0")
    matrix = TorchImageDecoder(spec, "cuda:0", kernel=False)
    assert kernel.kernel and not matrix.kernel
    rows, ok = kernel.decode(uploads)
    want, want_ok = matrix.decode(uploads)
    assert ok == want_ok == [True] * len(uploads)
    diff = np.abs(np.asarray(rows).astype(np.int16) - np.asarray(want))
    print(
        f"{len(uploads)} photos: kernel against matrices, max {diff.max()}, mean "
        f"{diff.mean():.4f}, {int((diff > 1).sum())} of {diff.size} values over one level"
    )
    assert diff.max() <= 2 and (diff > 1).mean() < 1e-5 and diff.mean() < 0.01


def test_an_image_nvjpeg_refuses_costs_only_itself() -> None:
    gpu = decoder(ImagePreprocess(datatype="UINT8"))
    good = sample_jpegs()[:2]
    rows, ok = gpu.decode([good[0], b"\xff\xd8\xff\xe0" + bytes(200), good[1]])
    assert ok == [True, False, True]
    host = np.asarray(rows)
    assert host[0].any() and host[2].any() and not host[1].any()


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_nvimgcodec_batches_give_the_pixels_pillow_gives_and_refuse_alone(share: float) -> None:
    """nvImageCodec on the GPU (``share`` of the batch to the hardware JPEG engines, the rest
    to CUDA) through the batched decoder: the rows as close to the CPU path's as nvJPEG's
    (run 45: within 1.2 levels of torchvision's pixels), a broken JPEG refused alone."""
    pytest.importorskip("nvidia.nvimgcodec", reason="nvidia-nvimgcodec-cu13 is not installed")
    from functools import partial

    from engines.backends.torch import nvimgcodec
    from engines.backends.torch.images import TorchImageDecoder

    spec = ImagePreprocess(datatype="UINT8")
    decode = partial(nvimgcodec.decode_jpeg, hardware_share=share)
    uploads = [*sample_jpegs(), b"\xff\xd8\xff\xe0" + bytes(200)]
    rows, ok = TorchImageDecoder(spec, "cuda:0", decode).decode(uploads)
    assert ok == [True] * (len(uploads) - 1) + [False]
    assert rows.tensor.device.type == "cuda"
    host = np.asarray(rows)
    assert not host[-1].any()
    for data, row in zip(uploads[:-1], host, strict=False):
        want = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), spec)
        diff = np.abs(row.astype(np.int16) - want)
        assert diff.mean() < 2.0 and np.percentile(diff, 99) <= 8, (diff.mean(), diff.max())


def test_a_decode_process_hands_back_the_in_process_decoders_rows_on_the_gpu() -> None:
    """The decoder in a child process writes into CUDA IPC memory the engine allocated; the
    rows come back on the GPU, the same as the decoder in this process gives (same nvJPEG,
    same resize), over more images than its buffer holds."""
    from engines.backends.torch.decode_process import DecodeProcess

    spec = ImagePreprocess(datatype="UINT8")
    here = decoder(spec)
    uploads: list[bytes | None] = [*sample_jpegs(), b"\xff\xd8\xff\xe0" + bytes(200)]
    child = DecodeProcess(spec, "cuda:0", rows=4, label="gpu-test")
    try:
        for batch in (uploads[:4], uploads):
            rows, ok = child(batch)
            want, want_ok = here.decode(batch)
            assert rows.tensor.device.type == "cuda" and ok == want_ok
            diff = np.abs(np.asarray(rows).astype(np.int16) - np.asarray(want))
            assert diff.max() <= 1, diff.max()  # parts of 4 pad their groups differently
        assert ok == [True] * (len(uploads) - 1) + [False]
    finally:
        child.close()


def photos() -> list[Path]:
    """Labelled photos for the agreement check: ``STOKER_PHOTOS``, or the sample beside the
    checkout, or ``.carry/photos`` (a copy carried to the GPU machine, never committed)."""
    import os

    root = Path(__file__).resolve().parents[2]
    for folder in (
        os.environ.get("STOKER_PHOTOS", ""),
        root.parent / "shared" / "data" / "imagenet-sample",
        root / ".carry" / "photos",
    ):
        if folder and Path(folder).is_dir():
            return sorted(Path(folder).glob("*.JPEG"))
    return []


def test_gpu_decoded_rows_give_the_top1_pillows_rows_give(efficientnet_dir: Path) -> None:
    """The issue's bound: on real photos, the label from nvJPEG + the batched resize agrees
    with the label from Pillow's decode and resize on at least 99% (the same ONNX Runtime
    FP32 session scores both)."""
    import onnxruntime as ort

    paths = photos()
    if len(paths) < 100:
        pytest.skip("needs the labelled photos (STOKER_PHOTOS or ../shared/data/imagenet-sample)")
    spec = ImagePreprocess(datatype="UINT8")
    datas = [path.read_bytes() for path in paths]
    gpu = decoder(spec)
    device_rows = []
    for start in range(0, len(datas), 64):
        rows, ok = gpu.decode(datas[start : start + 64])
        assert all(ok)
        device_rows.append(np.asarray(rows))
    on_gpu = np.concatenate(device_rows)
    on_cpu = np.stack([preprocess(Image.open(io.BytesIO(d)).convert("RGB"), spec) for d in datas])
    session = ort.InferenceSession(
        str(efficientnet_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )

    def top1(pixels: np.ndarray) -> np.ndarray:
        floats = ((pixels.astype(np.float32) - 127.0) / 128.0).astype(np.float32)
        logits = [
            session.run(None, {"input": floats[i : i + 32]})[0] for i in range(0, len(floats), 32)
        ]
        return np.argmax(np.concatenate(logits), axis=1)

    agree = float(np.mean(top1(on_gpu) == top1(on_cpu)))
    diff = np.abs(on_gpu.astype(np.int16) - on_cpu)
    print(f"{len(datas)} photos: top-1 agreement {agree:.4f}, pixel diff mean {diff.mean():.3f}")
    assert agree >= 0.99


def test_device_rows_feed_the_runner_as_host_rows_do(efficientnet_dir: Path) -> None:
    """Rows left on the GPU by the decoder, alone or beside host rows in one batch, give the
    runner's answers for the same pixels sent from the host."""
    from engines.backends.onnxruntime import read_spec
    from engines.backends.torch.engine import load
    from engines.backends.torch.images import DeviceRows
    from engines.base import EngineOptions

    path = efficientnet_dir / "model.onnx"
    spec = read_spec(path, "efficientnet_lite0", 8)
    options = EngineOptions(runners=1, image=ImagePreprocess(), gpu=GpuOptions(compile="none"))
    engine = load(path, spec, options)
    runner = engine.new_runner()
    try:
        pixels = np.random.default_rng(3).integers(0, 256, (5, 3, 224, 224), dtype=np.uint8)
        on_device: Any = DeviceRows(torch.from_numpy(pixels).cuda())  # array-like rows
        want = runner.run_blocks([{"input": pixels}])["logits"]
        alone = runner.run_blocks([{"input": on_device}])["logits"]
        mixed = runner.run_blocks(
            [{"input": pixels[:2]}, {"input": on_device[2:4]}, {"input": pixels[4:]}]
        )["logits"]
        # Requests' rows sliced from one decoded batch, in order (joined into one copy),
        # out of order and beside host rows (copied block by block).
        sliced = runner.run_blocks([{"input": on_device[i : i + 1]} for i in range(5)])["logits"]
        shuffled = runner.run_blocks([{"input": on_device[3:5]}, {"input": on_device[0:3]}])[
            "logits"
        ]
        between = runner.run_blocks(
            [{"input": on_device[0:1]}, {"input": pixels[1:2]}, {"input": on_device[2:5]}]
        )["logits"]
        np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(mixed, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sliced, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            shuffled, np.concatenate([want[3:], want[:3]]), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(between, want, rtol=1e-5, atol=1e-5)
    finally:
        runner.close()
        engine.close()


def test_rows_in_registered_memory_are_read_by_dma_with_the_same_answers(
    efficientnet_dir: Path,
) -> None:
    """Rows in host memory registered with CUDA (as the engine registers a front end's
    shared-memory arena) are copied from there straight to the GPU; alone, and beside
    pageable and device rows in one batch, they give the answers of the same pixels sent
    through the runner's pinned buffer."""
    import mmap

    from engines.backends.onnxruntime import read_spec
    from engines.backends.torch.engine import load
    from engines.backends.torch.images import DeviceRows
    from engines.backends.torch.runner import pinned
    from engines.base import EngineOptions
    from engines.devices import cuda

    path = efficientnet_dir / "model.onnx"
    spec = read_spec(path, "efficientnet_lite0", 8)
    options = EngineOptions(runners=1, image=ImagePreprocess(), gpu=GpuOptions(compile="none"))
    engine = load(path, spec, options)
    runner = engine.new_runner()
    arena = mmap.mmap(-1, 8 << 20)  # shared-memory arenas are mmaps too
    address = np.frombuffer(arena, dtype=np.uint8).ctypes.data
    try:
        pixels = np.random.default_rng(4).integers(0, 256, (6, 3, 224, 224), dtype=np.uint8)
        assert cuda.register_host(address, len(arena))
        region = np.frombuffer(arena, dtype=np.uint8, count=pixels.nbytes).reshape(pixels.shape)
        region[:] = pixels
        assert pinned(region) and not pinned(pixels)
        on_device: Any = DeviceRows(torch.from_numpy(pixels).cuda())
        want = runner.run_blocks([{"input": pixels}])["logits"]
        alone = runner.run_blocks([{"input": region}])["logits"]
        mixed = runner.run_blocks(
            [
                {"input": region[:2]},
                {"input": pixels[2:3]},
                {"input": pixels[3:4]},
                {"input": on_device[4:5]},
                {"input": region[5:]},
            ]
        )["logits"]
        np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(mixed, want, rtol=1e-5, atol=1e-5)
        del region
    finally:
        cuda.unregister_host(address)
        runner.close()
        engine.close()
    assert not cuda.host_registered(address, 1)
    arena.close()


def serve_on_gpu(
    efficientnet_dir: Path, tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]
) -> Server:
    """A real ``stoker serve`` of the default model on the torch backend (FP32)."""
    pytest.importorskip("torchvision", reason="GPU JPEG decode needs torchvision")
    root = tmp_path_factory.mktemp("gpu-serve")
    shutil.copytree(efficientnet_dir, root / "repo" / "efficientnet_lite0")
    configure(root / "repo" / "efficientnet_lite0", {"precisions": ["fp32"], "runners": 2})
    return start_server(
        root / "repo", root / "server.log", {"STOKER_MODELS__BACKEND": "torch", **env}
    )


@pytest.fixture(scope="module")
def gpu_server(
    efficientnet_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The default service (its JPEG decoders in processes of their own)."""
    server = serve_on_gpu(
        efficientnet_dir, tmp_path_factory, {"STOKER_UPLOADS__IMAGE_DECODE": "auto"}
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def gpu_server_decode_threads(
    efficientnet_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The same service with its JPEG decoder in a thread of the engine."""
    server = serve_on_gpu(
        efficientnet_dir, tmp_path_factory, {"STOKER_UPLOADS__DECODE_PROCESSES": "0"}
    )
    yield server
    stop_server(server)


def uploads_answer_espresso_all_on_the_gpu(server: Server, coffee_jpeg: bytes, count: int) -> None:
    """``count`` concurrent uploads each answer espresso, and every one went through nvJPEG
    (none fell back to Pillow)."""
    labels = {"model": "efficientnet_lite0", "version": "fp32"}

    def decoded(device: str) -> float:
        decoder = {"gpu": "torchvision", "cpu": "pillow"}[device]
        named = {**labels, "device": device, "decoder": decoder}
        key = ("stoker_image_decode_total", tuple(sorted(named.items())))
        return metric_samples(server).get(key, 0.0)

    before = decoded("gpu"), decoded("cpu")

    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                *(client.post("/infer", content=coffee_jpeg, headers=JPEG) for _ in range(count))
            )

    for response in asyncio.run(many()):
        assert response.status_code == 200, response.text
        assert response.json()["predictions"][0][0]["label"] == "espresso"
    assert (decoded("gpu"), decoded("cpu")) == (before[0] + count, before[1])


def test_jpeg_uploads_are_decoded_on_the_gpu_and_answer_espresso(
    gpu_server: Server, coffee_jpeg: bytes
) -> None:
    log = gpu_server.log.read_text()
    assert "torch backend" in log
    assert (
        "JPEG uploads decoded on the GPU by torchvision "
        "(2 decode processes, 1 batch in flight each)" in log
    )
    assert "pixels normalised on the device" in log
    uploads_answer_espresso_all_on_the_gpu(gpu_server, coffee_jpeg, 48)


def test_a_decoder_thread_in_the_engine_serves_uploads_as_the_processes_do(
    gpu_server_decode_threads: Server, coffee_jpeg: bytes
) -> None:
    server = gpu_server_decode_threads
    assert "JPEG uploads decoded on the GPU by torchvision (1 decoder thread in the engine)" in (
        server.log.read_text()
    )
    uploads_answer_espresso_all_on_the_gpu(server, coffee_jpeg, 96)


def test_uint8_pixels_on_the_gpu_answer_as_fp32_does(
    gpu_server: Server, coffee_jpeg: bytes
) -> None:
    photo = Image.open(io.BytesIO(coffee_jpeg)).convert("RGB")
    pixels = preprocess(photo, ImagePreprocess(datatype="UINT8"))[None]
    floats = preprocess(photo, ImagePreprocess())[None]
    answers = []
    for x, datatype in ((pixels, "UINT8"), (floats, "FP32")):
        tensor = {"name": "input", "shape": list(x.shape), "datatype": datatype}
        body = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
        response = httpx.post(
            f"{gpu_server.url}/v2/models/efficientnet_lite0/infer", json=body, timeout=60
        )
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        answers.append(np.asarray(output["data"], dtype=np.float32).reshape(output["shape"]))
    np.testing.assert_allclose(answers[0], answers[1], rtol=1e-3, atol=1e-3)
    assert int(np.argmax(answers[0])) == ESPRESSO


def test_runners_are_spread_over_two_gpus(efficientnet_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    import onnxruntime as ort

    from engines.backends.onnxruntime import read_spec
    from engines.backends.torch.engine import load
    from engines.base import EngineOptions

    path = efficientnet_dir / "model.onnx"
    spec = read_spec(path, "efficientnet_lite0", 8)
    options = EngineOptions(
        runners=4, devices=(0, 1), image=ImagePreprocess(), gpu=GpuOptions(compile="none")
    )  # placement is the point; the compiled engine has its tests in test_torch_backend.py
    engine = load(path, spec, options)
    runners = [engine.new_runner() for _ in range(4)]
    assert [r.device for r in runners] == [0, 1, 0, 1]
    pixels = np.random.default_rng(5).integers(0, 256, (3, 3, 224, 224), dtype=np.uint8)
    floats = ((pixels.astype(np.float32) - 127.0) / 128.0).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"input": floats})
    for runner in runners:
        got = runner.run({"input": pixels})["logits"]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4
        runner.close()
    assert all(torch.cuda.memory_allocated(d) > 0 for d in (0, 1))
    engine.close()
