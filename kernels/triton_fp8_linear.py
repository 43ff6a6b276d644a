"""Linear projections over weights kept in float8 (``kernels.fp8_weight.Fp8Weight``): the Triton side of
``linear`` and ``add_rms_norm_linear`` when the weight is one.

At decode sizes a projection streams its whole weight from HBM, so a float8 weight moves half the bytes
of a 16-bit one.

- one row: ``_fp8_gemv_kernel``, on CUDA cores. Each program streams ``BLOCK_N`` weight rows in pieces of
  ``KERNEL_K_STEP`` values (``PIECES`` pieces a loop step, unrolled), so every piece lies in one scale
  block and takes one scale, and multiplies each piece, widened to float32 once, by x. The input norm
  of ``add_rms_norm_linear`` runs in its own kernel first.
- 2 to ``SKINNY_MAX_M`` rows: ``kernels.triton_linear._skinny_kernel`` with ``W_FP8`` (tensor cores, each
  tile widened in registers, exact, for its MMA; K in 4 parts); to ``FP8_WIDE_MAX_M`` rows the same
  kernel with 64-row tiles (``fp8_wide_config``).
- more rows (prefill): ``_fp8_dequant_kernel`` widens the weight into a scratch tensor of the model's
  dtype, which cuBLAS multiplies (compute-bound, where reading the weight twice costs little).

Measured and replaced (docs/performance.md, "Twenty-seventh run" and "Twenty-eighth run"): GEMV tiles of
three dimensions (pieces as an axis: Triton moved x through shared memory with a barrier every step);
widening float8 with integer shifts instead of conversion instructions; the GEMV over 2-16 rows (each
row's products on CUDA cores: at 2 rows Llama-3.1-8B gate-up 66.1 us against 46.8 on the skinny kernel,
at 4 rows 113 us); the input norm fused into the GEMV (a first pass over x for the norm, then each piece
normalised as it is multiplied: 11.8-81 us on the six benchmark shapes against 6.8-42 for the norm kernel
and the GEMV).

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


def fp8_gemv_config(n: int, k: int, device: torch.device) -> Fp8GemvConfig:
    """Tile of ``_fp8_gemv_kernel``: two weight rows a program, 8 pieces a step, one warp. From
    ``fp8_weight_bench.py --sweep`` (one H200, 2026-12-02 01:50 UTC, CUDA graphs over rotated weights,
    128 x 128 blocks; block_n 1-16 x 1, 2, 4 warps): best at one row Qwen3-30B-A3B QKV 6.5 us (4/8/1; this
    tile 7.1), Llama-3.1-8B QKV 11.5 (1/8/1; 13.0), gate-up 38.6 (4/8/1; 41.7), down 24.1 (this tile): no
    other tile was within 1 us of the best on all four."""
    if device.type != "cuda":  # the interpreter: several programs and steps, masked edges
        return Fp8GemvConfig(4, 1, 4)
    return Fp8GemvConfig(2, 8 if k >= 8 * KERNEL_K_STEP else max(1, k // KERNEL_K_STEP), 1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
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
    ROW_SCALES: tl.constexpr,
    SHARED_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = x . dequant(w[n]) for BLOCK_N weight rows n and the one row x, fp32 accumulation.

    ROW_SCALES: one scale a weight row, multiplied at the end; SHARED_SCALES: the program's rows lie in one
    row block, so a piece's scale multiplies x's piece; otherwise each row's piece scale multiplies its
    products."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    PIECE: tl.constexpr = 128  # KERNEL_K_STEP
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, PIECE)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn  # [BLOCK_N]
    s_shared = s_ptr + (pid * BLOCK_N // SCALE_BN) * s_sn
    acc = tl.zeros((BLOCK_N, PIECE), dtype=tl.float32)
    for k0 in range(0, K, PIECES * PIECE):
        for p in tl.static_range(PIECES):
            kk = k0 + p * PIECE + offs_k
            k_mask = kk < K
            w = tl.load(w_ptrs + p * PIECE, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            if SHARED_SCALES and not ROW_SCALES:
                x *= tl.load(
                    s_shared + (k0 + p * PIECE) // SCALE_BK * s_sk, mask=k0 + p * PIECE < K, other=0.0
                )
            elif not ROW_SCALES:
                w = w * tl.load(s_rows + (k0 + p * PIECE) // SCALE_BK * s_sk, mask=n_mask, other=0.0)[:, None]
            acc += w * x[None, :]
        w_ptrs += PIECES * PIECE
    out = tl.sum(acc, axis=1)
    if ROW_SCALES:
        out *= tl.load(s_rows, mask=n_mask, other=0.0)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def _gemv(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [1, K] (unit last stride) @ dequant(w).T."""
    k, n = x.shape[1], w.shape[0]
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = fp8_gemv_config(n, k, x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w.weight, w.weight_scale, out, n, k, w.weight.stride(0), s_sn, s_sk,
        SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0, SHARED_SCALES=bn % cfg.block_n == 0,
        BLOCK_N=cfg.block_n, PIECES=cfg.pieces, **pdl_kwargs(x.device), num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


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
    """x [M, K] @ dequant(w).T in x's dtype: the float8 GEMV for one row, the skinny kernel (tensor cores)
    to FP8_WIDE_MAX_M rows, the widened weight through cuBLAS past that (module docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if 1 <= m <= FP8_WIDE_MAX_M and w.weight.stride(-1) == 1:
        if m == 1:
            return _gemv(x, w)
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
    """``add_rms_norm_linear`` over a float8 weight: the norm kernel, then ``fp8_linear_triton``."""
    if residual is None:
        h, summed = rms_norm_triton(x, norm_weight, eps), x
    else:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
    return fp8_linear_triton(h, w), (h if need_normed else None), summed
