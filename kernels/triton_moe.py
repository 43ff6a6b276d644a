"""Fused mixture-of-experts expert computation: Triton version of ``kernels/moe.py``.

Pipeline (no host synchronisation, so it can sit inside a captured CUDA graph):

1. ``moe_align_block_size``: sort the ``T * top_k`` token-expert pairs by expert and pad each expert's
   run to a multiple of the tile height ``BLOCK_M``; every tile then belongs to one expert. Buffers are
   sized by an upper bound read from shapes; tiles past the padded total exit. Decode-sized batches use
   one single-program Triton kernel (two launches in all); larger ones vectorised torch ops.
2. ``_moe_gemm_kernel`` (one grouped GEMM, used twice): each program computes a ``BLOCK_M x BLOCK_N``
   tile, gathering activation rows by the sorted pair ids and reading that tile's expert weights.
   Gate-up: ``x[pair // top_k] @ w13[e].T`` -> ``[T*k, 2I]``. Down: ``act[pair] @ w2[e].T`` times the
   pair's routing weight -> ``[T*k, H]``.
3. SiLU-and-mul between them (``kernels/triton_activation.py``), and a sum over top-k at the end (torch,
   which accumulates in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_activation import silu_and_mul_triton


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_tile_config(num_pairs: int, num_experts: int, device: torch.device) -> MoeTileConfig:
    """Tile shape by the mean number of pairs per expert (small: weight-bandwidth bound; large: GEMM)."""
    if device.type != "cuda":
        return MoeTileConfig(16, 32, 32, 1, 4, 1)  # the interpreter: small tiles, few wasted rows
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 8:
        return MoeTileConfig(16, 64, 128, 1, 4, 4)
    if per_expert <= 64:
        return MoeTileConfig(32, 64, 128, 8, 4, 4)
    return MoeTileConfig(64, 128, 64, 8, 4, 3)


# Up to this many token-expert pairs (decode batches), one Triton program aligns them in a single launch;
# beyond it, the vectorised torch version (about 30 small launches, negligible next to a prefill's GEMMs).
ALIGN_KERNEL_MAX_PAIRS = 1024


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Returns ``sorted_ids`` [max_rows] int32 (pair index ``token * top_k + j``, in pair order within an
    expert; padding holds ``T * top_k``), ``expert_ids`` [max_rows // block_m] int32 (the expert of each
    tile; tiles past the end repeat the last expert), and ``num_rows_padded`` [1] int32 (rows in use).
    Sizes come from shapes, never from device values.
    """
    num_pairs = topk_ids.numel()
    # At most min(E, pairs) experts are non-empty, and each pads by at most block_m - 1 rows.
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        return _moe_align_triton(topk_ids, block_m, num_experts, max_rows)
    return _moe_align_torch(topk_ids, block_m, num_experts, max_rows)


def _moe_align_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank_in_expert
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_rows_padded_ptr,
    num_pairs,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: count pairs per expert, lay out padded runs, then place each pair (stable)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_rows_padded_ptr, tl.sum(padded, axis=0))
    # A tile's expert is the number of experts whose run ends at or before the tile's first row.
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        owner = tl.sum((tiles[:, None] * BLOCK_M >= ends[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + tiles, tl.minimum(owner, num_experts - 1), mask=tiles < num_tiles)
    # Each pair goes to its expert's start + the pairs of that expert placed before it.
    next_row = ends - padded
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rows = next_row[None, :] + tl.cumsum(onehot, axis=0) - 1
        tl.store(sorted_ids_ptr + tl.sum(onehot * rows, axis=1), pairs, mask=valid)
        next_row += tl.sum(onehot, axis=0)


def _moe_align_triton(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    num_tiles = max_rows // block_m
    expert_ids = torch.empty((num_tiles,), dtype=torch.int32, device=device)
    num_rows_padded = torch.empty((1,), dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_rows_padded, num_pairs, num_experts, num_tiles,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_P=min(128, triton.next_power_of_2(num_pairs)),
        BLOCK_T=min(256, triton.next_power_of_2(num_tiles)),
        num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_rows_padded


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_rows_padded_ptr,
    max_rows,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair, :] = a[pair // A_ROW_DIV, :] @ w[expert].T (times topk_weight[pair]) for one tile."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each weight column tile while it is in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return

    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (
        w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_rows_padded: torch.Tensor,
    a_row_div: int,
    mul_routing_weight: bool,
    cfg: MoeTileConfig,
) -> None:
    n, k = w.shape[1], w.shape[2]
    max_rows = sorted_ids.shape[0]
    grid = (triton.cdiv(max_rows, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights, sorted_ids, expert_ids, num_rows_padded,
        max_rows, n, k, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTING_WEIGHT=mul_routing_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate || up); w2: [E, H, I]; topk_weights/ids: [T, k] (physical ids).

    Returns sum_k weight_k * expert_k(x) in x's dtype, [T, H].
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dimension")
    topk_weights = topk_weights.contiguous()
    cfg = moe_tile_config(num_pairs, num_experts, x.device)
    sorted_ids, expert_ids, num_rows_padded = moe_align_block_size(topk_ids, cfg.block_m, num_experts)

    gate_up = torch.empty((num_pairs, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, topk_weights, sorted_ids, expert_ids, num_rows_padded, top_k, False, cfg)
    act = silu_and_mul_triton(gate_up)
    down = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, topk_weights, sorted_ids, expert_ids, num_rows_padded, 1, True, cfg)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
