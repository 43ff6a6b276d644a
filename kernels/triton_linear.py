"""Linear projection for decode-sized batches: Triton versions of ``kernels/linear.py``.

At batch 1 a projection is a GEMV that must stream its whole weight from HBM once; cuBLAS reaches about
2.7 TB/s on the small projections of Qwen3-30B-A3B (QKV 5120 x 2048 in 7.8 us, o-proj plus its split-K
reduce 8.8 us, router 5 us on an H200). For ``M <= SMALL_M`` rows both ops here are one GEMV launch:

- ``_gemv_kernel``: grid over N tiles. Each program streams ``BLOCK_N`` rows of ``w`` in ``BLOCK_K``
  chunks and multiplies each chunk with all M rows of the input (fp32 accumulation), so every weight
  element is loaded exactly once.
- With ``FUSE_NORM`` the input rows are ``rms_norm(x + residual)``, computed in the same launch: each
  program first sums the squares of its M rows (M x K is tiny, so every program recomputing it costs L2
  reads, not HBM), then forms each normed chunk as it needs it, rounding as ``kernels/norm.py`` does.
  Program 0 also stores ``normed`` and ``x + residual``. This replaces the add + RMSNorm launch in front of
  the projection.

Larger M falls back to cuBLAS (``x @ w.t()``, behind the Triton add + RMSNorm for ``norm_linear``), which
is good at them. No host synchronisation: sizes come from shapes, so both ops can sit in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

# Up to this many rows the GEMV kernel runs; it reads the weight once whatever M is, and its per-row work
# (one cross-lane reduction per row and K chunk) is still far below the HBM time at 8 rows. Decode
# batches of a small server sit here; past it cuBLAS's tensor-core GEMMs are the better choice.
SMALL_M = 8


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """Block sizes of the GEMV kernel, by the shape of ``w`` ([n, k]).

    The kernel is bound by HBM bandwidth, so what matters is bytes in flight with every SM busy (an H200
    needs ~3 MB outstanding over its 132 SMs). BLOCK_N is the largest of 16, 8, 4 rows that still gives
    about 2 programs per SM at batch 1 (QKV 5120: 16 rows, 320 programs; o-proj 2048: 8 rows, 256; router
    128: 4 rows, 32, which is latency-bound whatever the tile). BLOCK_K keeps one step's tile at 4096
    elements (8 KB of bf16, 32 elements per thread at 4 warps): 256 for 16 rows, 512 below; a warp then
    reads at least 512 contiguous bytes of a row. Not yet swept on the GPU: ``benchmarks/kernel_bench.py``
    times these against cuBLAS, and a sweep changes only this function.
    """
    if device.type != "cuda":
        return LinearConfig(16, 32, 4, 1)  # the interpreter: tiny shapes, several K steps, masked edges
    sms = _num_sms(device)
    block_n = 4
    for candidate in (16, 8):
        if triton.cdiv(n, candidate) >= 1.9 * sms:
            block_n = candidate
            break
    return LinearConfig(block_n, 256 if block_n == 16 else 512, 4, 3)


@triton.jit
def _gemv_input_chunk(
    x_ptr,
    res_ptr,
    normed_ptr,
    sum_ptr,
    row,
    offs_k,
    k_mask,
    inv_rms,
    norm_w,
    stride_xm,
    stride_rm,
    stride_nm,
    stride_sm,
    store,
    FUSE_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One K chunk of one input row in fp32: x itself, or rms_norm(x + residual) rounded as the reference
    rounds it (the sum and the normalised row to their dtype, then times the norm weight). Stores the
    normed chunk (and the sum) where ``store``."""
    xf = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if FUSE_NORM:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            summed = (xf + r).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sm + offs_k, summed, mask=k_mask & store)
            xf = summed.to(tl.float32)
            in_dtype = sum_ptr.dtype.element_ty
        else:
            in_dtype = x_ptr.dtype.element_ty
        normed = (norm_w * (xf * inv_rms).to(in_dtype).to(tl.float32)).to(normed_ptr.dtype.element_ty)
        tl.store(normed_ptr + row * stride_nm + offs_k, normed, mask=k_mask & store)
        xf = normed.to(tl.float32)
    return xf


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    normed_ptr,
    sum_ptr,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_nm,
    stride_sm,
    eps,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """out[m, n] = input[m] . w[n] for all M rows m and BLOCK_N rows n, fp32 accumulation."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    # Input chunks are [BLOCK_K] for one row and [1, BLOCK_K] for several. Compiled for sm_90, one row's
    # lane accumulator then keeps the weight tile's layout (only the 512-byte x chunk is shuffled through
    # shared memory), and several rows' reduced chunks need no shuffle at all; the other way round, the
    # compiler moves the whole weight tile through shared memory, or every row's x chunk.
    if M == 1:
        offs_in = offs_k
    else:
        offs_in = offs_k[None, :]
    store = (offs_in * 0 + pid) == 0  # program 0 writes normed and the residual sum

    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if FUSE_NORM:
        # The sum of squares of each (summed, rounded) row; every program computes it.
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = (rows < M)[:, None] & (offs_k < K - k0)[None, :]
            v = tl.load(x_ptr + rows[:, None] * stride_xm + k0 + offs_k[None, :], mask=mask, other=0.0)
            v = v.to(tl.float32)
            if HAS_RESIDUAL:
                r_ptrs = res_ptr + rows[:, None] * stride_rm + k0 + offs_k[None, :]
                r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
                v = (v + r).to(sum_ptr.dtype.element_ty).to(tl.float32)
            sum_sq += tl.sum(v * v, axis=1)
        inv_rms = tl.rsqrt(sum_sq / K + eps)

    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    # One row: per-lane partial sums, one cross-lane reduction at the end. Several rows: M lane tiles
    # would not fit in registers, so each row's chunk is reduced as it is computed. The accumulator is
    # [BLOCK_N, BLOCK_M], so a reduced chunk ([BLOCK_N], in the weight tile's row layout) adds in place.
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_mask = n_mask[:, None] & (offs_k < K - k0)[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        in_mask = offs_in < K - k0
        norm_w = (offs_in * 0).to(tl.float32)
        if FUSE_NORM:
            norm_w = tl.load(norm_w_ptr + k0 + offs_in, mask=in_mask, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            inv_m = tl.sum(tl.where(rows == m, inv_rms, 0.0), axis=0)
            xk = _gemv_input_chunk(
                x_ptr, res_ptr, normed_ptr, sum_ptr, m, k0 + offs_in, in_mask, inv_m, norm_w,
                stride_xm, stride_rm, stride_nm, stride_sm, store,
                FUSE_NORM=FUSE_NORM, HAS_RESIDUAL=HAS_RESIDUAL,
            )  # fmt: skip
            if M == 1:
                lanes += w * xk[None, :]
            else:
                acc += tl.where(rows[None, :] == m, tl.sum(w * xk, axis=1)[:, None], 0.0)
        w_ptrs += BLOCK_K
    if M == 1:
        acc = tl.sum(lanes, axis=1)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (rows < M)[None, :])


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_shapes(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if w.stride(-1) != 1:
        raise ValueError("linear needs w contiguous in its last dimension (copying it would cost a read)")


def _launch_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    w: torch.Tensor,
    out: torch.Tensor,
    normed: torch.Tensor | None,
    summed: torch.Tensor | None,
) -> None:
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    cfg = linear_config(n, k, x.device)
    res = residual if residual is not None else x
    normed_t = normed if normed is not None else out
    summed_t = summed if summed is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, res, norm_weight if norm_weight is not None else x, w, out, normed_t, summed_t,
        n, k, x.stride(0), res.stride(0), w.stride(0), out.stride(0), normed_t.stride(0), summed_t.stride(0),
        eps,
        M=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FUSE_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def linear_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (rows may be strided); w: [N, K], contiguous last dim -> x @ w.T, [M, N] in x's dtype.

    One GEMV launch for ``M <= SMALL_M``; cuBLAS above.
    """
    _check_shapes(x, w)
    if x.shape[0] > SMALL_M:
        return x @ w.t()
    x = _last_dim_contiguous(x)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _launch_gemv(x, None, None, 0.0, w, out, None, None)
    return out


def norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (normed @ w.T, normed, residual) as ``norm_linear_torch`` does: normed = rms_norm(x +
    residual) (of x alone when ``residual`` is None, and x is then the returned residual).

    One launch for ``M <= SMALL_M``; the Triton add + RMSNorm and cuBLAS above.
    """
    _check_shapes(x, w)
    if x.shape[0] > SMALL_M:
        if residual is None:
            normed, residual = rms_norm_triton(x, norm_weight, eps), x
        else:
            normed, residual = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
        return normed @ w.t(), normed, residual
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [K] = [{x.shape[1]}]")
    x2, norm_weight = _last_dim_contiguous(x), norm_weight.contiguous()
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    normed_dtype = torch.promote_types(norm_weight.dtype, in_dtype)
    normed = torch.empty(x.shape, dtype=normed_dtype, device=x.device)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=normed_dtype, device=x.device)
    if residual is None:
        _launch_gemv(x2, None, norm_weight, eps, w, out, normed, None)
        return out, normed, x
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    summed = torch.empty(x.shape, dtype=in_dtype, device=x.device)
    _launch_gemv(x2, _last_dim_contiguous(residual), norm_weight, eps, w, out, normed, summed)
    return out, normed, summed
