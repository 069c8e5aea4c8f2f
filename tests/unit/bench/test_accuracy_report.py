"""`stoker accuracy` end to end on a few labelled photos the tests make themselves."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from skimage import data

from app import cli
from app.cli import main
from engines.backends import cuda_available
from tests.conftest import ROOT


def labelled_photos(folder: Path, each: int = 3) -> Path:
    """``each`` crops of skimage's espresso and of its tabby cat, named as ImageNet files
    are, so the names carry the labels: n07920052 is espresso, n02123045 tabby cat."""
    folder.mkdir()
    for i in range(each):
        crop = data.coffee()[i * 20 :, i * 30 :]
        Image.fromarray(crop).save(folder / f"n07920052_espresso_{i}.JPEG")
        Image.fromarray(data.chelsea()[:, i * 20 :]).save(folder / f"n02123045_tabby_{i}.JPEG")
    return folder


def report_repository(tmp_path: Path, efficientnet_dir: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    return repo


def test_accuracy_report_compares_precisions_and_calibrators(
    tmp_path: Path,
    efficientnet_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = report_repository(tmp_path, efficientnet_dir)
    photos = labelled_photos(tmp_path / "photos")
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
    # Timed on their own, batch-1 runs take about what the batch-1 rate says: within a
    # factor of three either way (a busy machine slows one measure more than the other).
    latency = float(fp32[columns.index("ms@1 (median)")])
    speed = float(fp32[columns.index("img/s@1")])
    assert 1000 / speed / 3 < latency < 3 * 1000 / speed
    assert (out / "accuracy.png").stat().st_size > 10_000
    assert "img/s at batch 1: round 5/5" in capsys.readouterr().out


def test_gpu_rows_need_a_gpu(
    tmp_path: Path, efficientnet_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpu`` where torch has no CUDA device: a clear refusal before anything is built
    (tests/gpu/test_accuracy_gpu.py runs the rows on a GPU)."""
    if cuda_available():
        pytest.skip("this machine has a GPU: tests/gpu/test_accuracy_gpu.py covers --gpu")
    repo = report_repository(tmp_path, efficientnet_dir)
    photos = labelled_photos(tmp_path / "photos", each=1)
    code = main(
        [
            "accuracy", "--model", "efficientnet_lite0", "--repository", str(repo),
            "--images", str(photos), "--gpu", "--out", str(tmp_path / "report"),
        ]
    )  # fmt: skip
    assert code == 2
    assert "--gpu needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "report").exists()


def test_without_matplotlib_the_table_is_printed_and_the_plot_skipped_saying_why(
    tmp_path: Path,
    efficientnet_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain install has no matplotlib (the bench extra): the report used to run the whole
    measurement and die importing it, the table never printed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` fails
    monkeypatch.setenv("STOKER_STORE__PATH", str(tmp_path / "store"))
    repo = report_repository(tmp_path, efficientnet_dir)
    photos = labelled_photos(tmp_path / "photos", each=1)
    out = tmp_path / "report"
    code = main(
        [
            "accuracy", "--model", "efficientnet_lite0", "--repository", str(repo),
            "--images", str(photos), "--precisions", "fp32", "--batches", "1",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    assert "no plot: matplotlib is not installed" in first and "[bench]" in first
    assert "| fp32 |" in printed and "no plot: matplotlib" in printed.splitlines()[-1]
    assert "| fp32 |" in (out / "accuracy.md").read_text()
    assert not (out / "accuracy.png").exists()


def test_a_missing_folder_or_model_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photos = labelled_photos(tmp_path / "photos", each=1)
    missing = ["accuracy", "--model", "efficientnet_lite0", "--images", "/nonexistent"]
    assert main(missing) == 2
    assert capsys.readouterr().err == "stoker accuracy: --images /nonexistent is not a folder\n"
    unknown = ["accuracy", "--model", "nope", "--images", str(photos)]
    assert main([*unknown, "--repository", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("stoker: model 'nope'") and len(error.splitlines()) == 1


def test_a_source_checkout_reaches_the_accuracy_tool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the installed entry points, ``stoker accuracy`` says how to run it from the
    checkout, and ``python -m bench accuracy`` is that command."""
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert main(["accuracy", "--model", "x", "--images", str(tmp_path)]) == 2
    assert "python -m bench accuracy" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "bench", "accuracy", "--model", "x", "--images", "/nonexistent"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == "stoker accuracy: --images /nonexistent is not a folder\n"
    usage = subprocess.run(
        [sys.executable, "-m", "bench", "accuracy", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    assert usage.startswith("usage: python -m bench accuracy") and "--calibrate-on" in usage
