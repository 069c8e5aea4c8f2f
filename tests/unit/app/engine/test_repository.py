"""The model repository: config files read and refused (naming the model, the file and the
field, never a server path), discovery, and what a config tells the engine layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.folders import ConfigError
from app.engine.repository import ModelConfig, ModelEntry, discover, load_config
from engines.precision.options import Budget
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec

IMAGE_SPEC = ModelSpec(
    name="m",
    inputs=(TensorSpec("input", "FP32", (3, 224, 224)),),
    outputs=(TensorSpec("logits", "FP32", (1000,)),),
    max_batch_size=16,
)


def model_folder(root: Path, name: str, config: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    return folder


def refusal(tmp_path: Path, config: str) -> str:
    folder = model_folder(tmp_path, "broken", config)
    with pytest.raises(ConfigError) as refused:
        load_config(folder)
    message = str(refused.value)
    assert message.startswith("model 'broken': config.yaml: "), message
    assert str(tmp_path) not in message
    return message


def test_an_empty_config_takes_every_default_and_the_folders_name(tmp_path: Path) -> None:
    entry = load_config(model_folder(tmp_path, "resnet", ""))
    config = entry.config
    assert config.name == "resnet"
    assert entry.folder == tmp_path / "resnet"
    assert entry.onnx_path == tmp_path / "resnet" / "model.onnx"
    assert config.backend == "auto" and config.autoload is True
    assert config.max_batch_size == 0 and config.runners is None and config.gpus == []
    assert config.precisions == ["fp32"] and config.default_precision == "fp32"
    assert config.dynamic_batching.max_queue_delay_us == 2000
    assert config.dynamic_batching.max_queue_size == 1024
    assert config.dynamic_batching.default_timeout_us == 30_000_000
    assert config.accuracy.budgets == {
        "fp16": Budget(min_top1_agreement=0.99),
        "int8": Budget(min_top1_agreement=0.98),
    }
    assert config.inputs is None and config.outputs is None and config.preprocess is None
    assert config.postprocess == "softmax"


def test_a_configured_name_and_onnx_file_are_kept(tmp_path: Path) -> None:
    entry = load_config(model_folder(tmp_path, "folder", "name: served\nonnx: weights/v2.onnx\n"))
    assert entry.config.name == "served"
    assert entry.onnx_path == tmp_path / "folder" / "weights" / "v2.onnx"


def test_a_missing_config_names_the_model_and_logs_the_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot read") as refused:
        load_config(tmp_path / "empty")
    assert str(refused.value) == (
        "model 'empty': config.yaml: cannot read it (No such file or directory)"
    )
    assert str(tmp_path / "empty" / "config.yaml") in caplog.text


def test_unparsable_yaml_names_the_file(tmp_path: Path) -> None:
    assert "not valid YAML" in refusal(tmp_path, "max_batch_size: [1, 2\n")


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    assert "expected a mapping at the top level" in refusal(tmp_path, "- fp32\n- fp16\n")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ("runners: 0\n", "runners:"),
        ("max_batch_size: -1\n", "max_batch_size:"),
        ("max_batch: 8\n", "max_batch:"),
        ("backend: [onnxruntime]\n", "backend:"),
        ("gpus: [0, -1]\nrunners: 2\n", "gpus.1:"),
        ("dynamic_batching:\n  max_queue_delay_us: -5\n", "dynamic_batching.max_queue_delay_us:"),
        ("dynamic_batching:\n  max_queue_size: 0\n", "dynamic_batching.max_queue_size:"),
        ("dynamic_batching:\n  delay: 5\n", "dynamic_batching.delay:"),
        ("int8:\n  calibrator: magic\n", "int8.calibrator:"),
        ("accuracy:\n  budgets:\n    fp16: {min_top1_agreement: 2}\n", "accuracy.budgets.fp16"),
        ("preprocess:\n  layout: CHWN\n", "preprocess.layout:"),
        ("postprocess: sigmoid\n", "postprocess:"),
        ("inputs:\n  - {name: x, datatype: FP33, shape: [4]}\n", "inputs.0:"),
        ("outputs:\n  - {name: y, datatype: FP32}\n", "outputs.0.shape:"),
        ("inputs:\n  - {name: x, datatype: FP32, shape: [0]}\n", "inputs.0:"),
        ("inputs:\n  - {name: x, datatype: FP32, shape: [4], dims: 1}\n", "inputs.0.dims:"),
    ],
)
def test_an_invalid_field_is_named_with_its_path(tmp_path: Path, config: str, field: str) -> None:
    message = refusal(tmp_path, config)
    assert f": {field}" in message, message


def test_declared_tensors_override_the_onnx_files(tmp_path: Path) -> None:
    config = """\
