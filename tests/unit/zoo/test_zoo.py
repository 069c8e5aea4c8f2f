"""The zoo: a checkpoint reader that runs no pickled code, and ONNX models that check and run."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image
from skimage import data

import zoo
from app import image_pixels
from engines.preprocess import ImagePreprocess, preprocess
from zoo import resnet50
from zoo.checkpoint import UnsafePickleError, load_torch_checkpoint


def coffee_row() -> np.ndarray:
    """scikit-image's coffee photo as the server would feed it: JPEG, decoded, preprocessed."""
    jpeg = io.BytesIO()
    Image.fromarray(data.coffee()).save(jpeg, format="JPEG", quality=95)
    image = image_pixels.decode(jpeg.getvalue(), max_pixels=10_000_000)
    return preprocess(image, ImagePreprocess())


@pytest.fixture(scope="module")
def efficientnet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("efficientnet_lite0")
    zoo.GENERATORS["efficientnet_lite0"](model_dir)
    return model_dir


@pytest.fixture(scope="module")
def resnet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("resnet50")
    zoo.GENERATORS["resnet50"](model_dir)
    return model_dir


def session(model_dir: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])


class Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def legacy_file(payload: bytes) -> bytes:
    """torch's legacy layout up to the state dict: magic, protocol, sys info, then the payload."""
    header = (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True})
    return b"".join(pickle.dumps(part, protocol=2) for part in header) + payload


def zip_file(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "wrap", [lambda p: p, legacy_file, zip_file], ids=["bare", "legacy", "zip"]
)
def test_reader_refuses_a_pickle_that_would_run_code(
    tmp_path: Path, wrap: Callable[[bytes], bytes]
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    path.write_bytes(wrap(pickle.dumps(Exploit(marker), protocol=2)))
    with pytest.raises(UnsafePickleError, match=r"refers to \w+\.system.*refusing"):
        load_torch_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("model_dir_fixture", ["efficientnet_dir", "resnet_dir"])
def test_models_check_and_run_with_a_dynamic_batch(
    model_dir_fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(model_dir_fixture)
    onnx.checker.check_model(str(model_dir / "model.onnx"), full_check=True)
    runner = session(model_dir)
    (inp,), (out,) = runner.get_inputs(), runner.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("input", "tensor(float)", ["batch", 3, 224, 224])
    assert (out.name, out.type, out.shape) == ("logits", "tensor(float)", ["batch", 1000])
    rows = np.random.default_rng(0).uniform(-1, 1, (3, 3, 224, 224)).astype(np.float32)
    (one,) = runner.run(None, {"input": rows[:1]})
    (three,) = runner.run(None, {"input": rows})
    assert one.shape == (1, 1000) and three.shape == (3, 1000)
    assert one.dtype == three.dtype == np.float32
    # Batching must not change a row's answer beyond kernel-order rounding.
    np.testing.assert_allclose(three[:1], one, rtol=1e-4, atol=1e-4)


def test_resnet50_is_finite_varied_and_seeded(resnet_dir: Path) -> None:
    rows = np.random.default_rng(1).uniform(-1, 1, (2, 3, 224, 224)).astype(np.float32)
    (logits,) = session(resnet_dir).run(None, {"input": rows})
    assert np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 0.1, "classes collapsed to one value"
    assert np.abs(logits[0] - logits[1]).max() > 1e-3, "inputs collapsed to one output"
    assert resnet50.build(seed=0).SerializeToString() == (resnet_dir / "model.onnx").read_bytes()


def test_efficientnet_lite0_calls_the_coffee_photo_espresso(efficientnet_dir: Path) -> None:
    labels = (efficientnet_dir / "labels.txt").read_text(encoding="utf-8").splitlines()
    assert len(labels) == 1000
    (logits,) = session(efficientnet_dir).run(None, {"input": coffee_row()[None]})
    assert int(logits.argmax()) == 967
    assert labels[967] == "espresso"
