"""ResNet-50 v1.5 with seeded random weights, as ONNX: a benchmark model, not a classifier.

v1.5 puts the stride-2 of each downsampling bottleneck on the 3x3 convolution (torchvision's
layout), not on the first 1x1. Weights are He-normal; BatchNorm is taken as folded with unit
scale and zero shift, except the last one of each residual branch, whose scale is
``_RESIDUAL_SCALE``: with unit scale everywhere each of the 16 residual additions roughly doubles
the activation variance, while trained networks keep those branches small. The result keeps
activations finite and varied through all 50 layers, which is all a benchmark needs from them.

Same tensor contract as the pretrained zoo models: ``input`` FP32 [batch, 3, 224, 224] ->
``logits`` FP32 [batch, 1000].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from zoo.common import NUM_CLASSES, GraphBuilder, classifier, save

_RESIDUAL_SCALE = 0.2
# (bottlenecks, width, first stride) per stage; each bottleneck outputs 4 * width channels.
_STAGES = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))


@dataclass
class _Graph(GraphBuilder):
    rng: np.random.Generator

    def conv(
        self,
        x: str,
        name: str,
        cin: int,
        cout: int,
        kernel: int,
        *,
        stride: int = 1,
        scale: float = 1.0,
        relu: bool = True,
    ) -> str:
        """He-normal convolution (BatchNorm folded in as ``scale``), optionally then ReLU."""
        std = scale * math.sqrt(2.0 / (cin * kernel * kernel))
        weight = self.rng.standard_normal((cout, cin, kernel, kernel), dtype=np.float32) * std
        pad = kernel // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [
                    x,
                    self.constant(f"{name}.weight", weight),
                    # A (zero) bias keeps the shape of a BatchNorm-folded conv, which engines fuse.
                    self.constant(f"{name}.bias", np.zeros(cout, dtype=np.float32)),
                ],
                [name],
                name=name,
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
            )
        )
        return self.node("Relu", [name], f"{name}/relu") if relu else name


def _bottleneck(g: _Graph, x: str, prefix: str, cin: int, width: int, stride: int) -> str:
    cout = 4 * width
    y = g.conv(x, f"{prefix}.conv1", cin, width, 1)
    y = g.conv(y, f"{prefix}.conv2", width, width, 3, stride=stride)
    y = g.conv(y, f"{prefix}.conv3", width, cout, 1, scale=_RESIDUAL_SCALE, relu=False)
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = g.conv(x, f"{prefix}.downsample", cin, cout, 1, stride=stride, relu=False)
    return g.node("Relu", [g.node("Add", [y, shortcut], f"{prefix}/add")], f"{prefix}/relu")


def build(seed: int = 0) -> onnx.ModelProto:
    """The checked ONNX model; the same seed gives the same weights."""
    g = _Graph(np.random.default_rng(seed))
    x = g.conv("input", "conv1", 3, 64, 7, stride=2)
    x = g.node("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = 64
    for stage, (blocks, width, first_stride) in enumerate(_STAGES, start=1):
        for block in range(blocks):
            stride = first_stride if block == 0 else 1
            x = _bottleneck(g, x, f"layer{stage}.{block}", channels, width, stride)
            channels = 4 * width
    x = g.node("GlobalAveragePool", [x], "pool")
    x = g.node("Flatten", [x], "flatten", axis=1)
    fc = g.rng.standard_normal((NUM_CLASSES, channels), dtype=np.float32) / math.sqrt(channels)
    g.node(
        "Gemm",
        [x, g.constant("fc.weight", fc), g.constant("fc.bias", np.zeros(NUM_CLASSES, np.float32))],
        "logits",
        transB=1,
    )

    return classifier(
        "resnet50",
        g.nodes,
        g.initializers,
        f"ResNet-50 v1.5, random weights (seed {seed}), for benchmarks only.",
    )


def write(model_dir: Path, seed: int = 0) -> None:
    """Write ``model_dir/model.onnx``."""
    save(build(seed), model_dir)
