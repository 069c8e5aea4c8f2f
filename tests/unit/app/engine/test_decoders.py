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
        settings = Settings(uploads={"image_decode": mode, "decode_processes": processes})  # type: ignore[arg-type]
        return model_decoders.gpu_decoders(with_prep, backend, settings)

    assert decoders("auto", "onnxruntime") == []
    assert decoders("auto", "torch") == []  # no CUDA here: the CPU decodes
    assert decoders("auto", "torch", processes=2) == []  # and starts no process for it
    assert decoders("cpu", "torch") == []
    assert model_decoders.gpu_decoders(entry(), "torch", Settings()) == []  # no uploads at all
    with pytest.raises(RuntimeError, match="torchvision with CUDA is not available"):
        decoders("gpu", "onnxruntime")


def test_decode_processes_that_cannot_start_leave_the_gpu_to_the_engines_threads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where spawning, CUDA IPC or /dev/shm fail at load, the model still decodes on the GPU,
    in threads of the engine (``decode_workers`` of them), and the log says why; where they
    start, the model gets the processes and the log line names them."""
    pytest.importorskip("torch", reason="the decoders are torch's (the reference extra)")
    from engines import backends
    from engines.backends.torch import decode_process
    from engines.backends.torch import images as torch_images

    class Threaded:
        def __init__(
            self, spec: object, device: str, decode_jpeg: object, kernel: object = None
        ) -> None:
            self.device = device
            self.decode_jpeg = decode_jpeg
            self.kernel = kernel

        def decode(self, jpegs: object) -> object:
            raise AssertionError("not called here")

    started: list[str] = []

    class Refused:
        def __init__(self, *given: object, label: str = "", slots: int = 1, **_: object) -> None:
            started.append(label)
            raise RuntimeError(f"decode process {label} did not start: no /dev/shm")

    class Started(decode_process.DecodeProcess):
        def __init__(
            self,
            *given: object,
            label: str = "",
            slots: int = 1,
            kernel: object = None,
            **_: object,
        ) -> None:
            started.append(label)
            self.slots = slots
            self.kernel = kernel

        def close(self) -> None:
            pass

    monkeypatch.setattr(backends, "gpu_image_decode_available", lambda: True)
    monkeypatch.setattr(torch_images, "TorchImageDecoder", Threaded)
    settings = Settings(uploads={"decode_processes": 2, "decode_workers": 3, "decode_in_flight": 2})  # type: ignore[arg-type]
    with_prep = entry(preprocess={})

    monkeypatch.setattr(decode_process, "DecodeProcess", Refused)
    with caplog.at_level("ERROR", logger="app.engine.decoders"):
        chosen = model_decoders.gpu_decoders(with_prep, "torch", settings)
    assert sorted(started) == ["m-0", "m-1"]
    assert len(chosen) == 3
    assert all(getattr(d, "__self__", None).device == "cuda:0" for d in chosen)  # type: ignore[union-attr]
    assert all(getattr(d, "__self__", None).kernel is None for d in chosen)  # type: ignore[union-attr]
    assert "did not start: no /dev/shm; JPEG uploads decoded in threads" in caplog.text
    assert model_decoders.describe_decoding(chosen, settings) == (
        "GPU by torchvision (3 decoder threads in the engine)"
    )

    started.clear()
    monkeypatch.setattr(decode_process, "DecodeProcess", Started)
    chosen = model_decoders.gpu_decoders(with_prep, "torch", settings)
    # each process twice (decode_in_flight 2): the queue's threads call it two at once
    assert sorted(started) == ["m-0", "m-1"] and len(chosen) == 4 and len(set(map(id, chosen))) == 2
    assert chosen[0] is not chosen[1]  # interleaved: the second batch goes to the idle one
    assert model_decoders.describe_decoding(chosen, settings) == (
        "GPU by torchvision (2 decode processes, 2 batches in flight each)"
    )
    assert model_decoders.describe_decoding([], settings) == "CPU"
    assert all(process.kernel is None for process in chosen)  # type: ignore[attr-defined]

    # uploads.resize_kernel off: the matrix form, in the processes' decoders and the threads'
    matrix = Settings(uploads={"decode_processes": 2, "resize_kernel": False})  # type: ignore[arg-type]
    chosen = model_decoders.gpu_decoders(with_prep, "torch", matrix)
    assert chosen and all(process.kernel is False for process in chosen)  # type: ignore[attr-defined]
    monkeypatch.setattr(decode_process, "DecodeProcess", Refused)
    chosen = model_decoders.gpu_decoders(with_prep, "torch", matrix)
    assert chosen and all(getattr(d, "__self__", None).kernel is False for d in chosen)  # type: ignore[union-attr]