inputs:
  - {name: image, datatype: UINT8, shape: [224, 224, 3]}
outputs:
  - {name: scores, datatype: FP32, shape: [-1]}
"""
    entry = load_config(model_folder(tmp_path, "m", config))
    assert entry.config.inputs == [TensorSpec("image", "UINT8", (224, 224, 3))]
    assert entry.config.outputs == [TensorSpec("scores", "FP32", (-1,))]


def test_every_problem_of_a_config_is_reported_at_once(tmp_path: Path) -> None:
    message = refusal(tmp_path, "runners: 0\nmax_batch_size: -1\n")
    assert "runners:" in message and "max_batch_size:" in message


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("precisions: [fp32, fp64]\n", "precisions ['fp64'] are not available"),
        ("precisions: [fp16]\n", "default_precision 'fp32' is not among ['fp16']"),
        ("precisions: [fp32]\ndefault_precision: int8\n", "default_precision 'int8'"),
        ("gpus: [0, 1, 0]\nrunners: 3\n", "lists a GPU twice"),
        ("gpus: [0, 1]\nrunners: 1\n", "give at least one runner per GPU"),
        (
            "dynamic_batching: {priority_levels: 2, default_priority_level: 3}\n",
            "default_priority_level exceeds priority_levels",
        ),
        (
            "max_batch_size: 8\ndynamic_batching: {preferred_batch_size: [4, 16]}\n",
            "preferred_batch_size [16] exceeds max_batch_size",
        ),
        (
            "dynamic_batching: {preferred_batch_size: [1]}\n",
            "preferred_batch_size [1] exceeds max_batch_size",
        ),
    ],
)
def test_inconsistent_fields_are_refused(tmp_path: Path, config: str, says: str) -> None:
    message = refusal(tmp_path, config)
    assert "(top level)" in message and says in message, message


@pytest.mark.parametrize("size", [0, -4])
def test_a_preferred_batch_size_below_one_is_refused(tmp_path: Path, size: int) -> None:
    config = f"max_batch_size: 8\ndynamic_batching: {{preferred_batch_size: [{size}]}}\n"
    assert "dynamic_batching.preferred_batch_size" in refusal(tmp_path, config)


@pytest.mark.parametrize(
    "config",
    [
        "precisions: [fp16, int8]\ndefault_precision: int8\n",
        "gpus: [1, 0]\nrunners: 2\n",
        "gpus: [0]\nrunners: 4\n",
        "dynamic_batching: {priority_levels: 3, default_priority_level: 3}\n",
        "max_batch_size: 8\ndynamic_batching: {preferred_batch_size: [2, 8]}\n",
    ],
)
def test_consistent_edge_cases_are_accepted(tmp_path: Path, config: str) -> None:
    load_config(model_folder(tmp_path, "ok", config))


def test_discover_loads_every_autoloading_model_in_name_order(tmp_path: Path) -> None:
    model_folder(tmp_path, "zeta", "")
    model_folder(tmp_path, "alpha", "name: first\n")
    model_folder(tmp_path, "bench_only", "autoload: false\n")
    (tmp_path / "notes").mkdir()  # a folder without a config is not a model
    (tmp_path / "README.md").write_text("not a model")
    entries = discover(tmp_path, [])
    assert [e.folder.name for e in entries] == ["alpha", "zeta"]
    assert [e.config.name for e in entries] == ["first", "zeta"]


def test_discover_loads_named_models_in_the_given_order_autoload_or_not(tmp_path: Path) -> None:
    model_folder(tmp_path, "zeta", "")
    model_folder(tmp_path, "alpha", "")
    model_folder(tmp_path, "bench_only", "autoload: false\n")
    entries = discover(tmp_path, ["bench_only", "zeta"])
    assert [e.config.name for e in entries] == ["bench_only", "zeta"]


@pytest.mark.parametrize("name", ["missing", "../outside", "a/b", ".hidden", "..", "notes"])
def test_discover_refuses_a_name_that_is_not_a_model_folder(tmp_path: Path, name: str) -> None:
    repository = tmp_path / "repository"
    model_folder(repository, "alpha", "")
    (repository / "notes").mkdir()
    # Configs that a path outside the repository or a hidden folder would reach.
    model_folder(tmp_path, "outside", "")
    model_folder(repository, ".hidden", "")
    model_folder(repository / "a", "b", "")
    with pytest.raises(ConfigError, match=r"model .*: no .*config\.yaml"):
        discover(repository, [name])


def test_discover_refuses_a_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        discover(tmp_path / "nowhere", [])


def test_discover_refuses_a_repository_with_nothing_to_load(tmp_path: Path) -> None:
    model_folder(tmp_path, "bench_only", "autoload: false\n")
    with pytest.raises(ConfigError, match=r"has no <model>/config\.yaml to load"):
        discover(tmp_path, [])


def test_discover_stops_at_a_broken_config_naming_it(tmp_path: Path) -> None:
    model_folder(tmp_path, "good", "")
    broken = model_folder(tmp_path, "bad", "runners: zero\n")
    with pytest.raises(ConfigError, match="runners:") as refused:
        discover(tmp_path, [])
    assert str(refused.value).startswith(f"model '{broken.name}': config.yaml: runners:")


@pytest.mark.parametrize(
    ("config", "profile"),
    [
        ("max_batch_size: 16\n", (1, 16, 16)),
        ("max_batch_size: 16\ndynamic_batching: {preferred_batch_size: [4, 8]}\n", (1, 8, 16)),
        ("max_batch_size: 32\ndynamic_batching: {preferred_batch_size: [16, 4]}\n", (1, 16, 32)),
        ("max_batch_size: 0\n", (1, 1, 1)),
    ],
)
def test_the_build_profile_optimises_for_the_largest_preferred_batch(
    tmp_path: Path, config: str, profile: tuple[int, int, int]
) -> None:
    entry = load_config(model_folder(tmp_path, "m", config))
    assert entry.build_plan(IMAGE_SPEC).profile == profile


def test_the_build_plan_carries_the_configs_choices(tmp_path: Path) -> None:
    config = """\
