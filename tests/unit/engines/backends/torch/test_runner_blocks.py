"""Which device blocks of a batch the torch runner copies in one go: the rows of requests
sliced in order from one decoded batch, and nothing else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch runner needs torch (the reference extra)")


def test_rows_sliced_in_order_from_one_batch_follow_each_other() -> None:
    from engines.backends.torch.runner import adjacent, follows

    batch = torch.arange(6 * 3 * 2, dtype=torch.uint8).reshape(6, 3, 2)
    a, b, c = batch[0:1], batch[1:3], batch[3:6]
    assert follows(a, b) and follows(b, c)
    assert not follows(b, a)  # out of order
    assert not follows(a, batch[2:3])  # a row between them
    assert not follows(a, batch.clone()[1:2])  # another allocation
    assert not follows(batch[0:1, :, :1], batch[1:2, :, :1])  # not contiguous
    joined = adjacent([a, b, c])
    assert torch.equal(joined, batch) and joined.data_ptr() == batch.data_ptr()  # a view
    assert torch.equal(adjacent([b, c]), batch[1:6])
    assert adjacent([b]) is b
