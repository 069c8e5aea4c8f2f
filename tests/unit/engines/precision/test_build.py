"""Precision variants through the store: built once, gated on accuracy, served as versions."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from app.cli import main
from app.engine.models import model_spec
from app.engine.repository import ModelEntry, load_config
from engines.precision import build, calibration
from engines.precision.build import AccuracyBudgetExceeded, BuildPlan, ensure_variant
from engines.precision.options import Budget
from engines.store import EngineStore
from tests.conftest import ROOT, configure


def model_folder(
    tmp_path: Path,
    efficientnet_dir: Path,
    calibrator: str = "minmax",
    percentile: float = 99.99,
    int8_budget: float = 0.5,
) -> Path:
    folder = tmp_path / "repo" / "efficientnet_lite0"
    shutil.copytree(efficientnet_dir, folder)
    configure(
        folder,
        {
            "int8": {"samples": 24, "calibrator": calibrator, "percentile": percentile},
            "accuracy": {
                "evaluation_samples": 24,
                "budgets": {
                    "fp16": {"min_top1_agreement": 0.9},
                    "int8": {"min_top1_agreement": int8_budget},
                },
            },
        },
    )
    return folder


def plan_of(folder: Path) -> tuple[ModelEntry, BuildPlan]:
    entry = load_config(folder)
    return entry, entry.build_plan(model_spec(entry))


def test_variants_are_built_once_and_calibration_is_cached(
    tmp_path: Path, efficientnet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    collect = calibration.collect_ranges

    def counting(*args: object, **kwargs: object) -> calibration.Ranges:
        calls.append("calibrated")
        return collect(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(calibration, "collect_ranges", counting)
    _, plan = plan_of(model_folder(tmp_path, efficientnet_dir))
    store = EngineStore(tmp_path / "store")
    fp16_path, fp16_report = ensure_variant(store, plan, "fp16", "onnxruntime")
    int8, int8_report = ensure_variant(store, plan, "int8", "onnxruntime")
    assert fp16_path.exists() and fp16_report["top1_agreement"] >= 0.9
    assert fp16_report["samples"] == 24
    assert int8_report["top1_agreement"] >= 0.5
    assert ensure_variant(store, plan, "int8", "onnxruntime") == (int8, int8_report)
    assert calls == ["calibrated"]
    # A new evaluation budget is a new artefact, but the cached ranges are reused.
    stricter = dataclasses.replace(
        plan, budgets={"int8": Budget(min_top1_agreement=0.4)}, evaluation_samples=24
    )
    rebuilt, _ = ensure_variant(
        store, dataclasses.replace(stricter, profile=(1, 2, 3)), "int8", "onnxruntime"
    )
    assert rebuilt != int8 and calls == ["calibrated"]
    assert ensure_variant(store, plan, "fp32", "onnxruntime") == (plan.source, {})


def test_gate_refuses_a_deliberately_over_quantized_variant(
    tmp_path: Path, efficientnet_dir: Path
) -> None:
    # A 60th-percentile range clips most activations: the variant must be refused.
    folder = model_folder(
        tmp_path, efficientnet_dir, calibrator="percentile", percentile=60, int8_budget=0.9
    )
    _, plan = plan_of(folder)
    store = EngineStore(tmp_path / "store")
    with pytest.raises(AccuracyBudgetExceeded, match=r"short by \d+\.\d+ points") as refused:
        ensure_variant(store, plan, "int8", "onnxruntime")
    assert "int8.calibrator" in str(refused.value) and "accuracy.override" in str(refused.value)
    # Stored with its report, so the refusal is checked again on every load, not rebuilt.
    (built,) = (tmp_path / "store").rglob("engine-int8-*.onnx")
    with pytest.raises(AccuracyBudgetExceeded):
        ensure_variant(store, plan, "int8", "onnxruntime")
    served_anyway = dataclasses.replace(plan, override_accuracy=True)
    path, report = ensure_variant(store, served_anyway, "int8", "onnxruntime")
    assert path == built and report["top1_agreement"] < 0.9


def test_stoker_build_reports_each_precision_and_a_refusal(
    tmp_path: Path,
    efficientnet_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = model_folder(
        tmp_path, efficientnet_dir, calibrator="percentile", percentile=60, int8_budget=0.9
    )
    configure(folder, {"precisions": ["fp32", "fp16", "int8"]})
    monkeypatch.setenv("STOKER_STORE__PATH", str(tmp_path / "store"))
    # As the server: the refused version will answer 503, the others serve; exit 0.
    assert main(["build", "--repository", str(folder.parent)]) == 0
    out = capsys.readouterr().out
    assert "efficientnet_lite0 fp16 (onnxruntime)" in out and "top1_agreement" in out
    assert "efficientnet_lite0 int8: REFUSED" in out and "will answer 503" in out
    # With exit_on_error a refusal fails the command (the store already holds the variants).
    monkeypatch.setenv("STOKER_MODELS__EXIT_ON_ERROR", "1")
    assert main(["build", "--repository", str(folder.parent)]) == 1
    assert "efficientnet_lite0 int8: REFUSED" in capsys.readouterr().out


def test_calibration_folder_is_part_of_the_key(tmp_path: Path, efficientnet_dir: Path) -> None:
    _, plan = plan_of(model_folder(tmp_path, efficientnet_dir))
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(ROOT / "README.md", photos / "a.txt")
    builtin = build.variant_rows(plan).fingerprint
    mine = dataclasses.replace(plan, int8=plan.int8.model_copy(update={"calibration": str(photos)}))
    first = build.variant_rows(mine).fingerprint
    (photos / "b.txt").write_text("another file")
    assert len({builtin, first, build.variant_rows(mine).fingerprint}) == 3
