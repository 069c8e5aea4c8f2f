"""Host-side staging: a batch's blocks of rows copied straight into a runner's pinned buffer.

One core copies about 6 GB/s: a batch of 256 FP32 images (154 MB) would take longer to stage
than the H200 takes to run it. Large batches are copied in slices by several threads
(``np.copyto`` releases the GIL), from one pool shared by every runner of the process.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_COPY_SLICE_BYTES = 4 << 20


_COPY_THREADS = min(8, os.cpu_count() or 1)


# Process-wide, not per runner or engine: every runner of every model shares these threads,
# so staging never takes more than _COPY_THREADS cores however many runners there are.
_copy_pool: ThreadPoolExecutor | None = None


_copy_pool_lock = threading.Lock()


def staged_copy(dst: np.ndarray, blocks: Sequence[np.ndarray]) -> None:
    """``dst[:] = np.concatenate(blocks)`` without the joined array: each block copied
    straight to its rows of ``dst``, in parallel slices when the whole is large."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    offset = 0
    for block in blocks:
        rows = len(block)
        slices = max(1, min(_COPY_THREADS, block.nbytes // _COPY_SLICE_BYTES, rows))
        bounds = np.linspace(0, rows, slices + 1).astype(int)
        pieces += [
            (dst[offset + a : offset + b], block[a:b]) for a, b in itertools.pairwise(bounds)
        ]
        offset += rows
    if len(pieces) < 2 or dst.nbytes < 2 * _COPY_SLICE_BYTES:
        for target, source in pieces:
            np.copyto(target, source, casting="no")
        return
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="stage")
        pool = _copy_pool
    # One job per thread, each a share of the pieces: many small blocks (a batch of single
    # images) cost one submit per thread, not one per image.
    shares = [pieces[i::_COPY_THREADS] for i in range(min(_COPY_THREADS, len(pieces)))]
    for job in [pool.submit(_copy_all, share) for share in shares]:
        job.result()


def _copy_all(pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for target, source in pieces:
        np.copyto(target, source, casting="no")
