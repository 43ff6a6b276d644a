"""MoE routing in one Triton launch: the semantics of ``kernels/moe_routing.py::moe_route_torch``.

Why: the reference runs about a dozen small torch kernels per MoE layer (softmax, top-k, sum, divide,
cast, arange, modulo, two gathers, ones, scatter-add). At decode batch 1 these are pure launch latency,
and Qwen3-30B-A3B (48 MoE layers) spends about half its step's device time in some 1,500 tiny kernels.
This kernel fuses softmax, top-k, renormalisation, the cast, the replica mapping and the counter scatter,
so routing costs one launch per MoE layer. It reads no device value on the host and allocates with
``torch.empty`` only, so it can be captured in a CUDA graph.

Each program routes ``BLOCK_T`` tokens: it loads their ``[BLOCK_T, E]`` logits (E masked up to a power of
two), takes the softmax denominator in float32, then picks the k experts by k rounds of
argmax-and-exclude. Selection compares the float32 logits rather than the probabilities: softmax is
strictly increasing in the logit, so the order is the reference's, and rounding cannot turn two distinct
logits into a tie. Among equal logits the lowest expert index wins (``torch.topk`` leaves that order
unspecified). The weights are ``exp(l - max) / sum``, renormalised over the k if asked, stored in
``out_dtype``; the physical id is ``logical_to_physical[e, token % replica_counts[e]]``, stored as int64,
and each (token, k) pair adds 1 to ``expert_counts[physical]`` with a relaxed atomic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, pdl_wait

# Tokens per program are capped so that a program's logits tile stays about this many elements (16 tokens
# at E = 128), and small batches spread one token per program over as many SMs as possible.
_TILE_ELEMENTS = 2048
_TARGET_PROGRAMS = 128


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    l2p_ptr,
    replica_counts_ptr,
    counts_ptr,
    num_tokens,
    num_experts,
    stride_lt,
    stride_le,
    stride_l2p_e,
    stride_l2p_r,
    stride_counts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    expert_mask = experts < num_experts

    ptrs = logits_ptr + tokens[:, None] * stride_lt + experts[None, :] * stride_le
    logits = tl.load(ptrs, mask=token_mask[:, None] & expert_mask[None, :], other=0.0).to(tl.float32)
    logits = tl.where(expert_mask[None, :], logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)

    # k rounds of argmax over the experts not yet taken; ties go to the lowest index.
    available = tl.broadcast_to(expert_mask[None, :], [BLOCK_T, BLOCK_E])
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_e = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        candidates = tl.where(available, logits, float("-inf"))
        best = tl.max(candidates, axis=1)
        is_best = available & (candidates == best[:, None])
        choice = tl.min(tl.where(is_best, experts[None, :], BLOCK_E), axis=1)
        choice = tl.minimum(choice, num_experts - 1)  # a NaN row matches nothing: stay in bounds
        available = available & (experts[None, :] != choice[:, None])
        prob = tl.exp(best - row_max) / denom
        top_w = tl.where(slots[None, :] == j, prob[:, None], top_w)
        top_e = tl.where(slots[None, :] == j, choice.to(tl.int64)[:, None], top_e)

    pair_mask = token_mask[:, None] & (slots[None, :] < TOP_K)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_offs = tokens[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out_offs, top_w.to(weights_ptr.dtype.element_ty), mask=pair_mask)

    # Replica token % replicas(e) of each chosen expert, so the replicas share the load.
    replicas = tl.load(replica_counts_ptr + top_e, mask=pair_mask, other=1)
    replica = tokens[:, None] % replicas
    physical = tl.load(l2p_ptr + top_e * stride_l2p_e + replica * stride_l2p_r, mask=pair_mask, other=0)
    physical = physical.to(tl.int64)
    tl.store(ids_ptr + out_offs, physical, mask=pair_mask)
    ones = tl.full([BLOCK_T, BLOCK_K], 1, dtype=counts_ptr.dtype.element_ty)
    tl.atomic_add(counts_ptr + physical * stride_counts, ones, mask=pair_mask, sem="relaxed")


def moe_route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] (any float dtype, any strides); logical_to_physical: [E, R] int64 (-1 past an
    expert's replicas); replica_counts: [E] int64; expert_counts: [P] int64, += 1 per pair, in place.

    Returns (weights [T, k] in ``out_dtype``, physical ids [T, k] int64), the k in descending weight.
    """
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=out_dtype, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    max_block_t = max(1, _TILE_ELEMENTS // block_e)
    block_t = min(max_block_t, triton.next_power_of_2(triton.cdiv(num_tokens, _TARGET_PROGRAMS)))
    # One warp reduces a small tile with shuffles alone; larger tiles get up to four.
    num_warps = max(1, min(4, block_t * block_e // 256))
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, logical_to_physical, replica_counts, expert_counts,
        num_tokens, num_experts,
        router_logits.stride(0), router_logits.stride(1),
        logical_to_physical.stride(0), logical_to_physical.stride(1), expert_counts.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        **pdl_kwargs(router_logits.device), num_warps=num_warps,
    )  # fmt: skip
    return weights, ids
