"""Linear projections of decode batches (1 to 16 rows): the Triton version of ``kernels/linear.py``.

At batch 1 a projection is a GEMV that streams its whole weight from HBM once. ``_gemv_kernel`` with one
or two weight rows per program beats cuBLAS on every decode projection of the benchmark models: on an
H200 (``benchmarks/kernel_bench.py --sweep-linear``, 2026-11-29, back-to-back in a CUDA graph with
programmatic dependent launch) Llama-3.1-8B QKV 14.0 against 16.6 us, o-proj 10.0 / 13.5, gate-up
56.3 / 59.6, down (14336-long rows) 30.0 / 32.7, LM head 235.8 / 251.9; Qwen3-30B-A3B QKV 7.0 / 8.4,
o-proj 6.0 / 9.7, router 1.4 / 4.9, LM head 145.2 / 153.2. Many small programs keep enough loads in
flight on every SM, where cuBLAS splits K and reduces in a second kernel. With several rows cuBLAS's
tensor-core kernels beat the GEMV by far (4 rows: the GEMV is 0.1-0.3x as fast), so ``use_gemv`` takes the
GEMV for one row only; 2 to 16 rows take ``_skinny_kernel`` (tensor cores, see below), more rows cuBLAS.
One launch per projection also keeps the layer's kernels in one chain of programmatic dependent launches
(``kernels.triton_device``), which a cuBLAS kernel would break.

``_gemv_kernel``: grid over N tiles; each program streams ``BLOCK_N`` rows of ``w`` in ``BLOCK_K`` chunks
against the input row, keeps per-lane fp32 partial sums and reduces them once at the end. No host
synchronisation: the choice and the sizes come from shapes, so it sits in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_weight import Fp8Weight, scale_args
from kernels.linear import promoted
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait, sm_count
from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton


def use_gemv(m: int, n: int, k: int) -> bool:
    """Whether ``linear_triton`` runs the GEMV kernel for x [m, k] @ w[n, k].T (see the module docstring)."""
    return m == 1 and n > 0 and k > 0


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # the skinny kernel only: K cut into this many parts, summed by a second launch
    block_m: int = 16  # the skinny kernel only: x rows a tile (SKINNY_BLOCK_M; wider for float8 past 16 rows)


def linear_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """Tile sizes by the shape of ``w`` ([n, k]), from ``kernel_bench.py --sweep-linear``: one row per
    program in 512-element chunks for rows of 4096 and longer, two rows in 1024-element chunks for shorter
    ones; 4 warps, 4 stages (2 stages measured within 1%)."""
    if device.type != "cuda":
        return LinearConfig(16, 32, 4, 1)  # the interpreter: tiny shapes, several K steps, masked edges
    if k >= 4096:
        return LinearConfig(1, 512, 4, 4)
    return LinearConfig(2, 1024, 4, 4)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = x . w[n] for BLOCK_N rows n, fp32 accumulation."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        lanes += w * xk[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(lanes, axis=1)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


# A few rows (decode batches of 2 to ``SKINNY_MAX_M``): ``_skinny_kernel`` reads every weight tile from
# HBM once and multiplies it on tensor cores against up to 16 rows at once, with the weight rows as the
# MMA's long side (out.T = w @ x.T), so the rows are padded to 16 and the weights not at all. One H200
# (``benchmarks/kernel_bench.py --skinny``, CUDA graphs over rotated weights; docs/performance.md,
# "Seventeenth run"): at 2-16 rows it beats cuBLAS on every projection of the benchmark models (QKV 5-9%,
# o-proj 6-21%, Llama-3.1-8B's gate-up 6-8% and down 2-7%), and it stays in the chain of programmatic
# dependent launches, where cuBLAS's split-K kernels and their reduction kernels break it. From 32 rows
# cuBLAS's tiles win (gate-up at 64 rows: 65 against 104 us).
SKINNY_MAX_M = 16
SKINNY_BLOCK_M = 16  # token rows per MMA tile: the smallest tl.dot side, fixed so a row's sums never
# depend on how many rows come with it


def use_skinny(m: int, n: int, k: int) -> bool:
    """Whether ``linear_triton`` runs the skinny kernel for x [m, k] @ w[n, k].T: 2 to SKINNY_MAX_M rows."""
    return 2 <= m <= SKINNY_MAX_M and n > 0 and k > 0


def skinny_config(n: int, k: int, device: torch.device, fp8: bool = False) -> LinearConfig:
    """Tile of ``_skinny_kernel`` by the shape of ``w`` and the device only (never by M, so results are
    batch-invariant): 64 weight rows per program in 128-wide steps, with K split where the tiles alone
    would leave SMs idle: into as many parts as make about one program per SM (at most 4, each at least
    1024 long), and into 4 for rows longer than 4096. From ``kernel_bench.py --sweep-skinny`` (one H200,
    2026-11-30 13:20 UTC, us per call at 2 / 16 rows): Qwen3-30B-A3B's o-proj (2048 x 4096, 4 parts) 6.8 /
    6.7 against 9.1 / 8.0 for the 16-row tile unsplit; Llama-3.1-8B's o-proj (4096 x 4096, 2 parts) 10.7 /
    10.8 against 11.5 / 11.5 for 64 x 256 unsplit, its down (4096 x 14336, 4 parts) 30.3 / 31.1 against
    30.9 / 31.8; QKV and gate-up (80 tiles and more) unsplit, where splitting was 0-7% slower. A part past
    the end of K (more parts than steps) adds zeros.

    A float8 weight (``fp8``) splits K into 4 parts of at least 512 wherever it can: its tiles are widened
    in registers before their MMAs, so a program streams more slowly and more programs must be in flight.
    ``fp8_weight_bench.py --sweep`` (one H200, 2026-12-02 01:50 UTC, us at 4 / 16 rows, 128 x 128 scale
    blocks): Qwen3-30B-A3B QKV 8.6 / 9.4 against 13.0 / 12.6 unsplit, Llama-3.1-8B QKV 14.4 / 14.8 against
    23.9 / 22.9, gate-up 46.8 / 48.8 against 59.3 / 59.7, down (already 4 parts) 28.5 / 29.0; 3 stages
    beat 5 by 0.2-7 us, 64 weight rows beat 32 and 128."""
    if device.type != "cuda":  # the interpreter: tiny shapes, several K steps, masked edges, split K
        return LinearConfig(16, 32, 4, 1, split_k=2 if k > 64 else 1)
    if fp8:
        return LinearConfig(64, 128, 4, 3, split_k=max(1, min(4, k // 512)))
    split = 4 if k > 4096 else max(1, min(4, sm_count(device) // triton.cdiv(n, 64), k // 1024))
    return LinearConfig(64, 128, 4, 4, split_k=split)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    k_split,
    stride_xm,
    stride_wn,
    stride_om,
    s_sn,
    s_sk,
    W_FP8: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = x[m] . w[n] for BLOCK_M rows m and BLOCK_N weight rows n, fp32 accumulation. The grid's
    first axis is the M tiles, fastest, so the programs that share a weight tile run together and read
    it from HBM once. With SPLIT_K > 1 each program takes ``k_split`` of K (a multiple of BLOCK_K) and
    writes its fp32 sums to ``out_ptr`` as [SPLIT_K, M, N] partials, which ``_sum_splits_kernel`` adds.

    W_FP8: ``w`` holds float8 values (``Fp8Weight``) with scales at ``s_ptr`` over SCALE_BN x SCALE_BK
    blocks; each tile is widened to x's dtype (exact) for its MMA, and the step's fp32 result times the
    step's scales (a BLOCK_K step lies in one block along K), or with ROW_SCALES (one scale a row) the
    sums once at the end."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m // SPLIT_K
    split = pid // num_m % SPLIT_K
    k_start = split * k_split
    k_end = tl.minimum(K, k_start + k_split)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k_start + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + k_start + offs_k[:, None]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn  # W_FP8 only
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)  # masked rows fetch nothing
        else:
            k_mask = offs_k < k_end - k0
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if not W_FP8:
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        elif ROW_SCALES:
            acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PRECISION)
        else:
            scale = tl.load(s_rows + (k0 // SCALE_BK) * s_sk, mask=n_mask, other=0.0)
            acc += tl.dot(w.to(xt.dtype), xt, input_precision=DOT_PRECISION) * scale[:, None]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_FP8 and ROW_SCALES:
        acc *= tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_ptrs = out_ptr + (split * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = the [SPLIT_K, M, N] fp32 partials summed in split order (a fixed order, so the result
    does not depend on which split finished first), rounded once to out's dtype."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs // N * stride_om + offs % N, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Weights of fewer rows than this (MoE routers: 128) leave too few 16-row tiles to keep HBM busy; such a
# weight takes ``_skinny_rows_kernel``, one weight row per program on CUDA cores (Qwen3-30B-A3B's router at
# 2-8 rows: 1.9-2.6 against 4.9 us).
SKINNY_ROWS_MAX_N = 1024
SKINNY_ROWS_BLOCK_M = 8  # x rows per program of that variant (fixed: batch-invariant rows)


def use_skinny_rows(n: int, device: torch.device) -> bool:
    """Whether a weight of ``n`` rows takes ``_skinny_rows_kernel`` (in the interpreter: under 24 rows, so
    the tests' tiny shapes reach both kernels)."""
    return n < (SKINNY_ROWS_MAX_N if device.type == "cuda" else 24)


@triton.jit
def _skinny_rows_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = x[m] . w[n] for one weight row n and BLOCK_M rows m (grid: weight rows, then row tiles):
    per-lane fp32 sums over K, reduced once at the end (the GEMV's scheme with the weight row shared by the
    tile's x rows). The tile is fixed, so a row's sums do not depend on the batch."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    n = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_ptrs = w_ptr + n.to(tl.int64) * stride_wn + offs_k
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    lanes = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        lanes += x * w[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(lanes, axis=1)
    tl.store(out_ptr + offs_m.to(tl.int64) * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=m_mask)


def skinny_linear_triton(
    x: torch.Tensor, w: torch.Tensor | Fp8Weight, cfg: LinearConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T for a few rows (unit last strides): ``_skinny_rows_kernel`` for 16-bit weights
    of few rows, ``_skinny_kernel`` otherwise (a float8 weight with its scales, W_FP8). ``cfg`` overrides
    ``skinny_config`` (the benchmarks' sweeps)."""
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    fp8 = isinstance(w, Fp8Weight)
    if not fp8 and use_skinny_rows(n, x.device):
        block_m, block_k = (SKINNY_ROWS_BLOCK_M, 1024) if x.device.type == "cuda" else (4, 32)
        _skinny_rows_kernel[(n, triton.cdiv(m, block_m))](
            x, w, out, m, k, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_K=block_k, **pdl_kwargs(x.device), num_warps=4, num_stages=2,
        )  # fmt: skip
        return out
    cfg = cfg or skinny_config(n, k, x.device, fp8)
    if fp8:
        values, scales, (_, s_sn, s_sk, bn, bk) = w.weight, w.weight_scale, scale_args(w)
        if s_sk and bk % cfg.block_k:
            raise ValueError(f"scale blocks {bk} long along K do not hold whole {cfg.block_k}-long steps")
    else:
        values, scales, (s_sn, s_sk, bn, bk) = w, w, (0, 0, 1, 1)
    split_k = cfg.split_k  # by the weight's shape and the device: a row's sums do not depend on the batch
    k_split = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    dest = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * split_k * triton.cdiv(n, cfg.block_n),)
    _skinny_kernel[grid](
        x, values, scales, dest, m, n, k, k_split, x.stride(0), values.stride(0), out.stride(0), s_sn, s_sk,
        W_FP8=fp8, SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k,
        EVEN_K=k % cfg.block_k == 0, DOT_PRECISION=dot_precision(x.dtype),
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_k > 1:
        block = 1024 if x.device.type == "cuda" else 64
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            dest, out, m, n, out.stride(0), SPLIT_K=split_k, BLOCK=block, **pdl_kwargs(x.device), num_warps=4,
        )  # fmt: skip
    return out


def linear_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K], contiguous last dim -> x @ w.T, [M, N] in x's dtype. One GEMV launch where
    ``use_gemv`` says so (one row), one skinny launch where ``use_skinny`` does (2 to SKINNY_MAX_M rows),
    cuBLAS otherwise. A float8 weight (``Fp8Weight``) takes ``kernels/triton_fp8_linear.py``'s kernels."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if isinstance(w, Fp8Weight):
        from kernels.triton_fp8_linear import fp8_linear_triton  # it imports this module

        return fp8_linear_triton(x, w)
    (m, k), n = x.shape, w.shape[0]
    if w.stride(-1) != 1 or not (use_gemv(m, n, k) or use_skinny(m, n, k)):
        return x @ w.t()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m > 1:
        return skinny_linear_triton(x, w)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = linear_config(n, k, x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, out, n, k, w.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# RMSNorm (with the residual add) fused into the GEMV that consumes it

# Rows up to this long are normalised inside the GEMV (every hidden size of the benchmark models, and of
# most models up to 70B); longer ones run the norm kernel and then the GEMV.
NORM_GEMV_MAX_K = 8192


def use_norm_gemv(m: int, n: int, k: int) -> bool:
    """Whether ``add_rms_norm_linear_triton`` runs the fused kernel: one row, as ``use_gemv``, and a row of
    at most ``NORM_GEMV_MAX_K`` (each program holds its weight rows and the whole input row at once)."""
    return use_gemv(m, n, k) and k <= NORM_GEMV_MAX_K


def norm_gemv_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """Tile of the fused kernel: ``block_k`` covers the whole row (one load of every weight row, no K loop)
    and ``block_n`` rows per program. From ``kernel_bench.py --norm-linear`` (one H200, 2026-11-29 22:15
    UTC, CUDA-graph replay over rotated weights): rows of 2048 take 4 rows in 8 warps (Qwen3-30B-A3B QKV
    6.5 us against 7.3 with 4 warps; router 1.6 against 1.5), rows of 4096 2 rows in 4 warps (Llama-3.1-8B
    QKV 13.8 us, gate-up 55.0, both within 0.3 us of the best tile)."""
    block_k = triton.next_power_of_2(k)
    if device.type != "cuda":
        return LinearConfig(4, block_k, 4, 1)  # the interpreter: several programs, masked edges
    if k <= 2048:
        return LinearConfig(4, block_k, 8, 1)
    return LinearConfig(2, block_k, max(4, 2 * block_k // 2048), 1)  # 8192: 8 warps, 64 elements each


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    g_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    normed_ptr,
    N,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = w[n] . rms_norm(x + res) * g for BLOCK_N rows n; program 0 also writes x + res (and the
    normalised row where WRITE_NORMED).

    Every program normalises the row itself (it is read from L2, a few KB), so the norm needs no launch
    of its own and no second pass over HBM; the weight rows are loaded first, so their HBM reads are in
    flight while the norm is reduced. Roundings are the reference's (``kernels/norm.py``): the sum and the
    normalised row are rounded to their dtype before the weight multiply, and the product is rounded to
    the normed dtype before the dot."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    first = offs_k < tl.where(pid == 0, K, 0)  # program 0 writes the row outputs
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # before the reduction, in flight
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs_k, summed, mask=first)
        s = summed.to(tl.float32)
        in_dtype = sum_ptr.dtype.element_ty
    else:
        s = x
        in_dtype = x_ptr.dtype.element_ty
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / K + eps)
    h = (g * (s * inv_rms).to(in_dtype).to(tl.float32)).to(normed_ptr.dtype.element_ty)
    if WRITE_NORMED:
        tl.store(normed_ptr + offs_k, h, mask=first)
    out = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def add_rms_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    need_normed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``kernels.linear.add_rms_norm_linear_torch`` on the GPU: (linear(h, w), h if need_normed,
    x + residual) with h = rms_norm(x + residual) * norm_weight (no add where residual is None, and the sum
    is x itself). One fused launch where ``use_norm_gemv`` says so and the rows are plain (same dtypes, or
    a float32 ``w`` whose projection comes out in float32 as the reference's; unit last strides); otherwise
    the norm kernel, then ``linear_triton``. A float8 weight takes ``kernels/triton_fp8_linear.py``'s."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if isinstance(w, Fp8Weight):
        from kernels.triton_fp8_linear import fp8_add_rms_norm_linear_triton  # it imports this module

        return fp8_add_rms_norm_linear_triton(x, residual, norm_weight, eps, w, need_normed)
    (m, k), n = x.shape, w.shape[0]
    plain = (
        x.stride(-1) == 1
        and w.stride(-1) == 1
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        and norm_weight.dtype == x.dtype
        and w.dtype in (x.dtype, torch.float32)
    )
    if not (plain and use_norm_gemv(m, n, k)):
        if residual is None:
            h, summed = rms_norm_triton(x, norm_weight, eps), x
        else:
            h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
        return linear_triton(promoted(h, w), w), (h if need_normed else None), summed
    out = torch.empty((1, n), dtype=w.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    normed = (
        torch.empty_like(x) if need_normed else summed
    )  # `summed` only lends its dtype when nothing is written
    cfg = norm_gemv_config(n, k, x.device)
    _norm_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, residual if residual is not None else x, norm_weight, w, out, summed, normed, n, k, w.stride(0), eps,
        HAS_RESIDUAL=residual is not None, WRITE_NORMED=need_normed, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, (normed if need_normed else None), summed


# ---------------------------------------------------------------------------------------------------------
# A gated MLP's activation fused into its down projection's GEMV (and the add that follows it)


@triton.jit
def _silu_mul_gemv_kernel(
    gu_ptr,
    w_ptr,
    add_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    HAS_ADD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = (silu(gate) * up) . w[n] (+ add[n]) for BLOCK_N rows n, gate_up = gate || up (K each). Each
    program forms the activation chunk by chunk from the gate-up row (read from L2), rounded as
    ``silu_and_mul`` rounds it; the dot is rounded to the output dtype before the add, as the two ops are."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        gate = tl.load(gu_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + K + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(gu_ptr.dtype.element_ty).to(tl.float32)
        act = (silu * up).to(gu_ptr.dtype.element_ty).to(tl.float32)
        lanes += w * act[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(lanes, axis=1).to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        out = (out.to(tl.float32) + tl.load(add_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)).to(
            out_ptr.dtype.element_ty
        )
    tl.store(out_ptr + offs_n, out, mask=n_mask)


def silu_mul_linear_triton(
    gate_up: torch.Tensor, w: torch.Tensor | Fp8Weight, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``kernels.linear.silu_mul_linear_torch``: one GEMV launch for one row (the activation formed inside
    it, the add its epilogue) where the rows are plain (one dtype, unit last strides) and the GEMV's tile
    holds several weight rows; otherwise the SiLU kernel, ``linear_triton`` and an add.

    Every program forms the activation it needs from the gate-up row in L2: with one weight row a program
    (rows of 4096 and longer: Llama-3.1-8B's down projection) those re-reads would be twice the weight's
    bytes, against once for the plain GEMV's input, so such shapes keep the two launches (unmeasured)."""
    (m, two_k), n = gate_up.shape, w.shape[0]
    k = two_k // 2
    cfg = linear_config(n, k, gate_up.device)
    plain = (
        cfg.block_n >= 2
        and isinstance(w, torch.Tensor)
        and gate_up.stride(-1) == 1
        and w.stride(-1) == 1
        and w.dtype == gate_up.dtype
        and (add is None or (add.dtype == gate_up.dtype and add.is_contiguous() and add.shape == (m, n)))
    )
    if not (plain and use_gemv(m, n, k) and w.shape[1] == k):
        out = linear_triton(silu_and_mul_triton(gate_up), w)
        return out if add is None else out + add
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        gate_up, w, add if add is not None else out, out, n, k, w.stride(0),
        HAS_ADD=add is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **pdl_kwargs(gate_up.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