max_batch_size: 8
onnx: net.onnx
fp16: {keep_first_and_last: true}
int8: {samples: 32, calibrator: minmax}
accuracy:
  budgets: {int8: {min_top1_agreement: 0.5}}
  evaluation_samples: 16
  override: true
preprocess: {resize_shorter: 160, crop: 128, layout: NHWC}
"""
    entry = load_config(model_folder(tmp_path, "classifier", config))
    spec = ModelSpec(
        name="classifier",
        inputs=(TensorSpec("pixels", "FP16", (128, 128, 3)), TensorSpec("aux", "FP32", (1,))),
        outputs=(TensorSpec("logits", "FP32", (10,)),),
        max_batch_size=8,
    )
    plan = entry.build_plan(spec)
    assert plan.model == "classifier"
    assert plan.source == tmp_path / "classifier" / "net.onnx"
    assert plan.folder == tmp_path / "classifier"
    assert plan.input_name == "pixels"
    assert plan.preprocess == ImagePreprocess(
        resize_shorter=160,
        crop=128,
        mean=(127.0, 127.0, 127.0),
        std=(128.0, 128.0, 128.0),
        layout="NHWC",
        datatype="FP16",
    )
    assert plan.fp16.keep_first_and_last is True
    assert plan.int8.samples == 32 and plan.int8.calibrator == "minmax"
    # Budgets given replace the defaults: fp16's default budget is not kept beside them.
    assert dict(plan.budgets) == {"int8": Budget(min_top1_agreement=0.5)}
    assert plan.evaluation_samples == 16 and plan.override_accuracy is True


def test_a_model_without_preprocessing_plans_no_image_path(tmp_path: Path) -> None:
    entry = load_config(model_folder(tmp_path, "tabular", "max_batch_size: 4\n"))
    assert entry.build_plan(IMAGE_SPEC).preprocess is None


def test_labels_are_read_one_per_line(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "m", "labels: classes.txt\n")
    (folder / "classes.txt").write_text("tench\ngoldfish\ngreat white shark\n", encoding="utf-8")
    assert load_config(folder).labels() == ["tench", "goldfish", "great white shark"]


def test_labels_keep_non_ascii_names(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "m", "labels: classes.txt\n")
    (folder / "classes.txt").write_bytes("café\nñandú\n".encode())
    assert load_config(folder).labels() == ["café", "ñandú"]


def test_no_labels_without_a_labels_file(tmp_path: Path) -> None:
    assert load_config(model_folder(tmp_path, "a", "")).labels() is None
    missing = load_config(model_folder(tmp_path, "b", "labels: gone.txt\n"))
    assert missing.labels() is None


def test_an_entry_can_be_built_directly(tmp_path: Path) -> None:
    """The entry is a plain pydantic model: a tool can make one without a file."""
    entry = ModelEntry(folder=tmp_path, config=ModelConfig(name="direct", max_batch_size=2))
    assert entry.build_plan(IMAGE_SPEC).profile == (1, 2, 2)
