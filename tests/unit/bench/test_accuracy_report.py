"""`stoker accuracy` end to end on a few labelled photos the tests make themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from skimage import data

from app.cli import main


def test_accuracy_report_compares_precisions_and_calibrators(
    tmp_path: Path,
    efficientnet_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    photos = tmp_path / "photos"
    photos.mkdir()
    # ImageNet-style names carry the labels: n07920052 is espresso, n02123045 tabby cat.
    for i in range(3):
        crop = data.coffee()[i * 20 :, i * 30 :]
        Image.fromarray(crop).save(photos / f"n07920052_espresso_{i}.JPEG")
        Image.fromarray(data.chelsea()[:, i * 20 :]).save(photos / f"n02123045_tabby_{i}.JPEG")
    monkeypatch.setenv("STOKER_STORE__PATH", str(tmp_path / "store"))
    out = tmp_path / "report"
    code = main(
        [
            "accuracy", "--model", "efficientnet_lite0", "--repository", str(repo),
            "--images", str(photos), "--calibrate-on", "2", "--precisions", "fp32,int8",
            "--calibrators", "minmax,percentile", "--batches", "1", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    table = (out / "accuracy.md").read_text()
    assert "4 photos" in table and "2 of the photos" in table
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| fp32") or line.startswith("| int8")
    ]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "int8 minmax", "int8 percentile"]
    fp32 = rows[0].split("|")
    assert fp32[2].strip() == "1.0000" and fp32[3].strip() == "0.0000"
    assert float(fp32[4]) >= 0.5  # top-1 of the espresso and tabby crops
    columns = [c.strip() for c in table.splitlines()[4].split("|")]
    model_mb = float(fp32[columns.index("model MB")])
    resident = float(fp32[columns.index("resident MB@1")])
    # EfficientNet-Lite0 FP32 weighs ~19 MB; its session holds at least its weights.
    assert 10 < model_mb < 40 and resident >= 0.5 * model_mb
    int8 = rows[1].split("|")
    assert float(int8[columns.index("model MB")]) < 0.5 * model_mb
    assert (out / "accuracy.png").stat().st_size > 10_000
    assert "img/s at batch 1: round 5/5" in capsys.readouterr().out
