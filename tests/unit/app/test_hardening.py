"""Hardening without I/O: an unrecoverable engine fault stops a model for good, decompression
bombs are refused from the header, model names cannot leave the repository, no file is
unpickled or YAML-loaded unsafely, and pathological JSON costs linear time.
"""

from __future__ import annotations

import asyncio
import io
import re
import struct
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app import image_pixels
from app.engine.batcher import Batcher
from app.engine.folders import ConfigError
from app.engine.pool import RunnerPool
from app.engine.repository import DynamicBatching, discover
from app.errors import BadRequest, EngineError, PayloadTooLarge, Unavailable
from app.image_header import UPLOAD_FORMATS, read_header, screen_upload
from app.metrics import ModelMetrics
from app.protocol import decode_request
from app.settings import LimitSettings
from engines.base import FatalEngineError
from engines.spec import ModelSpec, TensorSpec

ROOT = Path(__file__).resolve().parents[3]


SPEC = ModelSpec("fatal", (TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1,)),), 8)


class BrokenDevice:
    """Doubles its input; a batch holding -1 raises FatalEngineError, as a runner does when
    its CUDA context is gone. ``gate`` holds runs until set."""

    backend = "fake"
    pixel_input: str | None = None

    def __init__(self) -> None:
        self.spec = SPEC
        self.gate = threading.Event()
        self.gate.set()
        self.rows_run = 0

    def new_runner(self) -> BrokenDevice:
        return self

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.gate.wait(timeout=10)
        x = inputs["x"]
        if (x == -1).any():
            raise FatalEngineError("CUDA error: an illegal memory access was encountered")
        self.rows_run += len(x)
        return {"y": x * 2}

    def close(self) -> None:
        pass


def test_a_fatal_engine_fault_fails_its_batch_then_stops_the_model() -> None:
    """The batch that hit the fault gets 500; what was queued behind it and everything after
    gets 503 (another replica can serve it); the batcher reports itself failed, which turns
    model readiness, server readiness and liveness off (DataPlane.alive / is_ready)."""
    engine = BrokenDevice()

    async def scenario() -> None:
        pool = await RunnerPool.create(engine, 1, "fatal")
        batcher = Batcher(
            pool, DynamicBatching(max_queue_delay_us=0), ModelMetrics("fatal", "fp32"), 8
        )
        batcher.start()
        one = {"x": np.ones((1, 2), np.float32)}
        key = ((2,),)
        healthy = await batcher.infer(one, 1, key, None)
        assert healthy["y"].tolist() == [[2.0, 2.0]]

        engine.gate.clear()
        blocker = asyncio.create_task(batcher.infer({"x": -np.ones((1, 2), np.float32)}, 1, key, 5))
        await asyncio.sleep(0.05)
        queued = [
            asyncio.create_task(batcher.infer({"x": np.ones((1, 3), np.float32)}, 1, ((3,),), 5))
            for _ in range(3)
        ]
        await asyncio.sleep(0.05)
        engine.gate.set()
        with pytest.raises(EngineError, match="illegal memory access"):
            await blocker
        for task in queued:
            with pytest.raises(Unavailable):
                await task
        assert isinstance(batcher.failed, FatalEngineError)
        with pytest.raises(Unavailable):
            await batcher.infer(one, 1, key, 5)
        assert batcher.queued == 0
        await batcher.close(1)
        await asyncio.to_thread(pool.close)

    asyncio.run(scenario())
    assert engine.rows_run == 1, "nothing ran after the fault"


def test_an_ordinary_engine_error_fails_only_its_batch() -> None:
    class Flaky(BrokenDevice):
        def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            if (inputs["x"] == 13).any():
                raise RuntimeError("ORT: indices element out of data bounds")
            return super().run(inputs)

    engine = Flaky()

    async def scenario() -> None:
        pool = await RunnerPool.create(engine, 1, "flaky")
        batcher = Batcher(
            pool, DynamicBatching(max_queue_delay_us=0), ModelMetrics("flaky", "fp32"), 8
        )
        batcher.start()
        with pytest.raises(EngineError):
            await batcher.infer({"x": np.full((1, 2), 13, np.float32)}, 1, ((2,),), 5)
        result = await batcher.infer({"x": np.ones((2, 2), np.float32)}, 2, ((2,),), 5)
        assert result["y"].tolist() == [[2.0, 2.0], [2.0, 2.0]]
        assert batcher.failed is None
        await batcher.close(1)
        await asyncio.to_thread(pool.close)

    asyncio.run(scenario())


