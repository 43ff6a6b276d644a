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
from kernels.triton_fp8 import fp8_byte_to_f32, fp8_word_factor, fp8_word_shift
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
    half_factor,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    SHARED_SCALES: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PIECES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = x . dequant(w[n]) for BLOCK_N rows n, fp32 accumulation, over w read as 32-bit words of
    four float8 values (``stride_wn`` in words; ``kernels/triton_fp8.py``): a step is [BLOCK_N, PIECES, 32]
    words, each piece of 32 words (KERNEL_K_STEP values) in one scale block; byte J of word i multiplies
    x[4 i + J]. The float8 values come out times 2**-(bias difference); x is multiplied by ``half_factor``
    (the square root of the restoring factor) and by the step's scales where the program's rows share
    them (SHARED_SCALES), the sums by ``half_factor`` at the end, so products stay normal floats.

    FUSE_NORM: x is first rms_norm(x + res) * g (one step covers the row; program 0 writes x + res, and the
    normalised row where WRITE_NORMED), with ``_norm_gemv_kernel``'s roundings. ROW_SCALES: one scale a row,
    multiplied at the end; otherwise each piece takes its block's scale, times x (SHARED_SCALES) or times
    the piece's products."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    WORDS: tl.constexpr = 32  # words a piece
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, PIECES)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [PIECES, WORDS]
    offs_x = tl.arange(0, PIECES)[:, None] * (4 * WORDS) + tl.arange(0, WORDS)[None, :]  # byte 0's values
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn + offs_w[None, :, :]
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn  # [BLOCK_N]
    s_shared = s_ptr + (pid * BLOCK_N // SCALE_BN) * s_sn  # the program's row block, where SHARED_SCALES
    piece_k = tl.arange(0, PIECES) * (4 * WORDS)  # each piece's first value in a step
    lanes = tl.zeros((BLOCK_N, PIECES, WORDS), dtype=tl.float32)
    for k0 in range(0, K, PIECES * 4 * WORDS):
        w_mask = n_mask[:, None, None] & (offs_w < (K - k0) // 4)[None, :, :]
        words = tl.load(w_ptrs, mask=w_mask, other=0)  # in flight before the norm's reductions
        if FUSE_NORM:  # one step: the whole row
            x0, x1, x2, x3 = _norm_row(
                x_ptr, res_ptr, g_ptr, sum_ptr, normed_ptr, offs_x, K, eps, pid == 0, HAS_RESIDUAL, WRITE_NORMED,
            )  # fmt: skip
        else:
            x0 = tl.load(x_ptr + k0 + offs_x, mask=offs_x < K - k0, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + k0 + offs_x + WORDS, mask=offs_x + WORDS < K - k0, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + k0 + offs_x + 2 * WORDS, mask=offs_x + 2 * WORDS < K - k0, other=0.0).to(
                tl.float32
            )
            x3 = tl.load(x_ptr + k0 + offs_x + 3 * WORDS, mask=offs_x + 3 * WORDS < K - k0, other=0.0).to(
                tl.float32
            )
        if SHARED_SCALES and not ROW_SCALES:
            shared = tl.load(s_shared + (k0 + piece_k) // SCALE_BK * s_sk, mask=piece_k < K - k0, other=0.0)
            xscale = half_factor * shared[:, None]
        else:
            xscale = half_factor
        prod = fp8_byte_to_f32(words, 0, SHIFT) * (x0 * xscale)[None, :, :]
        prod += fp8_byte_to_f32(words, 1, SHIFT) * (x1 * xscale)[None, :, :]
        prod += fp8_byte_to_f32(words, 2, SHIFT) * (x2 * xscale)[None, :, :]
        prod += fp8_byte_to_f32(words, 3, SHIFT) * (x3 * xscale)[None, :, :]
        if not ROW_SCALES and not SHARED_SCALES:  # rows of several scale blocks: a scale per row and piece
            piece_scales = tl.load(
                s_rows[:, None] + ((k0 + piece_k) // SCALE_BK * s_sk)[None, :],
                mask=n_mask[:, None] & (piece_k < K - k0)[None, :],
                other=0.0,
            )
            prod = prod * piece_scales[:, :, None]
        lanes += prod
        w_ptrs += PIECES * WORDS
    out = tl.sum(tl.sum(lanes, axis=2), axis=1) * half_factor
    if ROW_SCALES:
        out = out * tl.load(s_rows, mask=n_mask, other=0.0)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _norm_row(x_ptr, res_ptr, g_ptr, sum_ptr, normed_ptr, offs, K, eps, WRITES, HAS_RESIDUAL: tl.constexpr,
              WRITE_NORMED: tl.constexpr):  # fmt: skip
    """The normalised row h = rms_norm(x + res) * g as four float32 tiles, h[offs + 32 J] (J = 0..3), with
    ``_norm_gemv_kernel``'s roundings; where WRITES, stores x + res (and h where WRITE_NORMED)."""
    if HAS_RESIDUAL:
        in_dtype = sum_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty
    s0 = _summed(x_ptr, res_ptr, sum_ptr, offs, K, WRITES, HAS_RESIDUAL)
    s1 = _summed(x_ptr, res_ptr, sum_ptr, offs + 32, K, WRITES, HAS_RESIDUAL)
    s2 = _summed(x_ptr, res_ptr, sum_ptr, offs + 64, K, WRITES, HAS_RESIDUAL)
    s3 = _summed(x_ptr, res_ptr, sum_ptr, offs + 96, K, WRITES, HAS_RESIDUAL)
    squares = s0 * s0 + s1 * s1 + s2 * s2 + s3 * s3
    inv_rms = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
    h0 = _normed(g_ptr, normed_ptr, s0, inv_rms, offs, K, WRITES, in_dtype, WRITE_NORMED)
    h1 = _normed(g_ptr, normed_ptr, s1, inv_rms, offs + 32, K, WRITES, in_dtype, WRITE_NORMED)
    h2 = _normed(g_ptr, normed_ptr, s2, inv_rms, offs + 64, K, WRITES, in_dtype, WRITE_NORMED)
    h3 = _normed(g_ptr, normed_ptr, s3, inv_rms, offs + 96, K, WRITES, in_dtype, WRITE_NORMED)
    return h0, h1, h2, h3


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
def _normed(
    g_ptr, normed_ptr, s, inv_rms, offs, K, WRITES, in_dtype: tl.constexpr, WRITE_NORMED: tl.constexpr
):
    """g * rms-normalised s at ``offs`` (stored where WRITES and WRITE_NORMED), as float32."""
    mask = offs < K
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (g * (s * inv_rms).to(in_dtype).to(tl.float32)).to(normed_ptr.dtype.element_ty)
    if WRITE_NORMED:
        tl.store(normed_ptr + offs, h, mask=offs < tl.where(WRITES, K, 0))
    return h.to(tl.float32)


def _words(w: Fp8Weight) -> torch.Tensor | None:
    """An interleaved weight's values as int32 words of four (None for a weight in its values' order,
    which the word kernels do not read)."""
    v = w.weight
    if not w.interleaved or v.stride(-2) % 4 or v.stride(-1) != 1 or v.data_ptr() % 4:
        return None
    return v.view(torch.int32)


def _gemv(
    x: torch.Tensor,
    w: Fp8Weight,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    need_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """One row: (x @ dequant(w).T, the normalised row where asked, x + residual) with the norm fused where
    ``norm_weight`` is given; None where the weight's rows are not whole 32-bit words."""
    words = _words(w)
    if words is None:
        return None
    (n, k), fuse = w.shape, norm_weight is not None
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if need_normed else out  # `out` only lends its dtype when nothing is written
    cfg = fp8_gemv_config(n, k, x.device, fuse)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, residual if residual is not None else x, norm_weight if fuse else x, words, w.weight_scale,
        out, summed, normed, n, k, words.stride(0), s_sn, s_sk, eps, fp8_word_factor(w.weight.dtype) ** 0.5,
        SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0, SHARED_SCALES=bn % cfg.block_n == 0,
        FUSE_NORM=fuse, HAS_RESIDUAL=residual is not None, WRITE_NORMED=need_normed,
        SHIFT=fp8_word_shift(w.weight.dtype), BLOCK_N=cfg.block_n, PIECES=cfg.block_k // KERNEL_K_STEP,
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
    factor,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = x[m] . dequant(w[n]) for BLOCK_M rows m and BLOCK_N weight rows n (out.T = w @ x.T on
    tensor cores, as ``_skinny_kernel``), over w read as 32-bit words (``_fp8_gemv_kernel``). A K step is
    one piece of KERNEL_K_STEP values; byte J of its words and x's values 4 i + J make one MMA of K 32, the
    four summed. The widened values times ``factor`` (a power of two) are the float8 values exactly, in x's
    dtype (every float8 value is a bfloat16 and a float16 value); the sums are multiplied by the scales once
    at the end with ROW_SCALES, else each step's sums by its scales."""
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    WORDS: tl.constexpr = 32
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_w[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_w[:, None]  # [WORDS, BLOCK_M]: byte 0
    s_rows = s_ptr + (offs_n // SCALE_BN) * s_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, 4 * WORDS):
        words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
        xm = m_mask[None, :]
        x0 = tl.load(x_ptrs, mask=xm, other=0.0)  # K is whole pieces (interleaved weights)
        x1 = tl.load(x_ptrs + WORDS, mask=xm, other=0.0)
        x2 = tl.load(x_ptrs + 2 * WORDS, mask=xm, other=0.0)
        x3 = tl.load(x_ptrs + 3 * WORDS, mask=xm, other=0.0)
        dt = x0.dtype
        if ROW_SCALES:
            part = acc
        else:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        part = tl.dot((fp8_byte_to_f32(words, 0, SHIFT) * factor).to(dt), x0, part,
                      input_precision=DOT_PRECISION)  # fmt: skip
        part = tl.dot((fp8_byte_to_f32(words, 1, SHIFT) * factor).to(dt), x1, part,
                      input_precision=DOT_PRECISION)  # fmt: skip
        part = tl.dot((fp8_byte_to_f32(words, 2, SHIFT) * factor).to(dt), x2, part,
                      input_precision=DOT_PRECISION)  # fmt: skip
        part = tl.dot((fp8_byte_to_f32(words, 3, SHIFT) * factor).to(dt), x3, part,
                      input_precision=DOT_PRECISION)  # fmt: skip
        if ROW_SCALES:
            acc = part
        else:
            acc += part * tl.load(s_rows + (k0 // SCALE_BK) * s_sk, mask=n_mask, other=0.0)[:, None]
        w_ptrs += WORDS
        x_ptrs += 4 * WORDS
    if ROW_SCALES:
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _skinny(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor | None:
    """2 to SKINNY_MAX_M rows; None where the weight's rows are not whole 32-bit words."""
    words = _words(w)
    if words is None:
        return None
    (m, k), n = x.shape, w.shape[0]
    _, s_sn, s_sk, bn, bk = scale_args(w)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = 64 if x.device.type == "cuda" else 16
    grid = (triton.cdiv(m, SKINNY_BLOCK_M) * triton.cdiv(n, block_n),)
    _fp8_skinny_kernel[grid](
        x, words, w.weight_scale, out, m, n, k, x.stride(0), words.stride(0), out.stride(0), s_sn, s_sk,
        fp8_word_factor(w.weight.dtype),
        SCALE_BN=bn, SCALE_BK=bk, ROW_SCALES=s_sk == 0, SHIFT=fp8_word_shift(w.weight.dtype),
        BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=block_n, DOT_PRECISION=dot_precision(x.dtype),
        **pdl_kwargs(x.device), num_warps=4, num_stages=4,
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
    INTERLEAVED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n, k] = w[n, k] x its scale, rounded once to out's dtype (``Fp8Weight.dequantize``); value k of
    an INTERLEAVED row at its byte in the piece, 4 (k % 32) + k % KERNEL_K_STEP // 32."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    if INTERLEAVED:
        at = offs_k // 128 * 128 + 4 * (offs_k % 32) + offs_k % 128 // 32  # 128: KERNEL_K_STEP
    else:
        at = offs_k
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + at[None, :], mask=mask, other=0.0)
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
        SCALE_BN=bn, SCALE_BK=bk, INTERLEAVED=w.interleaved, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def fp8_linear_triton(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ dequant(w).T in x's dtype: the GEMV for one row, the skinny kernel for 2 to
    SKINNY_MAX_M rows, the widened weight through cuBLAS past that."""
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 1 and (done := _gemv(x, w)) is not None:
        return done[0]
    if 1 <= m <= SKINNY_MAX_M and (done := _skinny(x, w)) is not None:
        return done
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
        done = _gemv(x, w, residual, norm_weight, eps, need_normed)
        if done is not None:
            return done
    if residual is None:
        h, summed = rms_norm_triton(x, norm_weight, eps), x
    else:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
    return fp8_linear_triton(h, w), (h if need_normed else None), summed
