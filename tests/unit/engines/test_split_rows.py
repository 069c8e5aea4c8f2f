"""``engines.base.split_rows``: the graphs a batch runs as with ``gpu.split_batches``."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.base import MAX_PIECES, PIECE_ROWS, split_rows

POWERS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def padded(piece: int, buckets: list[int]) -> int:
    return min(size for size in buckets if size >= piece)


def test_a_batch_is_split_where_it_pads_fewer_rows() -> None:
    assert split_rows(45, POWERS) == [32, 13]  # 48 rows run, not 64
    assert split_rows(33, POWERS) == [32, 1]
    assert split_rows(100, POWERS) == [64, 32, 4]
    assert split_rows(60, POWERS) == [60]  # one graph of 64 costs less than 32 + 32
    assert split_rows(64, POWERS) == [64]
    assert split_rows(1, POWERS) == [1]
    assert split_rows(45, [64, 128, 256]) == [45]  # no bucket below it to split into


def test_more_rows_than_the_largest_bucket_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the buckets"):
        split_rows(257, POWERS)


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=12, unique=True),
    st.integers(1, 300),
)
def test_a_plan_covers_the_rows_and_never_costs_more_than_one_graph(
    buckets: list[int], rows: int
) -> None:
    buckets = sorted(buckets)
    if rows > buckets[-1]:
        with pytest.raises(ValueError):
            split_rows(rows, buckets)
        return
    plan = split_rows(rows, buckets)
    assert sum(plan) == rows
    assert 1 <= len(plan) <= MAX_PIECES
    assert all(piece in buckets for piece in plan[:-1])  # whole buckets but the last
    # Never larger than the one before: the rows moved to the front never overlap.
    assert all(later <= earlier for earlier, later in pairwise(plan))
    cost = sum(padded(piece, buckets) + PIECE_ROWS for piece in plan)
    assert cost <= padded(rows, buckets) + PIECE_ROWS
