"""Fused mixture-of-experts expert computation: Triton version of ``kernels/moe.py``.

Two paths, both without host synchronisation (sizes come from shapes, never from device values), so either
can sit inside a captured CUDA graph. ``fused_moe_triton`` picks one by the number of token-expert pairs.

Small path (decode: ``num_pairs <= min(SMALL_PATH_MAX_PAIRS, E)``, see ``use_small_path``): two GEMV-style
launches, no alignment.

1. ``_moe_small_gate_up_kernel``: grid (pairs, I tiles). Each program reduces its pair's token row of ``x``
   against ``BLOCK_N`` gate rows and the matching up rows of ``w13[e]`` and writes ``silu(gate) * up``.
2. ``_moe_small_down_kernel``: grid (tokens, H tiles). Each program loops over its token's top-k pairs and
   accumulates ``weight_k * act[pair] @ w2[e].T`` in fp32; it writes its output slice once (no atomics,
   no zero-fill, no separate sum).

It reads an expert's weights once per pair, not once per distinct expert; the pair axis is the fastest in
both grids, so pairs that share an expert read the same weight tile at about the same time, from L2.

Grouped path (prefill and larger batches):

1. ``moe_align_block_size``: sort the ``T * top_k`` token-expert pairs by expert and pad each expert's
   run to a multiple of the tile height ``BLOCK_M``; every tile then belongs to one expert. Buffers are
   sized by an upper bound read from shapes; tiles past the padded total exit. Small batches (up to
   ``ALIGN_KERNEL_MAX_PAIRS``) use one single-program Triton kernel (a fill and one launch); larger ones
   two multi-program kernels over chunks of the pairs (count per chunk, then place per chunk). Both equal
   the vectorised torch reference ``_moe_align_torch`` exactly.
2. ``_moe_gemm_kernel`` (one grouped GEMM, used twice): each program computes a ``BLOCK_M x BLOCK_N``
   tile, gathering activation rows by the sorted pair ids and reading that tile's expert weights.
   Gate-up: ``x[pair // top_k] @ w13[e].T`` -> ``[T*k, 2I]``. Down: ``act[pair] @ w2[e].T`` times the
   pair's routing weight -> ``[T*k, H]``.
3. SiLU-and-mul between them (``kernels/triton_activation.py``), and a sum over top-k at the end (torch,
   which accumulates in fp32).

Float8 weights (``w13`` / ``w2`` given as ``kernels.fp8_weight.Fp8Weight``): the same paths read the float8
values and multiply float32 partial sums by their scales, K steps never straddling two scale blocks
(``KERNEL_K_STEP``). The grouped GEMM takes a ``W_FP8`` switch (one scale per weight row per K step of at
most KERNEL_K_STEP). The small path has float8 twins of both kernels that read the values as 32-bit words
of four and widen each byte with integer operations (``kernels/triton_fp8.py``):
``_moe_small_gate_up_fp8_words_kernel`` and ``_moe_small_down_fp8_words_kernel``, whose steps are pieces of
KERNEL_K_STEP values with a scale each. Widening with conversion instructions (quarter rate on Hopper)
made these byte-streaming kernels issue-bound: the pair took 23.9 us at one token against 21.8 for bf16
weights (H200, Qwen3-30B-A3B), though it reads half the bytes; the word kernels take 19.8 us
(``moe_small_fp8_config``). Float8 weights whose K or strides are not multiples of 4 (no real model's)
take the grouped GEMM at every batch (``small_path_reads``). 16-bit weights pass None for the grouped
GEMM's scale arguments: constexprs, so its 16-bit build is the code it had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_weight import KERNEL_K_STEP, Fp8Weight, scale_args
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait
from kernels.triton_fp8 import fp8_byte_to_f32, fp8_word_factor, fp8_word_shift


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_tile_config(num_pairs: int, num_experts: int, device: torch.device) -> MoeTileConfig:
    """Tile shape by the mean number of pairs per expert (small: weight-bandwidth bound; large: GEMM).

    Past 16 pairs per expert, 64 x 128 tiles: at a 512-token Qwen3-30B-A3B prefill (32 per expert) they
    took 428 us per layer against 466 us for the 32 x 64 tiles used before, and at 2048 tokens they are
    within 2% of the best tried (``kernel_bench.py --sweep-moe-prefill``, H200, 2026-11-29 19:02 UTC).
    Decode batches up to 256 tokens (16 per expert at top-8 of 128) keep the tiles they were measured with.
    """
    if device.type != "cuda":
        return MoeTileConfig(16, 32, 32, 1, 4, 1)  # the interpreter: small tiles, few wasted rows
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 8:
        return MoeTileConfig(16, 64, 128, 1, 4, 4)
    if per_expert <= 16:
        return MoeTileConfig(32, 64, 128, 8, 4, 4)
    return MoeTileConfig(64, 128, 64, 8, 4, 3)


# Up to this many token-expert pairs one Triton program aligns them (``_moe_align_triton``: a fill and one
# launch); past it the multi-program alignment does (``_moe_align_chunked``: two launches over up to
# ALIGN_MAX_CHUNKS programs), at any size. Measured on an H200 (2026-11-29, ``kernel_bench.py
# --moe-align``, top-8 of 128 experts, us from CUDA graphs): single / multi / torch 19.4 / 22.4 / 53.7 at
# 128 pairs, 20.0 / 21.3 / 75.3 at 256, 25.1 / 22.8 / 79.3 at 512, 114.6 / 22.8 / 89.4 at 4096 (a 512-token
# prompt), 213 / 24.2 / 128 at 8192 and 867 / 38.1 / 126 at 32768. The torch path (about 30 launches, and
# the host's time for them) is the reference only.
ALIGN_KERNEL_MAX_PAIRS = 256
# The multi-program alignment's tiles: each program counts, then places, its chunk of the pairs
# ALIGN_CHUNK_PAIRS at a time; past ALIGN_MAX_CHUNKS * ALIGN_CHUNK_PAIRS pairs the chunks grow instead of
# their number, which bounds the per-chunk counts table every placing program reads (ALIGN_MAX_CHUNKS x E;
# 128 programs are about one per SM of an H200). Fixed, so a new batch size never compiles a new variant.
ALIGN_CHUNK_PAIRS = 128
ALIGN_MAX_CHUNKS = 128


def align_max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the alignment allocates, from shapes alone: at most min(E, pairs) experts are non-empty, and
    each pads by at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


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
    max_rows = align_max_rows(num_pairs, num_experts, block_m)
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        return _moe_align_triton(topk_ids, block_m, num_experts, max_rows)
    return _moe_align_chunked(topk_ids, block_m, num_experts, max_rows)


def _moe_align_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference layout (~30 vectorised torch launches, too many for a prefill's host): both Triton
    alignments must equal it exactly. Not used by ``moe_align_block_size``."""
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
def _count_pairs(topk_ids_ptr, start, stop, num_pairs, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pairs ``start .. stop`` per expert, [BLOCK_E] int32."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(start, stop, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _write_tile_experts(
    expert_ids_ptr, ends, share, shares, num_tiles, num_experts, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr
):
    """Share ``share`` of ``shares`` (grid-stride) of the tiles' experts: a tile's expert is the number of
    experts whose run ends at or before the tile's first row (``ends``: the padded runs' cumulative ends)."""
    for t0 in range(share * BLOCK_T, num_tiles, shares * BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        owner = tl.sum((tiles[:, None] * BLOCK_M >= ends[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + tiles, tl.minimum(owner, num_experts - 1), mask=tiles < num_tiles)


@triton.jit
def _place_pairs(
    topk_ids_ptr,
    sorted_ids_ptr,
    next_row,
    start,
    stop,
    num_pairs,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Pairs ``start .. stop`` to their rows: each expert's ``next_row`` + the pairs of that expert placed
    before it (a running one-hot cumsum: stable, pair order within an expert)."""
    experts = tl.arange(0, BLOCK_E)
    for p0 in range(start, stop, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rows = next_row[None, :] + tl.cumsum(onehot, axis=0) - 1
        tl.store(sorted_ids_ptr + tl.sum(onehot * rows, axis=1), pairs, mask=valid)
        next_row += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
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
    USE_PDL: tl.constexpr,
):
    """One program: count pairs per expert, lay out padded runs, then place each pair (stable)."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    padded = (
        (_count_pairs(topk_ids_ptr, 0, num_pairs, num_pairs, BLOCK_E, BLOCK_P) + BLOCK_M - 1)
        // BLOCK_M
        * BLOCK_M
    )
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_rows_padded_ptr, tl.sum(padded, axis=0))
    _write_tile_experts(expert_ids_ptr, ends, 0, 1, num_tiles, num_experts, BLOCK_M, BLOCK_T)
    _place_pairs(topk_ids_ptr, sorted_ids_ptr, ends - padded, 0, num_pairs, num_pairs, BLOCK_E, BLOCK_P)


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
        # Fixed tiles (masked at the edges): one compiled variant for every batch, so a new batch size
        # never waits for a compile; a single program's few extra masked lanes cost nothing in comparison.
        BLOCK_P=128,
        BLOCK_T=256,
        **pdl_kwargs(flat.device), num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_rows_padded


@triton.jit(do_not_specialize=["num_pairs", "chunk_pairs", "max_rows"])
def _moe_align_count_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    num_pairs,
    num_experts,
    chunk_pairs,
    max_rows,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per chunk of pairs: its pairs per expert into ``counts[chunk, :]``; and its grid-stride
    share of ``sorted_ids`` filled with the padding value (the placing kernel, which runs after this one,
    overwrites the rows that hold pairs), which saves a fill launch."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    start = chunk * chunk_pairs
    counts = _count_pairs(
        topk_ids_ptr, start, tl.minimum(start + chunk_pairs, num_pairs), num_pairs, BLOCK_E, BLOCK_P
    )
    tl.store(counts_ptr + chunk * num_experts + experts, counts, mask=experts < num_experts)
    padding = tl.full([BLOCK_R], num_pairs, dtype=tl.int32)
    for r0 in range(chunk * BLOCK_R, max_rows, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tl.store(sorted_ids_ptr + rows, padding, mask=rows < max_rows)


@triton.jit(do_not_specialize=["num_pairs", "chunk_pairs", "num_tiles"])
def _moe_align_place_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_rows_padded_ptr,
    num_pairs,
    num_experts,
    chunk_pairs,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per chunk: from the whole counts table, every expert's padded run and this chunk's place
    in it (the pairs of that expert in earlier chunks); then its pairs at run start + that offset + a
    running one-hot cumsum, as the single program does (stable). Tiles' experts: grid-stride shares."""
    pdl_wait(USE_PDL)  # the counting kernel's counts and padding are visible after this
    chunk = tl.program_id(0)
    num_chunks = tl.num_programs(0)
    experts = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        mask = (chunks[:, None] < num_chunks) & (experts[None, :] < num_experts)
        table = tl.load(counts_ptr + chunks[:, None] * num_experts + experts[None, :], mask=mask, other=0)
        totals += tl.sum(table, axis=0)
        before += tl.sum(tl.where(chunks[:, None] < chunk, table, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_rows_padded_ptr, tl.sum(padded, axis=0), mask=chunk == 0)
    _write_tile_experts(expert_ids_ptr, ends, chunk, num_chunks, num_tiles, num_experts, BLOCK_M, BLOCK_T)
    start = chunk * chunk_pairs
    _place_pairs(
        topk_ids_ptr, sorted_ids_ptr, ends - padded + before, start,
        tl.minimum(start + chunk_pairs, num_pairs), num_pairs, BLOCK_E, BLOCK_P,
    )  # fmt: skip


def _moe_align_chunked(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The multi-program alignment: count per chunk, then place per chunk; two launches, no fill."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    steps = max(1, triton.cdiv(triton.cdiv(num_pairs, ALIGN_CHUNK_PAIRS), ALIGN_MAX_CHUNKS))
    chunk_pairs = steps * ALIGN_CHUNK_PAIRS
    num_chunks = max(1, triton.cdiv(num_pairs, chunk_pairs))
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    sorted_ids = torch.empty((max_rows,), dtype=torch.int32, device=device)  # the counting kernel fills it
    num_tiles = max_rows // block_m
    expert_ids = torch.empty((num_tiles,), dtype=torch.int32, device=device)
    num_rows_padded = torch.empty((1,), dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    _moe_align_count_kernel[(num_chunks,)](
        flat, counts, sorted_ids, num_pairs, num_experts, chunk_pairs, max_rows,
        BLOCK_E=block_e, BLOCK_P=ALIGN_CHUNK_PAIRS, BLOCK_R=1024,
        **pdl_kwargs(device), num_warps=4,
    )  # fmt: skip
    _moe_align_place_kernel[(num_chunks,)](
        flat, counts, sorted_ids, expert_ids, num_rows_padded, num_pairs, num_experts, chunk_pairs, num_tiles,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_P=ALIGN_CHUNK_PAIRS,
        BLOCK_C=max(1, 4096 // block_e),  # counts-table rows per load: ~4096 ints, 32 per thread
        BLOCK_T=256,
        **pdl_kwargs(device), num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_rows_padded


@triton.jit(do_not_specialize=["max_rows", "num_pairs"])
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
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """c[pair, :] = a[pair // A_ROW_DIV, :] @ w[expert].T (times topk_weight[pair]) for one tile; zeros for
    a tile of expert ``num_experts`` (the pairs whose experts other ranks hold, ``has_absent``).

    W_FP8: w is float8 with float32 scales at ``s_ptr`` (``kernels.fp8_weight.scale_args``); each K step
    (BLOCK_K divides the scale block) is its own dot, widened to a's dtype (exact), times its columns'
    scales. Otherwise the scale arguments are None and unused."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
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
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = pair_mask[:, None] & (offs_n[None, :] < N)
    if expert >= num_experts:  # absent pairs: no weights to read, their rows add nothing
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (
        w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    )
    if W_FP8:
        s_cols = s_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        if W_FP8:
            scale = tl.load(s_cols + (k0 // SCALE_BK) * stride_sk, mask=offs_n < N, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _scale_args(w: torch.Tensor | Fp8Weight, block_k: int) -> tuple[tuple, dict[str, int | bool]]:
    """The scale arguments of a kernel with a ``W_FP8`` switch whose K steps are ``block_k`` long:
    (scales, stride over experts, over row blocks, over K blocks) and the constexprs. For a tensor, Nones:
    constexprs, which leave the 16-bit kernel's parameters (and so its code) as they were."""
    if not isinstance(w, Fp8Weight):
        return (None, None, None, None), {"W_FP8": False, "SCALE_BN": 1, "SCALE_BK": 1}
    if KERNEL_K_STEP % block_k:
        raise ValueError(
            f"K steps of {block_k} straddle float8 scale blocks (steps must divide {KERNEL_K_STEP})"
        )
    se, sn, sk, bn, bk = scale_args(w)
    return (w.weight_scale, se, sn, sk), {"W_FP8": True, "SCALE_BN": bn, "SCALE_BK": bk}


def _values(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The tensor a kernel reads a weight's elements from: a float8 weight's values, or the weight."""
    return w.weight if isinstance(w, Fp8Weight) else w


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor | Fp8Weight,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_rows_padded: torch.Tensor,
    a_row_div: int,
    mul_routing_weight: bool,
    cfg: MoeTileConfig,
) -> None:
    scale, fp8 = _scale_args(w, cfg.block_k)
    w = _values(w)
    n, k = w.shape[1], w.shape[2]
    max_rows = sorted_ids.shape[0]
    grid = (triton.cdiv(max_rows, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights, sorted_ids, expert_ids, num_rows_padded,
        max_rows, n, k, out.shape[0], w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), *scale,
        A_ROW_DIV=a_row_div, MUL_ROUTING_WEIGHT=mul_routing_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=dot_precision(a.dtype), **fp8,
        **pdl_kwargs(a.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Small path: two GEMV-style launches for decode-sized batches

# The small path reads an expert's weights once per pair, the grouped path once per distinct expert (per
# BLOCK_M tile). With P pairs spread over E experts, about P**2 / (2E) pairs repeat an expert already
# chosen (Qwen3-30B-A3B, E=128, P=64: ~14 of 64, i.e. ~27% more weight traffic at worst, less where the
# repeat is served from L2). Below ~64 pairs the grouped path's 4 extra launches (fill, align, SiLU, sum)
# and its mostly-padding 16-row tiles cost more than that; past it, and past P = E (where duplicates become
# the rule: Mixtral's E=8 at top-2 takes the small path up to 4 tokens), the grouped path wins.
SMALL_PATH_MAX_PAIRS = 64


def use_small_path(num_pairs: int, num_experts: int) -> bool:
    """Whether ``fused_moe_triton`` takes the two-launch small path for this many token-expert pairs."""
    return num_pairs <= min(SMALL_PATH_MAX_PAIRS, num_experts)


@dataclass(frozen=True)
class MoeSmallConfig:
    """Block sizes of the small path: gate-up kernel (rows of I, K chunk of H) and down kernel (rows of H,
    K chunk of I)."""

    gate_up_block_n: int
    gate_up_block_k: int
    gate_up_num_warps: int
    down_block_n: int
    down_block_k: int
    down_num_warps: int
    gate_up_num_stages: int = 3
    down_num_stages: int = 3


def moe_small_config(device: torch.device) -> MoeSmallConfig:
    """Block sizes for the small path, reasoned as below and then swept on one H200 (each kernel alone,
    CUDA-graph replay, weights rotated so L2 holds none).

    Both kernels load each weight element once and use it for one multiply-add per token, so they are bound
    by HBM bandwidth, and what matters is bytes in flight with every SM busy: an H200 needs about
    4.3 TB/s x ~0.7 us ~ 3 MB outstanding over its 132 SMs. At the Qwen3-30B-A3B shape (H=2048, I=768,
    top-8):

    - One token (8 pairs), ``kernel_bench.py --sweep-moe-small`` 2026-11-29 16:27 UTC: one weight row per
      program, as for the batch-1 GEMV (``kernels/triton_linear.py``). Gate-up BLOCK_N 1 x BLOCK_K 256,
      2 stages: 8 x 768 = 6,144 programs, many resident per SM; the pair took 24.0 us against 28.8 with
      the tiles below. Down BLOCK_N 1 x BLOCK_K 128, 4 stages: 2,048 programs of [top-8, 1, 128] tiles,
      25.2 against 28.8 us (each with the other kernel unchanged). A later sweep added one- and two-warp
      programs (``--sweep-moe-small --narrow``, 2026-11-29 18:23 UTC): gate-up 1 x 1024 in one warp took
      the pair to 22.3 us against 23.6 for 1 x 256 in four (1 x 2048 in two warps: 22.4); it is used now.
      Down kernels of one or two warps were no faster (24.4-25.1 us against the 23.6 us pair).
    - More tokens (up to 8, 64 pairs): the same tiles. Until 2026-11-30 they had their own (gate-up
      BLOCK_N 16 x BLOCK_K 256 in 4 warps, down 8 x 256), chosen on 2026-11-29 before one-row tiles were
      tried; a sweep at 2, 4 and 8 tokens (docs/performance.md, "Seventeenth run") found the one-token
      tiles best of 8 gate-up and 7 down tiles: the pair took 39.0 / 69.2 / 120.9 us against 46.8 / 77.7
      / 136.3. One tile for every token count also keeps a pair's result independent of the batch.
    """
    if device.type != "cuda":
        return MoeSmallConfig(16, 32, 4, 16, 32, 4)  # the interpreter: tiny shapes, few masked lanes
    return MoeSmallConfig(1, 1024, 1, 1, 128, 4, gate_up_num_stages=2, down_num_stages=4)


def moe_small_fp8_config(device: torch.device) -> MoeSmallConfig:
    """Block sizes for the small path over float8 weights (K steps in float8 values; the word kernels read
    a step as pieces of KERNEL_K_STEP values, one scale each, so a step is a power of two).

    ``kernel_bench.py --sweep-moe-small-fp8`` (H200, 2026-12-01, Qwen3-30B-A3B-FP8's layout, one token,
    one run): gate-up 1 x 1024 in one warp (as the 16-bit tile), down 1 x 256 in four warps ([top-8, 1,
    256] words' bytes: the 16-bit [top-8, 1, 128]'s): the pair took 19.8 us against 21.8 for bf16 weights
    and 23.9 for kernels widening with conversion instructions (since removed). The gate-up tiles tried
    were within 0.3 us of one another (1 x 512, 2 x 1024, 2 x 512 in one warp; 1 x 2048 in one warp, 225
    registers, was 22.7), the down ones 1 x 256 in four warps best by 0.6 us (1 x 128: 23.6 with the 1 x
    2048 gate-up). Unmeasured at 2-8 tokens."""
    if device.type != "cuda":  # the interpreter: steps of two pieces in both kernels
        return MoeSmallConfig(64, 2 * KERNEL_K_STEP, 4, 64, 2 * KERNEL_K_STEP, 4)
    return MoeSmallConfig(1, 1024, 1, 1, 256, 4, gate_up_num_stages=2, down_num_stages=4)


@triton.jit
def _moe_small_gate_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    topk_ids_ptr,
    inter,
    hidden,
    stride_xm,
    stride_we,
    stride_wn,
    up_offset,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ABSENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for one pair and BLOCK_N n."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    if HAS_ABSENT:  # noqa: SIM102  (compiled in only where ids can be negative: one GPU's chain unchanged)
        if expert < 0:  # another rank holds this pair's expert: the down kernel skips its row
            return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + offs_k
    gate_ptrs = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + up_offset  # I rows on; from the host, so 64-bit when it must be
    # Per-lane partial sums; one cross-lane reduction at the end instead of one per step.
    gate_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        mask = n_mask[:, None] & k_mask[None, :]
        xk = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        gate_acc += tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
        up_acc += tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # The reference rounds gate_up to x's dtype, then SiLU (fp32, rounded) times up.
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(gate_acc, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(up_acc, axis=1).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, (silu * up).to(dtype), mask=n_mask)


@triton.jit
def _four_values(ptrs, mask, QUADS: tl.constexpr, dtype: tl.constexpr):
    """The values v[4 i + J] (J = 0..3) that byte J of float8 word i multiplies, as four float32 tiles of
    the words' shape. QUADS: ``ptrs`` point at 64-bit words of four 16-bit values of ``dtype``, word i's at
    i, so the load has the float8 words' layout (strided 16-bit loads got a layout of their own, and
    Triton converted between the two through shared memory every step); otherwise at value 4 i, one
    strided load for each J (float32 values, which take that conversion: no real model's case)."""
    if QUADS:
        quads = tl.load(ptrs, mask=mask, other=0)
        lo = quads.to(tl.int32)
        hi = (quads >> 32).to(tl.int32)
        if dtype == tl.bfloat16:  # a bfloat16 is a float32's top half
            v0 = (lo << 16).to(tl.float32, bitcast=True)
            v1 = (lo & -65536).to(tl.float32, bitcast=True)
            v2 = (hi << 16).to(tl.float32, bitcast=True)
            v3 = (hi & -65536).to(tl.float32, bitcast=True)
        else:
            v0 = lo.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
            v1 = (lo >> 16).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
            v2 = hi.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
            v3 = (hi >> 16).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    else:
        v0 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        v1 = tl.load(ptrs + 1, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(ptrs + 2, mask=mask, other=0.0).to(tl.float32)
        v3 = tl.load(ptrs + 3, mask=mask, other=0.0).to(tl.float32)
    return v0, v1, v2, v3


@triton.jit
def _moe_small_gate_up_fp8_words_kernel(
    x_ptr,
    w13_ptr,
    s_ptr,
    act_ptr,
    topk_ids_ptr,
    inter,
    hidden_words,
    stride_xm,
    stride_we,
    stride_wn,
    up_offset,
    stride_am,
    stride_se,
    stride_sn,
    stride_sk,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    PIECE_W: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    SHIFT: tl.constexpr,
    HALF_FACTOR: tl.constexpr,
    ACT_SCALE: tl.constexpr,
    X_QUADS: tl.constexpr,
    HAS_ABSENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``_moe_small_gate_up_kernel`` over float8 w13 with float32 scales at ``s_ptr``
    (``kernels.fp8_weight.scale_args``; strides in scale entries), read as 32-bit words of four values
    (``kernels/triton_fp8.py``: widened with integer operations, not conversions; strides and ``up_offset``
    in words, ``hidden_words`` = H / 4). A step is a [BLOCK_N, PIECES, PIECE_W] tile of words, each piece
    inside one scale block; byte J of word i multiplies x[4 i + J] (``_four_values``; X_QUADS: x as 64-bit
    words, ``stride_xm`` in them). The words' offsets are declared contiguous in pairs only: the x quads'
    loads (16 bytes a lane at most) then take the words' layout.

    The widened values lack the factor 2**(bias difference): x is multiplied by its square root
    (HALF_FACTOR) and the sums by it again at the end, so products stay normal floats. A piece's four
    products per word are summed before its scale multiplies them: one multiply-add a word, where scaling x
    would take one multiply per x element for gate and again for up. With one scale along K (SCALE_BK 1:
    per-row or per-expert scales) the scales multiply the row sums at the end instead. ACT_SCALE multiplies
    the act written (the down kernel's half factor, ``_fused_moe_small``); a power of two, so it commutes
    with the rounding to act's dtype."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    if HAS_ABSENT:  # noqa: SIM102  (as the 16-bit kernel)
        if expert < 0:  # another rank holds this pair's expert: the down kernel skips its row
            return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    pieces = tl.arange(0, PIECES) * PIECE_W  # each piece's first word in a step
    offs_w = tl.max_contiguous(pieces[:, None] + tl.arange(0, PIECE_W)[None, :], [1, 2])  # [PIECES, PIECE_W]
    X_STEP: tl.constexpr = 1 if X_QUADS else 4  # x's elements a word
    x_ptrs = tl.broadcast_to(
        x_ptr + token.to(tl.int64) * stride_xm + X_STEP * offs_w[None, :, :], (BLOCK_N, PIECES, PIECE_W)
    )
    gate_ptrs = (
        w13_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wn + offs_w[None, :, :]
    )
    up_ptrs = gate_ptrs + up_offset  # I rows on; from the host, so 64-bit when it must be
    gate_s_rows = s_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn  # [BLOCK_N]
    up_s_rows = s_ptr + expert * stride_se + ((inter + offs_n) // SCALE_BN) * stride_sn
    gate_acc = tl.zeros((BLOCK_N, PIECES, PIECE_W), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_N, PIECES, PIECE_W), dtype=tl.float32)
    for w0 in range(0, hidden_words, PIECES * PIECE_W):
        k_mask = offs_w < hidden_words - w0
        mask = n_mask[:, None, None] & k_mask[None, :, :]
        gate_words = tl.load(gate_ptrs, mask=mask, other=0)
        up_words = tl.load(up_ptrs, mask=mask, other=0)
        x0, x1, x2, x3 = _four_values(x_ptrs, mask, X_QUADS, act_ptr.dtype.element_ty)
        x0, x1, x2, x3 = x0 * HALF_FACTOR, x1 * HALF_FACTOR, x2 * HALF_FACTOR, x3 * HALF_FACTOR
        gate = fp8_byte_to_f32(gate_words, 0, SHIFT) * x0
        gate += fp8_byte_to_f32(gate_words, 1, SHIFT) * x1
        gate += fp8_byte_to_f32(gate_words, 2, SHIFT) * x2
        gate += fp8_byte_to_f32(gate_words, 3, SHIFT) * x3
        up = fp8_byte_to_f32(up_words, 0, SHIFT) * x0
        up += fp8_byte_to_f32(up_words, 1, SHIFT) * x1
        up += fp8_byte_to_f32(up_words, 2, SHIFT) * x2
        up += fp8_byte_to_f32(up_words, 3, SHIFT) * x3
        if SCALE_BK == 1:  # one scale along K: applied to the sums at the end
            gate_acc += gate
            up_acc += up
        else:
            # Pieces past the row's end are masked: their block index would be past the scale grid's.
            s_mask = n_mask[:, None] & (pieces < hidden_words - w0)[None, :]
            s_cols = (4 * (w0 + pieces) // SCALE_BK * stride_sk)[None, :]
            gate_acc += gate * tl.load(gate_s_rows[:, None] + s_cols, mask=s_mask, other=0.0)[:, :, None]
            up_acc += up * tl.load(up_s_rows[:, None] + s_cols, mask=s_mask, other=0.0)[:, :, None]
        x_ptrs += X_STEP * PIECES * PIECE_W
        gate_ptrs += PIECES * PIECE_W
        up_ptrs += PIECES * PIECE_W
    gate = tl.sum(tl.sum(gate_acc, axis=2), axis=1) * HALF_FACTOR
    up = tl.sum(tl.sum(up_acc, axis=2), axis=1) * HALF_FACTOR
    if SCALE_BK == 1:
        gate = gate * tl.load(gate_s_rows, mask=n_mask, other=0.0)
        up = up * tl.load(up_s_rows, mask=n_mask, other=0.0)
    # The 16-bit kernel's roundings: gate_up to x's dtype, then SiLU (fp32, rounded) times up.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up
    if ACT_SCALE != 1.0:
        act = act * ACT_SCALE
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(dtype), mask=n_mask)


@triton.jit
def _moe_small_down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ABSENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[token, n] = sum_j weight_j * act[token * TOP_K + j] . w2[e_j, n] for BLOCK_N n, in fp32.

    The token's expert ids and weights are read once, up front, and each step loads one
    [top-k, BLOCK_N, BLOCK_K] tile of all its experts' rows: no load waits on an id loaded in the loop
    (16.6 -> 9.3 us per Qwen3-30B-A3B layer at batch 1 on the H200 against a loop over the experts).

    The ids and weights are also inputs of the gate-up kernel launched just before this one, so they were
    complete before that kernel passed its own PDL wait, which it did before this kernel could start:
    they are read before this kernel's wait, and only ``act`` after it."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    js = tl.arange(0, BLOCK_J)
    j_mask = js < TOP_K
    pairs = token * TOP_K + js
    experts = tl.load(topk_ids_ptr + pairs, mask=j_mask, other=0).to(tl.int64)  # pre-wait: gate-up's input
    weights = tl.load(topk_weights_ptr + pairs, mask=j_mask, other=0.0).to(tl.float32)  # pre-wait: same
    if HAS_ABSENT:  # a negative id: another rank's expert, whose act row the gate-up did not write
        j_mask = j_mask & (experts >= 0)
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (
        w2_ptr
        + experts[:, None, None] * stride_we
        + offs_n.to(tl.int64)[None, :, None] * stride_wn
        + offs_k[None, None, :]
    )
    a_ptrs = act_ptr + pairs.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=j_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w_mask = j_mask[:, None, None] & n_mask[None, :, None] & k_mask[None, None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * (a * weights[:, None])[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_small_down_fp8_words_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    hidden,
    inter_words,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    PIECE_W: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    SHIFT: tl.constexpr,
    HALF_FACTOR: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_QUADS: tl.constexpr,
    HAS_ABSENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``_moe_small_down_kernel`` over w2 read as 32-bit words of four float8 values (strides in words,
    ``inter_words`` = I / 4), as ``_moe_small_gate_up_fp8_words_kernel`` reads w13.

    A step is a [top-k, BLOCK_N * PIECES, PIECE_W] tile of words: its middle axis runs over (row, piece),
    each piece inside one scale block, and the pieces' sums of a row are added at the end. Byte J of word i
    multiplies act[pair, 4 i + J] (``_four_values``; A_QUADS: act as 64-bit words, ``stride_am`` in
    them). act comes multiplied by HALF_FACTOR from the float8 gate-up kernel, or
    the kernel multiplies it by A_SCALE (1.0: no multiply); the sums take HALF_FACTOR again at the end, and
    the routing weights there too (per pair and row, not per element). Scales: per piece, or with one
    along K (SCALE_BK 1), on the sums."""
    ROWS: tl.constexpr = BLOCK_N * PIECES
    token = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + rows // PIECES  # [ROWS]: each (row, piece)'s weight row
    n_mask = offs_n < hidden
    pieces = rows % PIECES * PIECE_W  # [ROWS]: each (row, piece)'s first word in a step
    js = tl.arange(0, BLOCK_J)
    j_mask = js < TOP_K
    pairs = token * TOP_K + js
    experts = tl.load(topk_ids_ptr + pairs, mask=j_mask, other=0).to(tl.int64)  # pre-wait: gate-up's input
    weights = tl.load(topk_weights_ptr + pairs, mask=j_mask, other=0.0).to(tl.float32)  # pre-wait: same
    if HAS_ABSENT:  # a negative id: another rank's expert, whose act row the gate-up did not write
        j_mask = j_mask & (experts >= 0)
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    offs_w = tl.max_contiguous(pieces[:, None] + tl.arange(0, PIECE_W)[None, :], [1, 2])  # [ROWS, PIECE_W]
    A_STEP: tl.constexpr = 1 if A_QUADS else 4  # act's elements a word
    w_ptrs = (
        w2_ptr
        + experts[:, None, None] * stride_we
        + offs_n.to(tl.int64)[None, :, None] * stride_wn
        + offs_w[None, :, :]
    )
    a_ptrs = act_ptr + pairs.to(tl.int64)[:, None, None] * stride_am + A_STEP * offs_w[None, :, :]
    s_rows = s_ptr + experts[:, None] * stride_se + (offs_n // SCALE_BN)[None, :] * stride_sn  # [J, ROWS]
    acc = tl.zeros((BLOCK_J, ROWS, PIECE_W), dtype=tl.float32)
    for w0 in range(0, inter_words, PIECES * PIECE_W):
        a_mask = j_mask[:, None, None] & (offs_w < inter_words - w0)[None, :, :]
        words = tl.load(w_ptrs, mask=a_mask & n_mask[None, :, None], other=0)
        a0, a1, a2, a3 = _four_values(a_ptrs, a_mask, A_QUADS, out_ptr.dtype.element_ty)
        if A_SCALE != 1.0:
            a0, a1, a2, a3 = a0 * A_SCALE, a1 * A_SCALE, a2 * A_SCALE, a3 * A_SCALE
        part = fp8_byte_to_f32(words, 0, SHIFT) * a0
        part += fp8_byte_to_f32(words, 1, SHIFT) * a1
        part += fp8_byte_to_f32(words, 2, SHIFT) * a2
        part += fp8_byte_to_f32(words, 3, SHIFT) * a3
        if SCALE_BK == 1:  # one scale along K: applied to the sums at the end
            acc += part
        else:
            # Pieces past the row's end are masked: their block index would be past the scale grid's.
            s_mask = j_mask[:, None] & (n_mask & (pieces < inter_words - w0))[None, :]
            s_cols = (4 * (w0 + pieces) // SCALE_BK * stride_sk)[None, :]
            acc += part * tl.load(s_rows + s_cols, mask=s_mask, other=0.0)[:, :, None]
        a_ptrs += A_STEP * PIECES * PIECE_W
        w_ptrs += PIECES * PIECE_W
    sums = tl.sum(acc, axis=2)  # [J, ROWS]
    if SCALE_BK == 1:
        sums = sums * tl.load(s_rows, mask=j_mask[:, None] & n_mask[None, :], other=0.0)
    out = tl.sum(sums * weights[:, None], axis=0) * HALF_FACTOR  # [ROWS]
    if PIECES > 1:
        out = tl.sum(tl.reshape(out, (BLOCK_N, PIECES)), axis=1)
    offs_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_om + offs_out,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_out < hidden,
    )


def _fp8_words(w: torch.Tensor | Fp8Weight) -> torch.Tensor | None:
    """A float8 weight's values as int32 words of four (what the word kernels read), or None: a 16-bit
    weight, or one whose K, a stride or its offset is not a multiple of 4 (no real model's)."""
    if not isinstance(w, Fp8Weight):
        return None
    values = w.weight
    if values.shape[-1] % 4 or values.storage_offset() % 4 or any(s % 4 for s in values.stride()[:-1]):
        return None
    return values.view(torch.int32)


def small_path_reads(w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight) -> bool:
    """Whether the small path's kernels read both weights: 16-bit ones, or float8 ones in 32-bit words.
    Float8 weights that cannot be read so (K or a stride not a multiple of 4: no real model's) take the
    grouped GEMM at every batch."""
    return all(_fp8_words(w) is not None for w in (w13, w2) if isinstance(w, Fp8Weight))


def _word_pieces(block_k: int) -> tuple[int, int]:
    """A word kernel's K step of ``block_k`` float8 values as (pieces, words a piece): pieces of
    KERNEL_K_STEP values, each inside one scale block, or one shorter piece."""
    if block_k < 4 or block_k & (block_k - 1):
        raise ValueError(f"float8 K steps must be powers of two of at least 4 values, not {block_k}")
    piece = min(block_k, KERNEL_K_STEP)
    return block_k // piece, piece // 4


def _quads(t: torch.Tensor) -> torch.Tensor:
    """Rows of 16-bit values (a multiple of 4 a row, contiguous) as 64-bit words of four, what the word
    kernels read them as; copied where the rows or the offset are not aligned to such words."""
    if t.stride(0) % 4 or t.storage_offset() % 4:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.int64)


def _half_factor(w: Fp8Weight) -> float:
    """The square root of the factor a word kernel's widened values lack (2**60 for e4m3, 2**56 for
    e5m2): exact, a power of two."""
    return math.sqrt(fp8_word_factor(w.weight.dtype))


def _fused_moe_small(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: MoeSmallConfig,
    has_absent: bool = False,
) -> torch.Tensor:
    """The small path: x, topk_weights and topk_ids contiguous in their last dimension (checked by caller);
    with ``has_absent``, pairs of negative ids are skipped.

    Float8 weights take the word kernels (``_fp8_words`` gives their words: ``small_path_reads`` checked).
    Where both weights are float8 and act's dtype has float32's range (not float16), the gate-up writes act
    times the down kernel's half factor, which saves that kernel a multiply per act element (an act past
    2**68, ~3e20, would overflow; no model's comes near)."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    gate_up_words, down_words = _fp8_words(w13), _fp8_words(w2)
    # Checked before anything launches.
    if gate_up_words is not None:
        gate_up_pieces = _word_pieces(cfg.gate_up_block_k)
    if down_words is not None:
        down_pieces = _word_pieces(cfg.down_block_k)
    act_scale = 1.0
    if gate_up_words is not None and down_words is not None and x.dtype != torch.float16:
        act_scale = _half_factor(w2)
    # Pair (token) is grid axis 0, the fastest: pairs sharing an expert read its tile at about the same time.
    grid_a = (num_tokens * top_k, triton.cdiv(inter, cfg.gate_up_block_n))
    quads = x.element_size() == 2  # x and act read as 64-bit words of four (``_four_values``)
    if gate_up_words is not None:
        se, sn, sk, bn, bk = scale_args(w13)
        words, xq = gate_up_words, _quads(x) if quads else x
        _moe_small_gate_up_fp8_words_kernel[grid_a](
            xq, words, w13.weight_scale, act, topk_ids, inter, hidden // 4,
            xq.stride(0), words.stride(0), words.stride(1), inter * words.stride(1), act.stride(0), se, sn, sk,
            TOP_K=top_k, BLOCK_N=cfg.gate_up_block_n, PIECES=gate_up_pieces[0], PIECE_W=gate_up_pieces[1],
            SCALE_BN=bn, SCALE_BK=bk, SHIFT=fp8_word_shift(w13.weight.dtype), HALF_FACTOR=_half_factor(w13),
            ACT_SCALE=act_scale, X_QUADS=quads, HAS_ABSENT=has_absent,
            **pdl_kwargs(x.device), num_warps=cfg.gate_up_num_warps, num_stages=cfg.gate_up_num_stages,
        )  # fmt: skip
    else:
        _moe_small_gate_up_kernel[grid_a](
            x, w13, act, topk_ids, inter, hidden,
            x.stride(0), w13.stride(0), w13.stride(1), inter * w13.stride(1), act.stride(0),
            TOP_K=top_k, BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, HAS_ABSENT=has_absent,
            **pdl_kwargs(x.device), num_warps=cfg.gate_up_num_warps, num_stages=cfg.gate_up_num_stages,
        )  # fmt: skip
    grid_b = (num_tokens, triton.cdiv(hidden, cfg.down_block_n))
    if down_words is not None:
        se, sn, sk, bn, bk = scale_args(w2)
        words, aq = down_words, _quads(act) if quads else act
        _moe_small_down_fp8_words_kernel[grid_b](
            aq, words, out, topk_weights, topk_ids, hidden, inter // 4,
            aq.stride(0), words.stride(0), words.stride(1), out.stride(0), w2.weight_scale, se, sn, sk,
            TOP_K=top_k, BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=cfg.down_block_n,
            PIECES=down_pieces[0], PIECE_W=down_pieces[1], SCALE_BN=bn, SCALE_BK=bk,
            SHIFT=fp8_word_shift(w2.weight.dtype), HALF_FACTOR=_half_factor(w2),
            A_SCALE=1.0 if act_scale != 1.0 else _half_factor(w2), A_QUADS=quads, HAS_ABSENT=has_absent,
            **pdl_kwargs(x.device), num_warps=cfg.down_num_warps, num_stages=cfg.down_num_stages,
        )  # fmt: skip
        return out
    _moe_small_down_kernel[grid_b](
        act, w2, out, topk_weights, topk_ids, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=cfg.down_block_n,
        BLOCK_K=cfg.down_block_k, HAS_ABSENT=has_absent,
        **pdl_kwargs(x.device), num_warps=cfg.down_num_warps, num_stages=cfg.down_num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# Entry point


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    has_absent: bool = False,
) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate || up); w2: [E, H, I]; topk_weights/ids: [T, k] (physical ids).

    Returns sum_k weight_k * expert_k(x) in x's dtype, [T, H]. Decode-sized batches (``use_small_path``)
    take two GEMV-style launches; the rest align pairs by expert and run the grouped GEMM.

    With ``has_absent``, a negative id is a pair whose expert another expert-parallel rank holds: it adds
    nothing and reads no weights (the small path's programs skip it; the grouped path aligns such pairs as
    one more expert whose tiles write zeros). Without it a negative id is out of range; the flag is a
    compile-time switch, so one GPU's kernels carry no check (a runtime check cost ~1% of a batch-1 MoE
    step on the H200).

    Either weight may be an ``Fp8Weight``: the kernels then read its float8 values and scale their float32
    partial sums (module docstring), which differs from ``fused_moe_torch``'s dequantised weights by those
    weights' rounding to the model's dtype.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if _values(w13).stride(-1) != 1 or _values(w2).stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dimension")
    topk_weights = topk_weights.contiguous()
    if use_small_path(num_pairs, num_experts) and small_path_reads(w13, w2):
        fp8 = isinstance(w13, Fp8Weight) or isinstance(w2, Fp8Weight)
        cfg = moe_small_fp8_config(x.device) if fp8 else moe_small_config(x.device)
        return _fused_moe_small(x, w13, w2, topk_weights, topk_ids.contiguous(), cfg, has_absent)
    cfg = moe_tile_config(num_pairs, num_experts, x.device)
    if has_absent:  # the absent pairs as expert E, after the real ones
        topk_ids = torch.where(topk_ids < 0, num_experts, topk_ids)
    sorted_ids, expert_ids, num_rows_padded = moe_align_block_size(
        topk_ids, cfg.block_m, num_experts + int(has_absent)
    )

    gate_up = torch.empty((num_pairs, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, topk_weights, sorted_ids, expert_ids, num_rows_padded, top_k, False, cfg)
    act = silu_and_mul_triton(gate_up)
    down = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, topk_weights, sorted_ids, expert_ids, num_rows_padded, 1, True, cfg)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
