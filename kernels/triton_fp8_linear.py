"""Linear projections over weights kept in float8 (``kernels.fp8_weight.Fp8Weight``): the Triton side of
``linear`` and ``add_rms_norm_linear`` when the weight is one.

At decode sizes a projection streams its whole weight from HBM, so a float8 weight moves half the bytes
of a 16-bit one.

- one row (up to ``FP8_GEMV_MAX_M``): ``_fp8_gemv_kernel``, on CUDA cores. Each program streams
  ``BLOCK_N`` weight rows in pieces of ``KERNEL_K_STEP`` values (``PIECES`` pieces a loop step, unrolled),
  so every piece lies in one scale block and takes one scale, and multiplies each piece, widened to
  float32 once, by ``ROWS`` (1, 2 or 4) rows of x; more rows take more programs along the grid's second
  axis. The input norm can be fused in (the kernel's ``FUSE_NORM``, as ``_norm_gemv_kernel``; the switch
  ``NORM_IN_GEMV``): a first pass over x reduces the row's norm, the second normalises each piece as it
  multiplies it. Both measured slower than the alternatives (the constants' comments), so the GEMV takes
  one row and the norm runs in its own kernel; the paths stay tested.
- 2 to ``SKINNY_MAX_M`` rows: ``kernels.triton_linear._skinny_kernel`` with ``W_FP8`` (tensor cores, each
  tile widened in registers, exact, for its MMA; K in 4 parts).
- more rows (prefill): ``_fp8_dequant_kernel`` widens the weight into a scratch tensor of the model's
  dtype, which cuBLAS multiplies (compute-bound, where reading the weight twice costs little).

Every GEMV tile is 2-D ([BLOCK_N, KERNEL_K_STEP] weights against [KERNEL_K_STEP] of x). Tiles of three
dimensions (pieces as an axis) made Triton move x through shared memory with a barrier every step, and
were slower (docs/performance.md, "Twenty-seventh run"), as were kernels that widened float8 with integer
shifts instead of conversion instructions.

Scales multiply float32 partial sums (module docstring of ``kernels/fp8_weight.py``): one-row-scale
layouts once at the end; block layouts each piece, on x where the program's rows share a row block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_weight import KERNEL_K_STEP, Fp8Weight, scale_args
from kernels.triton_device import pdl_kwargs, pdl_wait
from kernels.triton_linear import SKINNY_MAX_M, LinearConfig, skinny_linear_triton
from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

# Rows on the GEMV; more (to SKINNY_MAX_M) on the skinny kernel. One H200, ``fp8_weight_bench.py``
# (2026-12-02 01:50 UTC, 128 x 128 blocks, us): at 2 rows the GEMV took Qwen3-30B-A3B QKV 8.7, o-proj 7.7,
# Llama-3.1-8B QKV 16.3, o-proj 11.5, gate-up 66.1, down 37.0; the skinny kernel (K in 4 parts) 8.6 at 4
# rows on QKV, 14.4, 46.8 and 28.5 on Llama's: the GEMV's cost grows with its rows (each row's products on
# CUDA cores: 4 rows 12.5-113 us), the skinny kernel's hardly does.
FP8_GEMV_MAX_M = 1
# One row's input norm inside the GEMV (``FUSE_NORM`` of the kernel), or the norm kernel first. The same
# run: fused 11.8 / 18.0 / 21.5 / 21.2 / 81.2 / 80.2 us on the six shapes, the norm kernel and the GEMV
# 6.8 / 7.1 / 12.2 / 9.1 / 41.9 / 26.6 (the fused kernel's first pass over x and its per-piece norm cost
# more than the launch it saves); so off, kept for the record and tested.
NORM_IN_GEMV = False


# Decode batches past SKINNY_MAX_M rows, to this many, take the skinny kernel with 64-row tiles
# (``fp8_wide_config``) instead of the widened weight through cuBLAS, which writes and reads the weight once
# more (Llama-3.1-8B's decode step at 64 rows: 12.3 ms that way against 6.1 for bf16; gpu_bench,
# 2026-12-02). One H200, ``fp8_weight_bench.py --sweep-wide`` (01:27 UTC, us, 64 / 128 / 256 rows; the
# kernel, widened + cuBLAS, bf16 cuBLAS): Llama-3.1-8B QKV 18.2 / 29.1 / 49.0, 39.0 / 40.0 / 44.7, 17.0 /
# 17.0 / 21.9; gate-up 69.1 / 118.5 / 208.9, 167 / 170 / 190, 62.5 / 67.1 / 90.2; down 46.2 / 58.0 /
# 103.2, 89.3 / 91.2 / 99.6, 36.6 / 37.8 / 48.5. The kernel wins to 128 rows and loses at 256; both lose to
# bf16, as each weight tile is widened once for every 64 rows (w8a16: activations stay 16-bit).
FP8_WIDE_MAX_M = 128


def fp8_wide_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """The skinny kernel's tile for SKINNY_MAX_M < M <= FP8_WIDE_MAX_M rows of x against a float8 weight,
    by the weight's shape only (a row's sums do not depend on the batch within that range): 64 x 64 tiles,
    K in parts until about 384 programs run at 64 rows (at most 4 parts, each at least 512 long). The
    sweep above: 64 x 64 was best or within 4 us of it at 64 and 128 rows except Llama's down at 128 (128 x
    128, 8 warps: 58 against 76 us); 4 parts on QKV and down at 64 rows (12.1 us against 15.2 unsplit on
    Qwen3-30B-A3B's QKV), one on gate-up (448 tiles: 72.8 against 69.1 with two)."""
    if device.type != "cuda":  # the interpreter: small tiles, several steps, split K
        return LinearConfig(16, 32, 4, 1, split_k=2 if k > 64 else 1, block_m=32)
    split = max(1, min(4, 384 // triton.cdiv(n, 64), k // 512))
    return LinearConfig(64, 128, 4, 3, split_k=split, block_m=64)


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int  # weight rows a program
    pieces: int  # KERNEL_K_STEP-long pieces a loop step
    num_warps: int


def fp8_gemv_config(n: int, k: int, device: torch.device, rows: int = 1) -> Fp8GemvConfig:
    """Tile of ``_fp8_gemv_kernel``: two weight rows a program, 8 pieces a step, one warp. From
    ``fp8_weight_bench.py --sweep`` (one H200, 2026-12-02 01:50 UTC, CUDA graphs over rotated weights,
    128 x 128 blocks; block_n 1-16 x 1, 2, 4 warps): best at one row Qwen3-30B-A3B QKV 6.5 us (4/8/1; this
    tile 7.1), Llama-3.1-8B QKV 11.5 (1/8/1; 13.0), gate-up 38.6 (4/8/1; 41.7), down 24.1 (this tile): no
    other tile was within 1 us of the best on all four. With 4 rows one weight row a program was best
    (11.4 / 25.0 / 106.0 / 56.1 us), still far slower than the skinny kernel; ``rows`` is unused."""
    if device.type != "cuda":  # the interpreter: several programs and steps, masked edges
        return Fp8GemvConfig(4, 1, 4)
    return Fp8GemvConfig(2, 8 if k >= 8 * KERNEL_K_STEP else max(1, k // KERNEL_K_STEP), 1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    res_ptr,
    g_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    sum_ptr,
    normed_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    s_sn,
    s_sk,
    eps,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    SHARED_SCALES: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = x[m] . dequant(w[n]) for BLOCK_N weight rows n and ROWS rows m, fp32 accumulation.

    FUSE_NORM (one row): x is rms_norm(x + res) * g, with ``_norm_gemv_kernel``'s roundings; program 0
    writes x + res (and the normalised row where WRITE_NORMED). ROW_SCALES: one scale a weight row,
    multiplied at the end; SHARED_SCALES: the program's rows lie in one row block, so a piece's scale
    multiplies x's piece; otherwise each row's piece scale multiplies its products."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    PIECE: tl.constexpr = 128  # KERNEL_K_STEP
    pid = tl.program_id(0)
    m0 = tl.program_id(1) * ROWS
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, PIECE)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn  # [BLOCK_N]
    s_shared = s_ptr + (pid * BLOCK_N // SCALE_BN) * s_sn
    x_row = x_ptr + m0.to(tl.int64) * stride_xm
    inv_rms = 0.0
    if FUSE_NORM:  # first pass: the row's mean square, from L2
        squares = tl.zeros((PIECE,), dtype=tl.float32)
        for k0 in range(0, K, PIECE):
            s = _summed(x_ptr, res_ptr, sum_ptr, k0 + offs_k, K, False, HAS_RESIDUAL)
            squares += s * s
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc0 = tl.zeros((BLOCK_N, PIECE), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, PIECE), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, PIECE), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, PIECE), dtype=tl.float32)
    for k0 in range(0, K, PIECES * PIECE):
        for p in tl.static_range(PIECES):
            kk = k0 + p * PIECE + offs_k
            k_mask = kk < K
            w = tl.load(w_ptrs + p * PIECE, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            if ROW_SCALES:
                xscale = 1.0
            elif SHARED_SCALES:
                xscale = tl.load(
                    s_shared + (k0 + p * PIECE) // SCALE_BK * s_sk, mask=k0 + p * PIECE < K, other=0.0
                )
            else:
                xscale = 1.0
                w = w * tl.load(s_rows + (k0 + p * PIECE) // SCALE_BK * s_sk, mask=n_mask, other=0.0)[:, None]
            if FUSE_NORM:
                s = _summed(x_ptr, res_ptr, sum_ptr, kk, K, pid == 0, HAS_RESIDUAL)
                x0 = _normed(g_ptr, normed_ptr, s, inv_rms, kk, K, pid == 0, x_ptr, sum_ptr, HAS_RESIDUAL,
                             WRITE_NORMED)  # fmt: skip
            else:
                x0 = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc0 += w * (x0 * xscale)[None, :]
            if ROWS > 1:
                x1 = tl.load(x_row + stride_xm + kk, mask=kk < tl.where(m0 + 1 < M, K, 0), other=0.0).to(
                    tl.float32
                )
                acc1 += w * (x1 * xscale)[None, :]
            if ROWS > 2:
                x2 = tl.load(x_row + 2 * stride_xm + kk, mask=kk < tl.where(m0 + 2 < M, K, 0), other=0.0).to(
                    tl.float32
                )
                acc2 += w * (x2 * xscale)[None, :]
                x3 = tl.load(x_row + 3 * stride_xm + kk, mask=kk < tl.where(m0 + 3 < M, K, 0), other=0.0).to(
                    tl.float32
                )
                acc3 += w * (x3 * xscale)[None, :]
        w_ptrs += PIECES * PIECE
    row_scale = 1.0
    if ROW_SCALES:
        row_scale = tl.load(s_rows, mask=n_mask, other=0.0)
    out_row = out_ptr + m0.to(tl.int64) * stride_om + offs_n
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row, (tl.sum(acc0, axis=1) * row_scale).to(dtype), mask=n_mask)
    if ROWS > 1:
        tl.store(
            out_row + stride_om,
            (tl.sum(acc1, axis=1) * row_scale).to(dtype),
            mask=offs_n < tl.where(m0 + 1 < M, N, 0),
        )
    if ROWS > 2:
        tl.store(
            out_row + 2 * stride_om,
            (tl.sum(acc2, axis=1) * row_scale).to(dtype),
            mask=offs_n < tl.where(m0 + 2 < M, N, 0),
        )
        tl.store(
            out_row + 3 * stride_om,
            (tl.sum(acc3, axis=1) * row_scale).to(dtype),
            mask=offs_n < tl.where(m0 + 3 < M, N, 0),
        )


@triton.jit
def _summed(x_ptr, res_ptr, sum_ptr, offs, K, WRITES, HAS_RESIDUAL: tl.constexpr):
    """x + res at ``offs`` (rounded to its dtype; stored where WRITES), or x, as float32."""
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, summed, mask=offs < tl.where(WRITES, K, 0))
        x = summed.to(tl.float32)
    return x


@triton.jit
def _normed(g_ptr, normed_ptr, s, inv_rms, offs, K, WRITES, x_ptr, sum_ptr, HAS_RESIDUAL: tl.constexpr,
            WRITE_NORMED: tl.constexpr):  # fmt: skip
    """g * rms-normalised s at ``offs`` (stored where WRITES and WRITE_NORMED), as float32."""
    if HAS_RESIDUAL:
        in_dtype = sum_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    h = (g * (s * inv_rms).to(in_dtype).to(tl.float32)).to(normed_ptr.dtype.element_ty)
    if WRITE_NORMED:
        tl.store(normed_ptr + offs, h, mask=offs < tl.where(WRITES, K, 0))
    return h.to(tl.float32)


def _gemv(
    x: torch.Tensor,
    w: Fp8Weight,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    need_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x @ dequant(w).T, the normalised row where asked, x + residual) for 1 to SKINNY_MAX_M rows, the
    norm fused where ``norm_weight`` is given (one row)."""
    (m, k), n, fuse = x.shape, w.shape[0], norm_weight is not None
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if need_normed else out  # `out` only lends its dtype when nothing is written
    rows = 1 if m == 1 else (2 if m == 2 else 4)
    cfg = fp8_gemv_config(n, k, x.device, rows)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, rows))](
        x, residual if residual is not None else x, norm_weight if fuse else x, w.weight, w.weight_scale,
        out, summed, normed, m, n, k, x.stride(0), w.weight.stride(0), out.stride(0), s_sn, s_sk, eps,
        SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0, SHARED_SCALES=bn % cfg.block_n == 0,
        FUSE_NORM=fuse, HAS_RESIDUAL=residual is not None, WRITE_NORMED=need_normed, ROWS=rows,
        BLOCK_N=cfg.block_n, PIECES=cfg.pieces, **pdl_kwargs(x.device), num_warps=cfg.num_warps,
    )  # fmt: skip
    return out, (normed if need_normed else None), summed


@triton.jit
def _fp8_dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    s_sn,
    s_sk,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n, k] = w[n, k] x its scale, rounded once to out's dtype (``Fp8Weight.dequantize``)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(
        s_ptr + (offs_n // SCALE_BN * s_sn)[:, None] + (offs_k // SCALE_BK * s_sk)[None, :], mask=mask
    )
    out = (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], out, mask=mask)


def dequantize_triton(w: Fp8Weight) -> torch.Tensor:
    """``w.dequantize()`` in one launch (a 2-D weight)."""
    n, k = w.shape
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((n, k), dtype=w.dtype, device=w.device)
    block_n, block_k = (32, 128) if w.device.type == "cuda" else (16, 32)
    _fp8_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.weight, w.weight_scale, out, n, k, w.weight.stride(0), s_sn, s_sk,
        SCALE_BN=bn, SCALE_BK=bk, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def fp8_linear_triton(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ dequant(w).T in x's dtype: the float8 GEMV for up to FP8_GEMV_MAX_M rows, the skinny
    kernel (tensor cores) up to SKINNY_MAX_M, the widened weight through cuBLAS past that."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if 1 <= m <= FP8_WIDE_MAX_M and w.weight.stride(-1) == 1:
        if m <= FP8_GEMV_MAX_M:
            return _gemv(x, w)[0]
        if m <= SKINNY_MAX_M:
            return skinny_linear_triton(x, w)
        return skinny_linear_triton(x, w, fp8_wide_config(*w.shape, x.device))
    return x @ dequantize_triton(w).t()


def fp8_add_rms_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: Fp8Weight,
    need_normed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm_linear`` over a float8 weight: one fused launch for one plain row, else the norm
    kernel and ``fp8_linear_triton``."""
    plain = (
        x.stride(-1) == 1
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        and norm_weight.dtype == x.dtype
        and w.weight.stride(-1) == 1
    )
    if plain and x.shape[0] == 1 and NORM_IN_GEMV:
        return _gemv(x, w, residual, norm_weight, eps, need_normed)
    if residual is None:
        h, summed = rms_norm_triton(x, norm_weight, eps), x
    else:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
    return fp8_linear_triton(h, w), (h if need_normed else None), summed
