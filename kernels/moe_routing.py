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
    topk_phys = to_physical(topk_logical, logical_to_physical, replica_counts, expert_counts, live)
    return topk_w.to(out_dtype), topk_phys


def moe_route_grouped_torch(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
    live: torch.Tensor | None = None,
    *,
    softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (``noaux_tc``), as transformers' ``DeepseekV3TopkRouter``: sigmoid scores of
    the float32 ``router_logits`` [T, E]; ``bias`` [E] added for the choice only; the ``topk_group`` of
    ``n_group`` groups whose two best biased scores sum highest; the top-k experts within them; their
    unbiased scores as weights, renormalised (plus 1e-20) where asked, times ``scaling``. Then physical
    replicas and counters as ``moe_route_torch``. Returns (weights [T, k] in ``out_dtype``, ids).

    ``softmax``: DeepSeek-V2's (``DeepseekV2TopkRouter``): softmax scores, no bias, each group scored by
    its best score (``greedy`` is one group)."""
    scores = router_logits.float().softmax(dim=-1) if softmax else router_logits.float().sigmoid()
    choice = scores if softmax else scores + bias.float()
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    top = 1 if softmax else min(2, experts // n_group)
    group_scores = grouped.topk(top, dim=-1)[0].sum(dim=-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)
    choice = choice.masked_fill(~keep.bool().repeat_interleave(experts // n_group, dim=1), float("-inf"))
    topk_logical = choice.topk(top_k, dim=-1)[1]
    topk_w = scores.gather(1, topk_logical)
    if renormalize:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    topk_phys = to_physical(topk_logical, logical_to_physical, replica_counts, expert_counts, live)
    return (topk_w * scaling).to(out_dtype), topk_phys


def to_physical(
    topk_logical: torch.Tensor,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    live: torch.Tensor | None,
) -> torch.Tensor:
    """Each (token, k) pair's physical replica (``token % replicas``), counted in ``expert_counts``."""
    top_k = topk_logical.shape[1]
    token = torch.arange(topk_logical.shape[0], device=topk_logical.device).unsqueeze(1)
    replica = token % replica_counts[topk_logical]
    topk_phys = logical_to_physical[topk_logical, replica]
    flat = topk_phys.reshape(-1)
    if live is None:
        ones = torch.ones_like(flat)
    else:
        ones = (live[: topk_logical.shape[0]] != 0).to(flat.dtype).repeat_interleave(top_k)
    expert_counts.scatter_add_(0, flat, ones)
    return topk_phys
