"""GPU tests: every test here is skipped, with the reason, where torch has no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.backends import cuda_available

HERE = Path(__file__).parent
NO_GPU = pytest.mark.skip(reason="needs a CUDA GPU and torch built with CUDA")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(NO_GPU)


@pytest.fixture(scope="session")
def resnet50_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import zoo

    folder = tmp_path_factory.mktemp("resnet50")
    zoo.GENERATORS["resnet50"](folder)
    return folder / "model.onnx"
