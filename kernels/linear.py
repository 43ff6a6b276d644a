"""Linear projection without bias, alone and behind a (residual-add +) RMSNorm: PyTorch reference.

``norm_linear`` is what a decoder layer does before a projection: ``fused_add_rms_norm`` (or, on the
first layer, where there is no residual yet, ``rms_norm`` with ``x`` itself as the residual) and then the
matmul. It returns all three tensors the layer needs: the projection, the normed input and the residual.
"""

from __future__ import annotations

import torch

from kernels.norm import fused_add_rms_norm_torch, rms_norm_torch


def linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K] -> x @ w.T, [M, N]."""
    return x @ w.t()


def norm_linear_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (normed @ w.T, normed, residual) with normed = rms_norm(x + residual) and residual =
    x + residual; without a residual, normed = rms_norm(x) and the returned residual is ``x`` itself."""
    if residual is None:
        normed, residual = rms_norm_torch(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm_torch(x, residual, norm_weight, eps)
    return normed @ w.t(), normed, residual
