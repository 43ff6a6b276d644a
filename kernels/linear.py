"""Linear projection without bias: PyTorch reference (the op table's ``linear``)."""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul_torch
from kernels.fp8_weight import Fp8Weight, as_dense
from kernels.norm import fused_add_rms_norm_torch, rms_norm_torch


def linear_torch(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x: [M, K]; w: [N, K] -> x @ w.T, [M, N]. A float8 weight computes as the tensor it stands for."""
    return x @ as_dense(w).t()


def add_rms_norm_linear_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor | Fp8Weight,
    need_normed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A layer's norm and the projection that consumes it, as one op so that a backend can fuse them:
    h = rms_norm(x + residual) * norm_weight (rms_norm(x) where residual is None); returns
    (h @ w.T, h if need_normed else None, x + residual, or x itself where residual is None).

    A float32 ``w`` beside 16-bit activations (DeepSeek's router) multiplies h in float32, as transformers
    does (``linear(h.float(), w)``), and the projection comes out in float32."""
    if residual is None:
        h, summed = rms_norm_torch(x, norm_weight, eps), x
    else:
        h, summed = fused_add_rms_norm_torch(x, residual, norm_weight, eps)
    return linear_torch(promoted(h, w), w), (h if need_normed else None), summed


def promoted(h: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """h in float32 where the weight is float32 and h is not (a float32 router over 16-bit activations)."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and h.dtype != torch.float32:
        return h.to(torch.float32)
    return h


def silu_mul_linear_torch(
    gate_up: torch.Tensor, w: torch.Tensor | Fp8Weight, add: torch.Tensor | None = None
) -> torch.Tensor:
    """A gated MLP's down projection with its activation: silu(gate) * up @ w.T (gate_up [M, 2I], gate ||
    up; w [N, I]), plus ``add`` [M, N] where given (rounded as the two ops and an add in gate_up's dtype)."""
    out = linear_torch(silu_and_mul_torch(gate_up), w)
    return out if add is None else out + add
