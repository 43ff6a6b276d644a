"""Speculative L2 prefetch of a batch-1 decode step's experts: the router run early on the layer's input.

Why: at batch 1 a MoE layer's expert weights (Qwen3-30B-A3B: 75 MB of its 113) can only stream once the
routing, after attention, has chosen them, while HBM sits almost idle through the attention, the merge of
its splits, the router and the routing (~12 us of a ~45 us layer). The router's input differs from the
layer's input only by the attention output added to the residual, so the router applied to the layer's
input (normalised with the post-attention norm's weight) names most of the experts the layer will choose.
This kernel computes that guess and asks L2 to fetch a part of each guessed expert's weights
(``cp.async.bulk.prefetch.L2``, a hint: no registers, no wait), on a side stream beside the attention, so
that the expert kernels later find those bytes in L2. A wrong guess costs HBM bytes in an idle window and
nothing else: results never depend on it (the expert kernels read the weights as always).

One launch of ``num_programs`` programs: program p computes the guessed logits of ``ROWS`` router rows
(the norm is recomputed by each, a few KB from L2), stores them, and adds one to an arrival count; every
program then waits for the count to reach ``num_programs`` (the programs are few and hold nothing another
kernel waits for, so the wait always ends), takes the same top-k of all logits, and issues its share of
the prefetch chunks. The last program to leave resets the counts for the next launch. A run with one
program (the CPU interpreter, which runs programs one after another) never waits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A prefetch instruction fetches this many bytes (the chain benchmark's best, ``benchmarks/chain_bench.py``:
# 64 KB from many programs; a few programs issuing many bulk prefetches each held their SM for 19-55 us).
CHUNK_BYTES = 16384


@triton.jit
def _bulk_prefetch(base, nbytes, lane0, lanes_total, LANES: tl.constexpr, CHUNK: tl.constexpr):
    """Prefetch ``nbytes`` from ``base`` (an int8 pointer, 16-byte aligned) in CHUNK pieces: this program's
    LANES lanes take pieces lane0, lane0 + lanes_total, ... (lane0 a tensor of LANES lane numbers)."""
    for start in range(0, nbytes, lanes_total * CHUNK):
        offs = start + lane0.to(tl.int64) * CHUNK
        size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 s; and.b32 s, $2, -16; "
            "setp.gt.s32 p, s, 0; @p cp.async.bulk.prefetch.L2.global [$1], s; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + offs, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _expert_prefetch_kernel(
    h_ptr,
    g_ptr,
    router_ptr,
    logits_ptr,
    counts_ptr,
    l2p_ptr,
    pred_ptr,
    w13_ptr,
    w2_ptr,
    num_experts,
    hidden,
    eps,
    stride_l2p,
    w13_expert_bytes,
    up_offset_bytes,
    gate_bytes,
    w2_expert_bytes,
    down_bytes,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LANES: tl.constexpr,
    CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    rows = pid * ROWS + tl.arange(0, ROWS)
    r_mask = rows < num_experts
    w = tl.load(
        router_ptr + rows.to(tl.int64)[:, None] * hidden + offs_h[None, :],
        mask=r_mask[:, None] & h_mask[None, :],
        other=0.0,
    )
    h = tl.load(h_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    dtype = router_ptr.dtype.element_ty  # the norm's roundings are the reference's (``kernels/norm.py``)
    xn = (g * (h * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(logits_ptr + rows, tl.sum(w.to(tl.float32) * xn[None, :], axis=1), mask=r_mask)
    tl.debug_barrier()  # every thread's logits stored before the arrival is released
    tl.atomic_add(counts_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counts_ptr, 0, sem="acquire", scope="gpu")
    while arrived < nprog:
        arrived = tl.atomic_add(counts_ptr, 0, sem="acquire", scope="gpu")
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    logits = tl.load(logits_ptr + offs_e, mask=e_mask, other=float("-inf"), cache_modifier=".cg")
    ks = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(logits, axis=0)
        idx = tl.min(tl.where(logits == best, offs_e, BLOCK_E), axis=0)
        chosen = tl.where(ks == k, idx, chosen)
        logits = tl.where(offs_e == idx, float("-inf"), logits)
    k_mask = ks < TOP_K
    phys = tl.load(l2p_ptr + chosen.to(tl.int64) * stride_l2p, mask=k_mask, other=0)  # replica 0: token 0's
    if pid == 0:
        tl.store(pred_ptr + ks, phys.to(tl.int32), mask=k_mask)
    if PREFETCH:
        lane0 = pid * LANES + tl.arange(0, LANES)
        lanes_total = nprog * LANES
        w13_bytes = w13_ptr.to(tl.pointer_type(tl.int8))
        w2_bytes = w2_ptr.to(tl.pointer_type(tl.int8))
        for k in tl.static_range(TOP_K):
            e = tl.sum(tl.where(ks == k, phys, 0), axis=0).to(tl.int64)
            base = w13_bytes + e * w13_expert_bytes
            _bulk_prefetch(base, gate_bytes, lane0, lanes_total, LANES, CHUNK)
            _bulk_prefetch(base + up_offset_bytes, gate_bytes, lane0, lanes_total, LANES, CHUNK)
            _bulk_prefetch(w2_bytes + e * w2_expert_bytes, down_bytes, lane0, lanes_total, LANES, CHUNK)
    tl.debug_barrier()
    left = tl.atomic_add(counts_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == nprog - 1:  # every program is past its wait: the counts can go back to zero
        tl.atomic_xchg(counts_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counts_ptr, 0, sem="relaxed", scope="gpu")


def expert_prefetch_triton(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    logical_to_physical: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    gate_up_fraction: float,
    down_fraction: float,
    logits: torch.Tensor,
    counts: torch.Tensor,
    pred: torch.Tensor,
    num_programs: int | None = None,
) -> None:
    """Guess one row's experts from h [1, H] (``logits`` [E] float32 and ``counts`` [2] int32, zeroed once,
    are scratch; ``pred`` [top_k] int32 gets the guessed physical ids) and prefetch into L2 the first
    ``gate_up_fraction`` of each guessed expert's gate rows and of its up rows (w13 [E, 2I, H]) and the first
    ``down_fraction`` of its down rows (w2 [E, H, I]). w13 and w2 are the expert weights' values (bf16 or
    float8), contiguous."""
    if h.dim() != 2 or h.shape[0] != 1:
        raise ValueError(f"the expert prefetch guesses for one row; got h {tuple(h.shape)}")
    num_experts, hidden = router.shape
    if not (router.is_contiguous() and w13.is_contiguous() and w2.is_contiguous() and h.stride(-1) == 1):
        raise ValueError("the expert prefetch needs contiguous router and expert weights")
    cuda = h.device.type == "cuda"
    if num_programs is None:
        num_programs = 32 if cuda else 1
    rows = triton.next_power_of_2(triton.cdiv(num_experts, num_programs))
    grid = (triton.cdiv(num_experts, rows),)
    inter2 = w13.shape[1]
    es13, es2 = w13.element_size(), w2.element_size()
    row13, row2 = w13.shape[2] * es13, w2.shape[2] * es2

    def rows_bytes(fraction: float, n: int, row: int) -> int:
        return int(round(max(0.0, min(1.0, fraction)) * n)) * row

    _expert_prefetch_kernel[grid](
        h, norm_weight, router, logits, counts, logical_to_physical, pred, w13, w2,
        num_experts, hidden, eps, logical_to_physical.stride(0),
        w13[0].numel() * es13, (inter2 // 2) * row13, rows_bytes(gate_up_fraction, inter2 // 2, row13),
        w2[0].numel() * es2, rows_bytes(down_fraction, w2.shape[1], row2),
        TOP_K=top_k, ROWS=rows, BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        LANES=128 if cuda else 16, CHUNK=CHUNK_BYTES, PREFETCH=cuda, num_warps=4,
    )  # fmt: skip
