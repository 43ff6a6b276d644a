"""MoE routing for one layer, from router logits to physical experts: PyTorch reference.

softmax over the logical experts (float32), top-k, optional renormalisation of the k weights, the cast
to the activations' dtype (as transformers does), the choice of a physical replica per (token, k) pair
(replica ``token % replicas of that expert``, so replicas share the load), and the per-physical-expert
token counters EPLB reads, updated in place (no host synchronisation: graph-safe); with ``live``, only
the pairs of live rows count (a CUDA graph's padding rows are not live).
"""

from __future__ import annotations

import torch


def moe_route_torch(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]; logical_to_physical: [E, R] int64 (-1 past an expert's replicas);
    replica_counts: [E] int64; expert_counts: [P] int64, += 1 per pair routed to a physical expert;
    live: None (every row counts) or [>= T], nonzero where a row counts (bool, or sequence lengths).

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
    if live is None:
        ones = torch.ones_like(flat)
    else:
        ones = (live[: router_logits.shape[0]] != 0).to(flat.dtype).repeat_interleave(top_k)
    expert_counts.scatter_add_(0, flat, ones)
    return topk_w.to(out_dtype), topk_phys