def png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width`` x ``height`` black pixels: a few hundred kB on the wire,
    gigabytes once decoded to RGB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    row = b"\0" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    compressed = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return png_bomb(30_000, 30_000)


def test_a_decompression_bomb_is_refused_from_its_header(bomb: bytes) -> None:
    assert len(bomb) < 200_000
    started = time.perf_counter()
    # Pillow's own guard (twice its MAX_IMAGE_PIXELS) or ours, whichever speaks first.
    with pytest.raises(PayloadTooLarge, match=r"30000x30000|900000000 pixels"):
        image_pixels.decode(bomb, LimitSettings().max_image_pixels)
    assert time.perf_counter() - started < 0.5, "refused before decoding"


def test_the_pixel_limit_is_a_setting() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (200, 100)).save(buffer, format="PNG")
    assert image_pixels.decode(buffer.getvalue(), 20_000).size == (200, 100)
    with pytest.raises(PayloadTooLarge, match="limit is 19999"):
        image_pixels.decode(buffer.getvalue(), 19_999)
    with pytest.raises(BadRequest):
        image_pixels.decode(buffer.getvalue()[:40], 20_000)


def test_limits_have_safe_defaults() -> None:
    limits = LimitSettings()
    assert limits.max_body_bytes == 64 * 1024 * 1024
    assert limits.max_image_pixels <= 89_478_485, "at most Pillow's own bomb threshold"
    assert limits.max_images_per_request <= 64
    assert limits.max_json_depth == 64


@pytest.mark.parametrize(
    "name", ["../x", "..", ".", "../../etc", "/etc", "/tmp/models/tiny", "a/../../x", ".hidden"]
)
def test_model_names_cannot_leave_the_repository(tmp_path: Path, name: str) -> None:
    repository = tmp_path / "repository"
    (repository / "tiny").mkdir(parents=True)
    (repository / "tiny" / "config.yaml").write_text("max_batch_size: 4\n")
    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "config.yaml").write_text("max_batch_size: 4\n")
    with pytest.raises(ConfigError, match="no "):
        discover(repository, [name])
    assert [e.config.name for e in discover(repository, ["tiny"])] == ["tiny"]


def test_pathological_json_nesting_costs_linear_time() -> None:
    """Two million values beside one value nested 63 deep (8 MB): the flattening used to
    re-scan every value once per level, 16 s of CPU; now each value is visited once."""
    deep = "[" * 63 + "1.0" + "]" * 63
    values = ",".join(["1.0"] * 2_000_000)
    body = (
        '{"inputs":[{"name":"x","datatype":"FP32","shape":[2000001],"data":['
        + values
        + ","
        + deep
        + "]}]}"
    ).encode()
    spec = ModelSpec("m", (TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1,)),))
    started = time.perf_counter()
    decoded = decode_request(body, None, spec)
    assert time.perf_counter() - started < 3.0
    assert decoded.inputs["x"].shape == (2_000_001,)


UNSAFE_LOADS = re.compile(
    r"pickle\.loads?\(|torch\.load\(|allow_pickle\s*=\s*True|yaml\.load\(|yaml\.unsafe_load|"
    r"marshal\.loads?\(|shelve\.open\(|dill\.|joblib\.load\("
)


