"""Mixture-of-experts expert computation over physical experts: PyTorch reference.

Routing (softmax, top-k, renormalisation, logical-to-physical mapping) happens in the model's MoE layer;
``fused_moe_torch`` only runs the chosen experts and combines their outputs with the routing weights;
``moe_block_torch`` is routing and experts together (one op, so that a backend may fuse them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_routing import moe_route_torch


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate || up); w2: [E, H, I]; topk_weights/ids: [T, k] (physical ids).

    Returns sum_k weight_k * expert_k(x) in x's dtype, [T, H].
    """
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1)
    token_idx = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
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


def moe_block_torch(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    physical_by_token: torch.Tensor,
) -> torch.Tensor:
    """Routing and experts of one MoE block on one rank: ``moe_route_torch`` (its weights in x's dtype)
    then ``fused_moe_torch``. ``physical_by_token`` [S, E] int32 tabulates the same replica choice for the
    first S tokens (row t: ``logical_to_physical[e, t % replica_counts[e]]``); the Triton op routes from
    it inside its expert kernels, and this reference reads the two tables it was built from."""
    weights, ids = moe_route_torch(
        router_logits, top_k, renormalize, logical_to_physical, replica_counts, expert_counts, x.dtype
    )
    return fused_moe_torch(x, w13, w2, weights, ids)
