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

At one token the routing also runs inside the router's projection (``add_rms_norm_route_triton``): the
post-attention norm and the router GEMV as in ``kernels/triton_linear.py``, then the program that finishes
last routes, so a batch-1 MoE layer has one launch fewer on its chain of dependent kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, pdl_wait
from kernels.triton_linear import (
    _norm_gemv_tile,
    add_rms_norm_linear_triton,
    norm_gemv_config,
    norm_gemv_plain,
    use_norm_gemv,
)

# Tokens per program are capped so that a program's logits tile stays about this many elements (16 tokens
# at E = 128), and small batches spread one token per program over as many SMs as possible.
_TILE_ELEMENTS = 2048
_TARGET_PROGRAMS = 128


@triton.jit
def _route_tile(
    logits,
    tokens,
    token_mask,
    weights_ptr,
    ids_ptr,
    l2p_ptr,
    replica_counts_ptr,
    counts_ptr,
    num_experts,
    stride_l2p_e,
    stride_l2p_r,
    stride_counts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Route a [BLOCK_T, BLOCK_E] tile of float32 logits (rows ``tokens``; columns past num_experts are
    masked here): softmax, top-k, weights, replica ids, counters (see the module docstring)."""
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    expert_mask = experts < num_experts
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
    token_mask = tokens < num_tokens
    ptrs = logits_ptr + tokens[:, None] * stride_lt + experts[None, :] * stride_le
    mask = token_mask[:, None] & (experts < num_experts)[None, :]
    logits = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    _route_tile(logits, tokens, token_mask, weights_ptr, ids_ptr, l2p_ptr, replica_counts_ptr, counts_ptr,
                num_experts, stride_l2p_e, stride_l2p_r, stride_counts,
                TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip


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


@triton.jit
def _norm_gemv_route_kernel(
    x_ptr,
    res_ptr,
    g_ptr,
    w_ptr,
    logits_ptr,
    sum_ptr,
    normed_ptr,
    weights_ptr,
    ids_ptr,
    l2p_ptr,
    replica_counts_ptr,
    counts_ptr,
    arrivals_ptr,
    num_experts,
    hidden,
    stride_wn,
    eps,
    stride_l2p_e,
    stride_l2p_r,
    stride_counts,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token: the norm-GEMV of the router (``_norm_gemv_tile``: BLOCK_N logits per program, the normed
    row and the residual sum from program 0), then the routing by the program that arrives last.

    Arrival: each program's threads have stored its logits (block barrier), then one thread adds 1 to
    ``arrivals`` with acquire-release semantics at GPU scope, which publishes the stores. The program that
    reads num_programs - 1 sees every program's logits; it loads them through L2 (``.cg``: no stale L1
    line), routes them as ``_moe_route_kernel`` does, and sets ``arrivals`` back to 0 for the next launch.
    So one launch at a time may use an ``arrivals`` word: each MoE layer owns one, and a layer runs on one
    stream."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    _norm_gemv_tile(x_ptr, res_ptr, g_ptr, w_ptr, logits_ptr, sum_ptr, normed_ptr, num_experts, hidden,
                    stride_wn, eps, HAS_RESIDUAL, True, BLOCK_N, BLOCK_H)  # fmt: skip
    tl.debug_barrier()  # every thread's logits are stored before the arrival
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        experts = tl.arange(0, BLOCK_E)
        mask = (experts < num_experts)[None, :]
        logits = tl.load(logits_ptr + experts[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        tokens = tl.zeros([1], dtype=tl.int64)
        _route_tile(logits.to(tl.float32), tokens, tokens == 0, weights_ptr, ids_ptr, l2p_ptr,
                    replica_counts_ptr, counts_ptr, num_experts, stride_l2p_e, stride_l2p_r, stride_counts,
                    TOP_K, RENORMALIZE, 1, BLOCK_E, BLOCK_K)  # fmt: skip
        tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")


def add_rms_norm_route_triton(
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
    """``kernels.moe_routing.add_rms_norm_route_torch`` on the GPU: one launch (``_norm_gemv_route_kernel``)
    for one plain row (as ``add_rms_norm_linear_triton``'s fused kernel) where ``arrivals`` (a zeroed int32
    word the caller keeps for this layer) is given; otherwise ``add_rms_norm_linear_triton`` then
    ``moe_route_triton``."""
    (m, hidden), num_experts = x.shape, gate.shape[0]
    if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != hidden:
        raise ValueError(f"router needs x [M, H] and gate [E, H]; got {tuple(x.shape)}, {tuple(gate.shape)}")
    fused = (
        arrivals is not None
        and norm_gemv_plain(x, residual, norm_weight, gate)
        and use_norm_gemv(m, num_experts, hidden)
        and 0 < top_k <= num_experts
    )
    if not fused:
        logits, h, summed = add_rms_norm_linear_triton(x, residual, norm_weight, eps, gate, True)
        weights, ids = moe_route_triton(logits, top_k, renormalize, logical_to_physical, replica_counts,
                                        expert_counts, x.dtype)  # fmt: skip
        return h, summed, weights, ids
    assert arrivals is not None and arrivals.dtype == torch.int32
    logits = torch.empty((1, num_experts), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    h = torch.empty_like(x)
    weights = torch.empty((1, top_k), dtype=x.dtype, device=x.device)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=x.device)
    cfg = norm_gemv_config(num_experts, hidden, x.device)
    _norm_gemv_route_kernel[(triton.cdiv(num_experts, cfg.block_n),)](
        x, residual if residual is not None else x, norm_weight, gate, logits, summed, h,
        weights, ids, logical_to_physical, replica_counts, expert_counts, arrivals,
        num_experts, hidden, gate.stride(0), eps,
        logical_to_physical.stride(0), logical_to_physical.stride(1), expert_counts.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_N=cfg.block_n, BLOCK_H=cfg.block_k,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return h, summed, weights, ids
