"""SiLU-and-mul for gated MLPs: PyTorch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate || up) -> [T, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
