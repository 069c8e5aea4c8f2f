"""The model layer: a model's contract, its input policy, loading a version on ONNX Runtime,
warming and closing it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml

from app.engine import models
from app.engine.models import InputPolicy
from app.engine.repository import DynamicBatching, ModelConfig, ModelEntry, load_config
from app.settings import Settings
from engines.base import Engine, EngineOptions, Runner
from engines.devices.options import RUNNERS_PER_GPU, GpuOptions
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec
from engines.store import EngineStore
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

IMAGE = TensorSpec("input", "FP32", (3, 224, 224))
SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (10,)),), max_batch_size=8)


def entry(**config: Any) -> ModelEntry:
    return ModelEntry(config=ModelConfig(name="m", max_batch_size=8, **config), folder=Path("."))


class PixelEngine:
    """An engine that declares it normalises pixels on its device (only what the policy
    reads of it)."""

    backend = "fake"
    spec = SPEC
    pixel_input: str | None = "input"


# -- the input policy ---------------------------------------------------------------------


def test_a_floating_point_image_input_with_preprocessing_also_takes_pixels() -> None:
    policy = InputPolicy.decide(entry(preprocess={}), SPEC)
    assert policy.pixels == "input" and not policy.on_device
    assert policy.prep == ImagePreprocess(datatype="UINT8")
    assert InputPolicy.decide(entry(), SPEC) == InputPolicy()  # no preprocessing
    integer = ModelSpec("m", (TensorSpec("input", "INT32", (3, 224, 224)),), SPEC.outputs, 8)
    assert InputPolicy.decide(entry(preprocess={}), integer).pixels is None
    other_shape = ModelSpec("m", (TensorSpec("input", "FP32", (3, 32, 32)),), SPEC.outputs, 8)
    assert InputPolicy.decide(entry(preprocess={}), other_shape).pixels is None


def test_pixels_are_normalised_with_the_configured_mean_and_std() -> None:
    mean, std = [120.0, 110.0, 100.0], [60.0, 61.0, 62.0]
    policy = InputPolicy.decide(entry(preprocess={"mean": mean, "std": std}), SPEC)
    pixels = np.random.default_rng(3).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
    got = policy.for_engine({"input": pixels})["input"]
    # The reference, written out per channel rather than through the code under test.
    want = np.stack(
        [(pixels[:, c].astype(np.float64) - mean[c]) / std[c] for c in range(3)], axis=1
    )
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    floats = pixels.astype(np.float32)
    assert policy.for_engine({"input": floats})["input"] is floats  # already the engine's


def test_an_engine_that_normalises_on_its_device_gets_the_pixels_untouched() -> None:
    policy = InputPolicy.decide(entry(preprocess={}), SPEC, PixelEngine())  # type: ignore[arg-type]
    assert policy.on_device
    pixels = np.zeros((1, 3, 224, 224), np.uint8)
    assert policy.for_engine({"input": pixels})["input"] is pixels
    elsewhere = PixelEngine()
    elsewhere.pixel_input = None
    assert not InputPolicy.decide(entry(preprocess={}), SPEC, elsewhere).on_device  # type: ignore[arg-type]


def test_engine_options_carry_gpus_batch_sizes_and_preprocessing() -> None:
    configured = entry(
        runners=4,
        gpus=[0, 1],
        preprocess={},
        dynamic_batching={"preferred_batch_size": [4, 8]},
        gpu={"compile": "max-autotune", "memory_fraction": 0.5},
    )
    options = models.engine_options(configured, SPEC, "torch", precision="fp16")
    assert options.devices == (0, 1) and options.runners == 4
    assert options.gpu == GpuOptions(compile="max-autotune", memory_fraction=0.5)
    assert options.preferred_batch_sizes == (4, 8) and options.precision == "fp16"
    assert options.image == ImagePreprocess(datatype="FP32")
    assert models.engine_options(entry(), SPEC, "onnxruntime").image is None


def test_unset_runners_are_one_on_the_cpu_and_some_per_gpu_on_a_gpu_backend() -> None:
    """``runners`` left out: ONNX Runtime gets one runner with every core; the torch backend
    ``RUNNERS_PER_GPU`` on each of the model's GPUs; TensorRT, whose contexts all run on one
    GPU, ``RUNNERS_PER_GPU``; a configured count is taken as it is."""
    unset, two_gpus = entry(), entry(gpus=[0, 1])
    assert models.engine_options(unset, SPEC, "onnxruntime").runners == 1
    assert models.engine_options(unset, SPEC, "torch").runners == RUNNERS_PER_GPU
    assert models.engine_options(two_gpus, SPEC, "torch").runners == 2 * RUNNERS_PER_GPU
    assert models.engine_options(two_gpus, SPEC, "tensorrt").runners == RUNNERS_PER_GPU
    assert models.engine_options(entry(runners=3), SPEC, "torch").runners == 3
    assert models.engine_options(entry(runners=3), SPEC, "onnxruntime").runners == 3
    with pytest.raises(ValueError, match="resolved backend"):
        unset.config.runner_count("auto")


# -- a model's contract -------------------------------------------------------------------


def write_tiny(folder: Path, **config: Any) -> ModelEntry:
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 8, **config}))
    return load_config(folder)


def test_the_contract_comes_from_the_onnx_file_unless_the_config_declares_it(
    tmp_path: Path,
) -> None:
    read = models.source(write_tiny(tmp_path / "tiny"))
    assert [(t.name, t.datatype, t.shape) for t in read.spec.inputs] == [("x", "FP32", (4,))]
    assert read.plan.profile == (1, 8, 8) and read.plan.input_name == "x"
    declared = models.model_spec(
        write_tiny(
            tmp_path / "declared",
            inputs=[{"name": "x", "datatype": "FP32", "shape": [-1]}],
        )
    )
    assert declared.inputs == (TensorSpec("x", "FP32", (-1,)),)
    assert [t.name for t in declared.outputs] == ["y", "s"]  # still the file's


def test_a_missing_onnx_without_a_generator_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    (folder / "config.yaml").write_text("max_batch_size: 8\n")
    with pytest.raises(FileNotFoundError, match=r"'gone': model.onnx does not exist in its"):
        models.source(load_config(folder))


def test_a_triton_style_version_folder_is_refused_saying_versions_are_precisions(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "triton"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"onnx")
    (folder / "config.yaml").write_text("max_batch_size: 8\n")
    refused = r"version folders \(1/\).*versions are its precisions"
    with pytest.raises(FileNotFoundError, match=refused):
        models.source(load_config(folder))


def test_prepare_writes_the_generated_files_and_leaves_no_scratch(tmp_path: Path) -> None:
    folder = tmp_path / "resnet"
    folder.mkdir()
    (folder / "config.yaml").write_text("generator: nope\n")
    with pytest.raises(ValueError, match="unknown generator 'nope'"):
        models.prepare(load_config(folder))
    assert [p.name for p in folder.iterdir()] == ["config.yaml"]


# -- loading ------------------------------------------------------------------------------


def settings_for(repository: Path, tmp_path: Path, **models_: Any) -> Settings:
    return Settings(
        models={"repository": repository, **models_},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
    )


def test_a_loaded_version_answers_through_its_batcher_and_closes(tmp_path: Path) -> None:
    model = models.source(write_tiny(tmp_path / "repo" / "tiny", runners=2))
    settings = settings_for(tmp_path / "repo", tmp_path)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)

    async def scenario() -> tuple[dict[str, np.ndarray], bool]:
        loaded = await models.load(
            model, "fp32", "onnxruntime", EngineStore(tmp_path / "store"), settings
        )
        assert loaded.pool.size == 2 and loaded.ready and loaded.handler is None
        outputs = await loaded.batcher.infer({"x": x}, 3, ("<f4", 4), 5.0)
        await loaded.close()
        return outputs, loaded.ready

    outputs, _ = asyncio.run(scenario())
    np.testing.assert_allclose(outputs["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["s"], x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


class Shrunk:
    """ONNX Runtime's engine presenting a max batch of 4 where the config says 8, as a GPU
    engine does after ``gpu.on_out_of_memory: shrink``; its runners record the rows run."""

    def __init__(self, engine: Engine, batches: list[int]) -> None:
        self._engine, self._batches = engine, batches
        self.backend, self.pixel_input = engine.backend, engine.pixel_input
        self.spec = dataclasses.replace(engine.spec, max_batch_size=4)

    def new_runner(self) -> Runner:
        inner, batches = self._engine.new_runner(), self._batches

        class Recording:
            def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                batches.append(len(next(iter(inputs.values()))))
                return inner.run(inputs)

            def close(self) -> None:
                inner.close()

        return Recording()

    def close(self) -> None:
        self._engine.close()


def test_a_version_is_served_at_the_max_batch_its_engine_settled_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher and the contract take the engine's max batch, not the config's: an engine
    that shrank to fit its memory never gets a batch larger than it kept."""
    from engines import backends
    from engines.backends import onnxruntime

    batches: list[int] = []

    def shrinking(path: Path, spec: ModelSpec, options: EngineOptions) -> Engine:
        return Shrunk(onnxruntime.load(path, spec, options), batches)

    monkeypatch.setitem(backends.LOADERS, "shrinking", shrinking)
    model = models.source(write_tiny(tmp_path / "repo" / "tiny", runners=1))
    settings = settings_for(tmp_path / "repo", tmp_path)
    requests = [np.full((2, 4), i, dtype=np.float32) for i in range(6)]

    async def scenario() -> tuple[int, list[dict[str, np.ndarray]]]:
        loaded = await models.load(
            model, "fp32", "shrinking", EngineStore(tmp_path / "store"), settings
        )
        batches.clear()  # the warm-up's batches (1 and the max): only the requests' count
        try:
            outputs = await asyncio.gather(
                *(loaded.batcher.infer({"x": x}, 2, ("<f4", 4), 5.0) for x in requests)
            )
        finally:
            await loaded.close()
        return loaded.spec.max_batch_size, outputs

    served_max, outputs = asyncio.run(scenario())
    assert served_max == 4
    assert max(batches) <= 4 and 4 in batches  # two requests of 2 rows to a batch
    for x, got in zip(requests, outputs, strict=True):
        np.testing.assert_allclose(got["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


def test_a_timeout_of_zero_takes_the_configured_default() -> None:
    batching = DynamicBatching(default_timeout_us=2_000_000)
    assert models.deadline_s(batching, None) == 2.0
    assert models.deadline_s(batching, 0) == 2.0
    assert models.deadline_s(batching, 500_000) == 0.5
    assert models.deadline_s(DynamicBatching(default_timeout_us=0), None) is None
