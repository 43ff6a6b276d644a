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
unspecified). Each logit becomes one integer key that orders like it, with the expert index in its low
bits as the tie-break (32 bits for 16-bit logits, whose widened mantissas end in zeros; 64 for float32),
so a round is one max-reduction, and the chosen logit is decoded from the key exactly. The weights are
``exp(l - max) / sum``, renormalised over the k if asked, stored in ``out_dtype``; the physical id is
``logical_to_physical[e, token % replica_counts[e]]``, stored as int64, and each (token, k) pair adds 1 to
``expert_counts[physical]`` with a relaxed atomic. The physical id of every expert is gathered before the
PDL wait (the tables are step inputs), and each round picks its chosen expert's id out of registers with
a second max-reduction.
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
    live_ptr,
    num_tokens,
    num_experts,
    stride_lt,
    stride_le,
    stride_l2p_e,
    stride_l2p_r,
    stride_counts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    KEY64: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    expert_mask = experts < num_experts
    # Every expert's physical replica for these tokens, before the wait: the placement tables are step
    # inputs that no kernel of the step writes, so no dependent round trip to them follows the selection.
    replicas = tl.load(replica_counts_ptr + experts, mask=expert_mask, other=1)  # pre-wait: step input
    replica = tokens.to(tl.int32)[:, None] % replicas.to(tl.int32)[None, :]
    tile_mask = token_mask[:, None] & expert_mask[None, :]
    l2p_ptrs = l2p_ptr + experts[None, :] * stride_l2p_e + replica * stride_l2p_r
    physical_of = tl.load(l2p_ptrs, mask=tile_mask, other=0).to(tl.int32)  # pre-wait: step input
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this

    ptrs = logits_ptr + tokens[:, None] * stride_lt + experts[None, :] * stride_le
    logits = tl.load(ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    logits = tl.where(expert_mask[None, :], logits, float("-inf"))
    logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 -> +0.0: the keys below order the zeros alike
    row_max = tl.max(logits, axis=1)
    denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)

    # One integer key per logit that orders like the logit, with ties broken towards the lowest index,
    # so each of the k rounds below is one max-reduction (argmax-and-exclude in one step).
    bits = logits.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # flip a negative's magnitude bits: sign-magnitude order
    rank = BLOCK_E - 1 - experts
    if KEY64:
        key = (ordered.to(tl.int64) << 32) | rank.to(tl.int64)[None, :]
        lowest = -9223372036854775807 - 1
    else:
        # A 16-bit float widened to float32 has at least 13 zero mantissa bits at the bottom (ones, once a
        # negative's are flipped), so the index fits there without changing the order of distinct logits.
        key = (ordered & ~(BLOCK_E - 1)) | rank[None, :]
        lowest = -2147483647 - 1
    key = tl.where(expert_mask[None, :], key, lowest)  # padding lanes and, below, taken experts: never max

    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_phys = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        taken = key == best[:, None]  # one expert per token: the index makes every key distinct
        key = tl.where(taken, lowest, key)
        # Its physical id; an out-of-range choice (only if k exceeded the experts) finds none: -1 -> 0.
        physical_j = tl.maximum(tl.max(tl.where(taken & expert_mask[None, :], physical_of, -1), axis=1), 0)
        if KEY64:
            high = (best >> 32).to(tl.int32)
        else:
            high = best & ~(BLOCK_E - 1)
            high = high | ((high >> 31) & (BLOCK_E - 1))  # a negative's low bits were ones before the index
        value = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)  # the logit back, exactly
        prob = tl.exp(value - row_max) / denom
        top_w = tl.where(slots[None, :] == j, prob[:, None], top_w)
        top_phys = tl.where(slots[None, :] == j, physical_j[:, None], top_phys)

    pair_mask = token_mask[:, None] & (slots[None, :] < TOP_K)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_offs = tokens[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out_offs, top_w.to(weights_ptr.dtype.element_ty), mask=pair_mask)

    physical = top_phys.to(tl.int64)
    tl.store(ids_ptr + out_offs, physical, mask=pair_mask)
    ones = tl.full([BLOCK_T, BLOCK_K], 1, dtype=counts_ptr.dtype.element_ty)
    count_mask = pair_mask
    if HAS_LIVE:  # a graph's padding rows are not live: their pairs count for no expert
        count_mask = count_mask & (tl.load(live_ptr + tokens, mask=token_mask, other=0) != 0)[:, None]
    tl.atomic_add(counts_ptr + physical * stride_counts, ones, mask=count_mask, sem="relaxed")


def _needs_64_bit_keys(dtype: torch.dtype, block_e: int) -> bool:
    """Whether the kernel's selection keys need 64 bits: float32 logits use every bit of the key's top
    half; 16-bit logits widened to float32 leave 13 (fp16) or 16 (bf16) zero bits for the expert index."""
    free_bits = {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)
    return block_e > 1 << free_bits


def moe_route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] (any float dtype, any strides); logical_to_physical: [E, R] int64 (-1 past an
    expert's replicas); replica_counts: [E] int64; expert_counts: [P] int64, += 1 per pair, in place;
    live: None or [>= T] contiguous, nonzero where a row's pairs count (bool, or sequence lengths).

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
        live if live is not None else expert_counts, num_tokens, num_experts,
        router_logits.stride(0), router_logits.stride(1),
        logical_to_physical.stride(0), logical_to_physical.stride(1), expert_counts.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, KEY64=_needs_64_bit_keys(router_logits.dtype, block_e),
        HAS_LIVE=live is not None,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        **pdl_kwargs(router_logits.device), num_warps=num_warps,
    )  # fmt: skip
    return weights, ids
