"""MoE routing for one layer, from router logits to physical experts: PyTorch reference.

softmax over the logical experts (float32), top-k, optional renormalisation of the k weights, the cast
to the activations' dtype (as transformers does), the choice of a physical replica per (token, k) pair
(replica ``token % replicas of that expert``, so replicas share the load), and the per-physical-expert
token counters EPLB reads, updated in place (no host synchronisation: graph-safe).
"""

from __future__ import annotations

import torch

from kernels.linear import add_rms_norm_linear_torch


def moe_route_torch(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]; logical_to_physical: [E, R] int64 (-1 past an expert's replicas);
    replica_counts: [E] int64; expert_counts: [P] int64, += 1 per pair routed to a physical expert.

    Returns (weights [T, k] in ``out_dtype``, physical ids [T, k] int64), the k in descending weight.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_w, topk_logical = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    token = torch.arange(router_logits.shape[0], device=router_logits.device).unsqueeze(1)
    replica = token % replica_counts[topk_logical]
    topk_phys = logical_to_physical[topk_logical, replica]
    flat = topk_phys.reshape(-1)
    expert_counts.scatter_add_(0, flat, torch.ones_like(flat))
    return topk_w.to(out_dtype), topk_phys


def add_rms_norm_route_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    *,
    arrivals: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MoE layer's post-attention norm, router and routing as one op, so that a backend can fuse them:
    ``add_rms_norm_linear_torch`` with the router ``gate`` [E, H], then ``moe_route_torch`` of its logits
    (weights in x's dtype). Returns (h, x + residual, weights [T, k], physical ids [T, k]). ``arrivals``:
    a zeroed int32 word the caller keeps per layer, for a backend that routes inside the router's kernel
    (unused here)."""
    logits, h, summed = add_rms_norm_linear_torch(x, residual, norm_weight, eps, gate, True)
    assert h is not None
    weights, ids = moe_route_torch(
        logits, top_k, renormalize, logical_to_physical, replica_counts, expert_counts, x.dtype
    )
    return h, summed, weights, ids
