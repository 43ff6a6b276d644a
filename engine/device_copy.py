"""Small host-to-device copies that do not make the host wait for the device.

A copy from pageable host memory to a GPU waits for every kernel queued before it; one from pinned memory
with ``non_blocking`` does not. The engine's per-step inputs (block tables, positions, per-row sampling
values) are small, so pinning a fresh copy of each costs less than the wait it avoids, which under
asynchronous scheduling would be the whole step in flight.
"""

from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = True) -> torch.Tensor:
    """Copy a small host tensor to ``device``; ``non_blocking`` on a GPU goes through pinned memory (a
    fresh copy: the source may be reused at once) so the host does not wait for queued device work."""
    if non_blocking and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it alive
    return t.to(device)
