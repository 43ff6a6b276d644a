"""Mixture-of-experts expert computation over physical experts: PyTorch reference.

Routing (softmax, top-k, renormalisation, logical-to-physical mapping) happens in the model's MoE layer;
this op only runs the chosen experts and combines their outputs with the routing weights. Float8 expert
weights (``Fp8Weight``) compute as the tensor they stand for, ``dequantize()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_weight import Fp8Weight, as_dense


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    has_absent: bool = False,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate || up); w2: [E, H, I]; topk_weights/ids: [T, k] (physical ids).

    Returns sum_k weight_k * expert_k(x) in x's dtype, [T, H]. A negative id is a pair whose expert this
    rank does not hold (an expert-parallel group's other ranks compute it): it adds nothing
    (``has_absent`` says such ids may occur; the reference handles them either way). An ``Fp8Weight`` is
    dequantised whole, once a call: a reference, not a fast path.
    """
    w13, w2 = as_dense(w13), as_dense(w2)
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    flat_ids = torch.where(flat_ids < 0, num_experts, flat_ids)  # absent pairs sort last, never run
    flat_w = topk_weights.reshape(-1)
    token_idx = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start : start + count]
        start += count
        tokens = token_idx[sel]
        h = x[tokens]
        gate_up = h @ w13[expert].t()
        inter = w13.shape[1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (act @ w2[expert].t()) * flat_w[sel].unsqueeze(1).to(x.dtype)
        out.index_add_(0, tokens, y)
    return out
