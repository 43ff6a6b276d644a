"""What the Triton launch heuristics read about the GPU: its SM count, cached per device.

Host-side only (no kernel here); it must not read device values, so it is safe while a graph is captured.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when ``device`` has no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
