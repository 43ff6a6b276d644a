"""Linear projection without bias: PyTorch reference (the op table's ``linear``)."""

from __future__ import annotations

import torch


def linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K] -> x @ w.T, [M, N]."""
    return x @ w.t()
