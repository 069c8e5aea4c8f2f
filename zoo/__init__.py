"""The bundled models' ONNX files, generated offline with onnx.helper and numpy (no torch).

Every generator writes ``model_dir/model.onnx`` (and ``labels.txt`` when the model has classes)
with the same tensor contract: ``input`` FP32 [batch, 3, 224, 224], preprocessed by the server
(see ``engines.preprocess``), to ``logits`` FP32 [batch, 1000]. The server calls
``GENERATORS[name](model_dir)`` when a model folder has no ``model.onnx``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path


def _generator(module: str) -> Callable[[Path], None]:
    # Imported on use: the default model's generator needs its weights package (the
    # ``default-model`` extra), which a server of other models never has to install.
    def write(model_dir: Path) -> None:
        importlib.import_module(f"zoo.{module}").write(model_dir)

    return write


GENERATORS: dict[str, Callable[[Path], None]] = {
    "efficientnet_lite0": _generator("efficientnet_lite0"),
    "resnet50": _generator("resnet50"),
}
