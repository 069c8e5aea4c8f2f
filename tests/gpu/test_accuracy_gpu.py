"""``stoker accuracy --gpu`` on the GPU: each precision as the torch backend serves it,
against ONNX Runtime's FP32, with its speed and GPU memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.cli import main
from tests.unit.bench.test_accuracy_report import labelled_photos, report_repository


def test_gpu_rows_measure_each_precision_as_served(
    tmp_path: Path, efficientnet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uncompiled (``gpu.compile: none`` in the config, which the rows follow), to stay
    inside the GPU run's two minutes a test: compiling three precisions at two batch sizes
    takes about as long again; the compiled engine has its own tests. Through
    ``python -m bench accuracy``'s entry (the same report as ``stoker accuracy``): the GPU
    machine runs a source checkout, where no installed entry point names the tool."""
    repo = report_repository(tmp_path, efficientnet_dir)
    config_path = repo / "efficientnet_lite0" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config_path.write_text(yaml.safe_dump({**config, "gpu": {"compile": "none"}}))
    photos = labelled_photos(tmp_path / "photos")
    monkeypatch.setenv("STOKER_STORE__PATH", str(tmp_path / "store"))
    out = tmp_path / "report"
    code = main(
        [
            "accuracy", "--model", "efficientnet_lite0", "--repository", str(repo),
            "--images", str(photos), "--precisions", "fp32", "--batches", "1,8", "--gpu",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    text = (out / "accuracy.md").read_text()
    gpu_part = text[text.index("## On GPU 0") :]
    assert "gpu.compile none" in gpu_part.splitlines()[0]
    lines = [line for line in gpu_part.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in lines[0].split("|")]
    rows = {r.split("|")[1].strip(): r.split("|") for r in lines[2:]}
    assert list(rows) == ["fp32", "fp16", "bf16"]

    def value(precision: str, column: str) -> float:
        return float(rows[precision][columns.index(column)])

    # FP32 on the GPU (TF32 off) picks ONNX Runtime's class on every photo.
    assert value("fp32", "top1_agreement") == 1.0 and value("fp32", "mean_kl") < 1e-3
    for half in ("fp16", "bf16"):
        assert value(half, "top1_agreement") >= 5 / 6 and value(half, "mean_kl") < 0.05
        # Half-width weights: about half the FP32 weights' bytes.
        assert value(half, "GPU MiB weights") < 0.7 * value("fp32", "GPU MiB weights")
    # EfficientNet-Lite0's FP32 weights are ~18 MB; a runner holds buffers and graphs.
    assert 10 < value("fp32", "GPU MiB weights") < 40
    for precision in rows:
        assert value(precision, "GPU MiB/runner") > 0
        # Batching pays on a GPU: eight rows a run go faster than one.
        assert value(precision, "img/s@8") > 2 * value(precision, "img/s@1")
        assert 0 < value(precision, "ms@1 (median)") < 50
