"""Linear projection of one row (decode batch 1): the Triton version of ``kernels/linear.py``.

At batch 1 a projection is a GEMV that streams its whole weight from HBM once. ``_gemv_kernel`` with one
or two weight rows per program beats cuBLAS on every decode projection of the benchmark models: on an
H200 (``benchmarks/kernel_bench.py --sweep-linear``, 2026-11-29, back-to-back in a CUDA graph with
programmatic dependent launch) Llama-3.1-8B QKV 14.0 against 16.6 us, o-proj 10.0 / 13.5, gate-up
56.3 / 59.6, down (14336-long rows) 30.0 / 32.7, LM head 235.8 / 251.9; Qwen3-30B-A3B QKV 7.0 / 8.4,
o-proj 6.0 / 9.7, router 1.4 / 4.9, LM head 145.2 / 153.2. Many small programs keep enough loads in
flight on every SM, where cuBLAS splits K and reduces in a second kernel. With several rows cuBLAS's
tensor-core kernels win by far (4 rows: the GEMV is 0.1-0.3x as fast), so ``use_gemv`` takes the GEMV for
one row only. One launch per projection also keeps the layer's kernels in one chain of programmatic
dependent launches (``kernels.triton_device``), which a cuBLAS kernel would break.

``_gemv_kernel``: grid over N tiles; each program streams ``BLOCK_N`` rows of ``w`` in ``BLOCK_K`` chunks
against the input row, keeps per-lane fp32 partial sums and reduces them once at the end. No host
synchronisation: the choice and the sizes come from shapes, so it sits in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, pdl_wait


def use_gemv(m: int, n: int, k: int) -> bool:
    """Whether ``linear_triton`` runs the GEMV kernel for x [m, k] @ w[n, k].T (see the module docstring)."""
    return m == 1 and n > 0 and k > 0


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


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


def linear_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K], contiguous last dim -> x @ w.T, [M, N] in x's dtype. One GEMV launch where
    ``use_gemv`` says so, cuBLAS otherwise."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    (m, k), n = x.shape, w.shape[0]
    if not use_gemv(m, n, k) or w.stride(-1) != 1:
        return x @ w.t()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = linear_config(n, k, x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, out, n, k, w.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **pdl_kwargs(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
