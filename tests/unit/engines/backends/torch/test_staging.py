"""The torch runner's host-side staging (``staging.staged_copy``), on the CPU (the GPU half is
in tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch backend is torch code: torch is not installed")

from engines.backends.torch.staging import staged_copy


@pytest.mark.parametrize(
    "sizes",
    [
        [5],  # one small block: copied in place
        [64],  # one block over the parallel threshold: sliced over the copy threads
        [32, 1, 7, 64, 3],  # a gathered batch: blocks of every size, some sliced
        [1] * 70,  # a batch of single images: more blocks than copy threads
    ],
)
def test_blocks_land_on_their_rows_as_if_joined(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    blocks = [rng.integers(0, 256, (n, 3, 224, 224), dtype=np.uint8) for n in sizes]
    total = sum(sizes)
    staging = np.full((total + 2, 3, 224, 224), 7, dtype=np.uint8)  # two rows past the batch
    staged_copy(staging[:total], blocks)
    start = 0
    for block in blocks:
        np.testing.assert_array_equal(staging[start : start + len(block)], block)
        start += len(block)
    assert (staging[total:] == 7).all()
