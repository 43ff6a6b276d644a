"""Helpers the benchmark scripts share: the output folder and log, percentiles of timings, and the device's
copy bandwidth."""

from __future__ import annotations

import logging
import statistics
import sys
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank over the sorted values; nan when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def copy_gbps(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy of ``nbytes`` on the current CUDA device: (read + write) GB/s, median of
    ``iters`` CUDA-event-timed copies after a warm-up. The HBM ceiling every GPU roofline here divides by."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return 2 * nbytes / statistics.median(times) / 1e6


def setup_output(out: str, log_name: str) -> Path:
    """Create the output folder and log INFO lines to ``<out>/<log_name>`` and to stderr."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[logging.FileHandler(path / log_name), logging.StreamHandler(sys.stderr)],
    )
    return path
