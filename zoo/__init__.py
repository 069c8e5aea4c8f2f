"""The bundled models' ONNX files, generated offline with onnx.helper and numpy (no torch).

Every generator writes ``model_dir/model.onnx`` (and ``labels.txt`` when the model has classes)
with the same tensor contract: ``input`` FP32 [batch, 3, 224, 224], preprocessed by the server
(see ``engines.preprocess``), to ``logits`` FP32 [batch, 1000]. The server calls
``GENERATORS[name](model_dir)`` when a model folder has no ``model.onnx``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from zoo import efficientnet_lite0, resnet50

GENERATORS: dict[str, Callable[[Path], None]] = {
    "efficientnet_lite0": efficientnet_lite0.write,
    "resnet50": resnet50.write,
}
