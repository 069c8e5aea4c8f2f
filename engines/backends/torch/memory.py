"""The GPU memory the torch backend may take: a cap on torch's allocator, per process and GPU.

An engine caps each of its GPUs at ``gpu.memory_fraction`` when it loads; a runner whose
graphs do not fit under the cap is retried with smaller max batches (``TorchEngine``).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


# torch caps the caching allocator per process and device; several models in one engine
# process share the cap, so the smallest fraction any of them asked for holds.
_memory_fractions: dict[int, float] = {}


def limit_memory(device: int, fraction: float) -> float:
    """Cap torch's allocator on ``device`` at ``fraction`` of its memory (or a smaller cap
    already set), never below what it already holds (a model loaded later must not starve
    the ones serving); the cap that now holds."""
    held = min(fraction, _memory_fractions.get(device, 1.0))
    in_use = reserved(device) / torch.cuda.get_device_properties(device).total_memory
    if held < in_use:
        log.warning(
            "GPU %d: a memory_fraction of %.2f is below the %.2f already in use; capping at that",
            device,
            held,
            in_use,
        )
        held = min(1.0, in_use)
    _memory_fractions[device] = held
    torch.cuda.set_per_process_memory_fraction(held, device)
    return held


def reserved(device: int) -> int:
    """Bytes torch's allocator holds on ``device`` (weights, buffers, graph pools, cache)."""
    return int(torch.cuda.memory_reserved(device))
