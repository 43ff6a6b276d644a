"""Linear projections over weights kept in float8 (``kernels.fp8_weight.Fp8Weight``): the Triton side of
``linear`` and ``add_rms_norm_linear`` when the weight is one.

At decode sizes a projection streams its whole weight from HBM, so a float8 weight moves half the bytes
of a 16-bit one. The kernels follow their 16-bit counterparts in ``kernels/triton_linear.py``:

- one row: ``_fp8_gemv_kernel`` (GEMV; the input norm fused in, ``FUSE_NORM``, as ``_norm_gemv_kernel``
  does): each program streams ``BLOCK_N`` weight rows in steps of ``KERNEL_K_STEP``-long pieces, tiles
  [BLOCK_N, pieces, KERNEL_K_STEP], so every piece lies in one scale block and takes one scale;
- 2 to ``SKINNY_MAX_M`` rows: ``_fp8_skinny_kernel``, tensor cores: the float8 tile widened to the
  activations' dtype (exact: every float8 value is a bfloat16 and a float16 value), one MMA a K step, its
  fp32 result times the step's scales;
- more rows (prefill): ``_fp8_dequant_kernel`` widens the weight into a scratch tensor of the model's
  dtype, which cuBLAS multiplies (compute-bound, where reading the weight twice costs little).

Scales multiply float32 partial sums (module docstring of ``kernels/fp8_weight.py``): one-row-scale
layouts once at the end, block layouts once a piece.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_weight import KERNEL_K_STEP, Fp8Weight, scale_args
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait
from kernels.triton_linear import NORM_GEMV_MAX_K, SKINNY_BLOCK_M, SKINNY_MAX_M, LinearConfig
from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton


def fp8_gemv_config(n: int, k: int, device: torch.device, fuse_norm: bool) -> LinearConfig:
    """Tile of ``_fp8_gemv_kernel``: ``block_k`` = pieces x KERNEL_K_STEP per step (the whole row where
    the norm is fused). The 16-bit GEMV's bytes a step: rows of 4096 and longer one row in 1024-element
    steps, shorter rows two rows in whole-row steps (a float8 step of the same bytes is twice as long)."""
    whole = triton.cdiv(k, KERNEL_K_STEP) * KERNEL_K_STEP
    whole = max(KERNEL_K_STEP, triton.next_power_of_2(whole))
    if device.type != "cuda":  # the interpreter: several programs, masked edges
        return LinearConfig(4, whole if fuse_norm else KERNEL_K_STEP * 2, 4, 1)
    if fuse_norm:
        return LinearConfig(4 if k <= 2048 else 2, whole, 8 if k <= 2048 else max(4, whole // 1024), 1)
    if k >= 4096:
        return LinearConfig(1, 1024, 4, 4)
    return LinearConfig(2, min(whole, 2048), 4, 4)


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
    N,
    K,
    stride_wn,
    s_sn,
    s_sk,
    eps,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    PIECE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = x . dequant(w[n]) for BLOCK_N rows n, fp32 accumulation. With FUSE_NORM, x is first
    rms_norm(x + res) * g (one step covers the row; program 0 writes x + res, and the normalised row where
    WRITE_NORMED), with ``_norm_gemv_kernel``'s roundings. ROW_SCALES: one scale a row (multiplied once, at
    the end); otherwise each [BLOCK_N, PIECE] piece takes its block's scale."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, PIECES)[:, None] * PIECE + tl.arange(0, PIECE)[None, :]  # [PIECES, PIECE]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn + offs_k[None, :, :]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn  # [BLOCK_N]
    if FUSE_NORM:
        k_mask = offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0)  # in flight first
        first = offs_k < tl.where(pid == 0, K, 0)  # program 0 writes the row outputs
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            summed = (x + r).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + offs_k, summed, mask=first)
            s = summed.to(tl.float32)
            in_dtype = sum_ptr.dtype.element_ty
        else:
            s = x
            in_dtype = x_ptr.dtype.element_ty
        inv_rms = tl.rsqrt(tl.sum(tl.sum(s * s, axis=1), axis=0) / K + eps)
        h = (g * (s * inv_rms).to(in_dtype).to(tl.float32)).to(normed_ptr.dtype.element_ty)
        if WRITE_NORMED:
            tl.store(normed_ptr + offs_k, h, mask=first)
        prod = w.to(tl.float32) * h.to(tl.float32)[None, :, :]
        if ROW_SCALES:
            out = tl.sum(tl.sum(prod, axis=2), axis=1) * tl.load(s_rows, mask=n_mask, other=0.0)
        else:
            scales = tl.load(
                s_rows[:, None] + (tl.arange(0, PIECES) * PIECE // SCALE_BK)[None, :] * s_sk,
                mask=n_mask[:, None] & (tl.arange(0, PIECES) * PIECE < K)[None, :],
                other=0.0,
            )
            out = tl.sum(tl.sum(prod, axis=2) * scales, axis=1)
    else:
        lanes = tl.zeros((BLOCK_N, PIECES, PIECE), dtype=tl.float32)
        for k0 in range(0, K, PIECES * PIECE):
            k_mask = offs_k < K - k0
            w = tl.load(w_ptrs, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0).to(tl.float32)
            xk = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if ROW_SCALES:
                lanes += w * xk[None, :, :]
            else:
                pieces = (k0 + tl.arange(0, PIECES) * PIECE) // SCALE_BK
                scales = tl.load(
                    s_rows[:, None] + pieces[None, :] * s_sk,
                    mask=n_mask[:, None] & (k0 + tl.arange(0, PIECES) * PIECE < K)[None, :],
                    other=0.0,
                )
                lanes += w * xk[None, :, :] * scales[:, :, None]
            w_ptrs += PIECES * PIECE
        out = tl.sum(tl.sum(lanes, axis=2), axis=1)
        if ROW_SCALES:
            out = out * tl.load(s_rows, mask=n_mask, other=0.0)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def _gemv(
    x: torch.Tensor,
    w: Fp8Weight,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    need_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One row: (x @ dequant(w).T, the normalised row where asked, x + residual) with the norm fused where
    ``norm_weight`` is given."""
    (n, k), fuse = w.shape, norm_weight is not None
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if need_normed else out  # `out` only lends its dtype when nothing is written
    cfg = fp8_gemv_config(n, k, x.device, fuse)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, residual if residual is not None else x, norm_weight if fuse else x, w.weight, w.weight_scale,
        out, summed, normed, n, k, w.weight.stride(0), s_sn, s_sk, eps,
        SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0, FUSE_NORM=fuse, HAS_RESIDUAL=residual is not None,
        WRITE_NORMED=need_normed, BLOCK_N=cfg.block_n, PIECES=cfg.block_k // KERNEL_K_STEP, PIECE=KERNEL_K_STEP,
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, (normed if need_normed else None), summed


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    s_sn,
    s_sk,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = x[m] . dequant(w[n]) for BLOCK_M rows m and BLOCK_N weight rows n (out.T = w @ x.T on
    tensor cores, as ``_skinny_kernel``); each K step's MMA result times that step's scales."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        scale = tl.load(s_rows + (k0 // SCALE_BK) * s_sk, mask=n_mask, other=0.0)
        part = tl.dot(w.to(xt.dtype), xt, input_precision=DOT_PRECISION)
        acc += part * scale[:, None]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _skinny(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = 64 if x.device.type == "cuda" else 16
    block_k = KERNEL_K_STEP if x.device.type == "cuda" else 32  # the interpreter: several K steps
    if s_sk and bk % block_k:
        raise ValueError(f"scale blocks of {bk} along K do not hold whole {block_k}-long steps")
    grid = (triton.cdiv(m, SKINNY_BLOCK_M) * triton.cdiv(n, block_n),)
    _fp8_skinny_kernel[grid](
        x, w.weight, w.weight_scale, out, m, n, k, x.stride(0), w.weight.stride(0), out.stride(0), s_sn, s_sk,
        SCALE_BN=bn, SCALE_BK=bk, BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), **pdl_kwargs(x.device), num_warps=4, num_stages=4,
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
    """x [M, K] @ dequant(w).T in x's dtype: the GEMV for one row, the skinny kernel for 2 to
    SKINNY_MAX_M rows, the widened weight through cuBLAS past that."""
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 1:
        return _gemv(x, w)[0]
    if m <= SKINNY_MAX_M:
        return _skinny(x, w)
    return x @ dequantize_triton(w).t()


def fp8_add_rms_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: Fp8Weight,
    need_normed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm_linear`` over a float8 weight: one fused launch for one plain row of at most
    NORM_GEMV_MAX_K, else the norm kernel and ``fp8_linear_triton``."""
    plain = (
        x.stride(-1) == 1
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        and norm_weight.dtype == x.dtype
    )
    if plain and x.shape[0] == 1 and x.shape[1] <= NORM_GEMV_MAX_K:
        return _gemv(x, w, residual, norm_weight, eps, need_normed)
    if residual is None:
        h, summed = rms_norm_triton(x, norm_weight, eps), x
    else:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
    return fp8_linear_triton(h, w), (h if need_normed else None), summed
