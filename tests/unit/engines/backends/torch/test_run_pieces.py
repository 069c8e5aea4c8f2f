"""``engines.backends.torch.runner.run_pieces``: a batch run as graphs of its rows
(``gpu.split_batches``) answers every row from its own input, in its place.

The graphs are outside the unit: each is stood in for by a function of the first rows of the
shared input buffers, as a captured graph reads them (``TorchRunner._prepare``: ``raw[:bucket]``),
writing into outputs of its own bucket that a later replay of the same bucket overwrites, as
a graph's static outputs are. The plans are ``engines.base.split_rows``'s own; the moves and
offsets are the unit's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch", reason="the torch runner needs torch (the reference extra)")

import torch

from engines.backends.torch.runner import run_pieces
from engines.base import split_rows

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def answer(pixels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a graph computes of each row: a value that tells the rows apart."""
    return pixels.float().flatten(1).sum(1, keepdim=True) * scale[:, :1].float()


def run(rows: int, pieces: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The batch's answers through ``run_pieces`` and the answers of its rows one by one."""
    generator = torch.Generator().manual_seed(rows)
    pixels = torch.randint(0, 256, (rows, 3, 4, 4), dtype=torch.uint8, generator=generator)
    scale = torch.randint(1, 9, (rows, 2), dtype=torch.int32, generator=generator)
    # Two inputs, each a device buffer of the max batch with stale rows past the batch.
    staged = [
        torch.full((BUCKETS[-1], 3, 4, 4), 255, dtype=torch.uint8),
        torch.zeros(BUCKETS[-1], 2, dtype=torch.int32),
    ]
    staged[0][:rows] = pixels
    staged[1][:rows] = scale
    graph_outputs = {b: (torch.empty(b, 1),) for b in BUCKETS}
    host = np.full((rows, 1), np.nan, dtype=np.float32)

    def replay(size: int) -> tuple[torch.Tensor, ...]:
        bucket = next(b for b in BUCKETS if b >= size)
        (out,) = graph_outputs[bucket]
        out.copy_(answer(staged[0][:bucket], staged[1][:bucket]))
        return graph_outputs[bucket]

    def copy_out(outputs: Sequence[torch.Tensor], start: int, size: int) -> None:
        host[start : start + size] = outputs[0][:size].numpy()

    last = run_pieces(pieces, staged, replay, copy_out)
    assert last[0].shape[1:] == (1,)
    want = np.concatenate(
        [answer(pixels[i : i + 1], scale[i : i + 1]).numpy() for i in range(rows)]
    )
    return host, want


@pytest.mark.parametrize("rows", [33, 45, 100, 128, 1, 60])
def test_each_row_is_answered_from_its_own_input_in_its_place(rows: int) -> None:
    pieces = split_rows(rows, BUCKETS)
    host, want = run(rows, pieces)
    np.testing.assert_array_equal(host, want)
    if rows in (45, 100):
        assert len(pieces) > 1  # the cases that move rows are among them


@settings(max_examples=60, deadline=None)
@given(st.integers(1, BUCKETS[-1]), st.integers(1, 3))
def test_any_plan_of_split_rows_answers_every_row_in_its_place(rows: int, max_pieces: int) -> None:
    host, want = run(rows, split_rows(rows, BUCKETS, max_pieces))
    np.testing.assert_array_equal(host, want)
