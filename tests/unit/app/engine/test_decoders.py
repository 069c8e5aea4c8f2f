"""Which decoders a model's JPEG uploads get, on a machine without a GPU decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.engine import decoders as model_decoders
from app.engine.repository import ModelConfig, ModelEntry
from app.settings import Settings


def entry(**config: Any) -> ModelEntry:
    return ModelEntry(config=ModelConfig(name="m", max_batch_size=8, **config), folder=Path("."))


def test_gpu_decoding_is_chosen_only_where_it_can_run() -> None:
    from engines.backends import gpu_image_decode_available

    if gpu_image_decode_available():
        pytest.skip("this machine can decode on the GPU: tests/gpu covers it")
    with_prep = entry(preprocess={})

    def decoders(mode: str, backend: str, processes: int = 0) -> object:
        settings = Settings(models={"image_decode": mode, "decode_processes": processes})  # type: ignore[arg-type]
        return model_decoders.gpu_decoders(with_prep, backend, settings)

    assert decoders("auto", "onnxruntime") == []
    assert decoders("auto", "torch") == []  # no CUDA here: the CPU decodes
    assert decoders("auto", "torch", processes=2) == []  # and starts no process for it
    assert decoders("cpu", "torch") == []
    assert model_decoders.gpu_decoders(entry(), "torch", Settings()) == []  # no uploads at all
    with pytest.raises(RuntimeError, match="torchvision with CUDA is not available"):
        decoders("gpu", "onnxruntime")