def test_no_file_is_unpickled_or_yaml_loaded_unsafely() -> None:
    """Nothing in the service, the engine layer, the zoo or the bench unpickles a file, loads
    YAML with tags, or asks numpy to allow pickles. The one pickle reader, the zoo's checkpoint
    reader, resolves only the globals a state dict needs: tests/unit/zoo/test_zoo.py
    (test_reader_refuses_a_pickle_that_would_run_code) proves a hostile pickle is refused. Engine
    files are loaded only through a manifest and checksum: tests/unit/engines/test_store.py."""
    offenders = []
    for package in ("app", "engines", "zoo", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if UNSAFE_LOADS.search(line.split("#")[0]):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def png_of(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def test_an_aspect_ratio_bomb_is_refused_from_its_header() -> None:
    """A 1x8000 PNG is ~100 bytes; resized to a shorter side of 256 it would be 256x2,048,000
    pixels (1.5 GB of RGB) before the crop."""
    limit = LimitSettings().max_image_aspect_ratio
    for size in ((1, 8000), (8000, 1), (10, 400)):
        data = png_of(*size)
        assert len(data) < 1000
        with pytest.raises(PayloadTooLarge, match=r"aspect ratio over 32:1"):
            read_header(data, LimitSettings().max_image_pixels, limit)
        with pytest.raises(PayloadTooLarge, match=r"aspect ratio"):
            image_pixels.decode(data, LimitSettings().max_image_pixels, limit)
    # A panorama within the limit decodes.
    assert image_pixels.decode(png_of(3200, 100), 40_000_000, limit).size == (3200, 100)


def test_only_photo_formats_are_decoded() -> None:
    """An EPS upload (which Pillow would render through Ghostscript) is refused from its
    first bytes; the listed formats decode."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(BadRequest, match=r"not an image format this server reads \(JPEG, PNG"):
        image_pixels.decode(eps, 1_000_000)
    for fmt in UPLOAD_FORMATS:
        buffer = io.BytesIO()
        Image.new("RGB", (8, 6), (1, 2, 3)).save(buffer, format=fmt)
        assert image_pixels.decode(buffer.getvalue(), 1_000_000).size == (8, 6), fmt


def test_a_front_end_screens_images_and_leaves_the_rest_to_the_handler(bomb: bytes) -> None:
    """``screen_upload``: what begins like an image format is held to the limits (a bomb,
    an aspect-ratio bomb, a broken header refused); bytes of no image format pass, for
    the model's handler to take or refuse."""
    with pytest.raises(PayloadTooLarge):
        screen_upload(bomb, 40_000_000, 32.0)
    buffer = io.BytesIO()
    Image.new("RGB", (1, 400)).save(buffer, format="PNG")
    with pytest.raises(PayloadTooLarge, match="aspect ratio"):
        screen_upload(buffer.getvalue(), 40_000_000, 32.0)
    with pytest.raises(BadRequest, match="IHDR"):
        screen_upload(b"\x89PNG\r\n\x1a\n\x00\x00", 40_000_000, 32.0)
    screen_upload(buffer.getvalue(), 40_000_000, None)  # no aspect limit: passes
    screen_upload(b"RIFF\x00\x00\x00\x00WAVEfmt ", 40_000_000, 32.0)  # audio: the handler's
    screen_upload(b"not an image", 40_000_000, 32.0)


def test_the_front_ends_screen_reads_a_bounded_prefix() -> None:
    """Megabytes of JPEG fill bytes are not walked in the front end (a header not found in
    the first ``SCREENED_BYTES`` is left to the handler, which refuses it); a bomb's header
    inside the prefix is still refused there."""
    from app.image_header import SCREENED_BYTES

    fill = b"\xff\xd8" + b"\xff" * (1 << 20)
    screen_upload(fill, 40_000_000, 32.0)  # passed on: its prefix holds no header
    with pytest.raises(BadRequest):  # which the handler's full read refuses
        read_header(fill, 40_000_000, 32.0)
    with pytest.raises(BadRequest):  # a short upload is judged whole, as before
        screen_upload(fill[: SCREENED_BYTES // 2], 40_000_000, 32.0)
    huge = b"\xff\xd8\xff\xc0\x00\x11\x08" + struct.pack(">HH", 30_000, 30_000) + b"\x03" + bytes(9)
    with pytest.raises(PayloadTooLarge):
        screen_upload(huge + bytes(SCREENED_BYTES * 2), 40_000_000, 32.0)
