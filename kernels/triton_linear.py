"""Linear projection of one row (decode batch 1): the Triton version of ``kernels/linear.py``.

At batch 1 a projection is a GEMV that streams its whole weight from HBM once. cuBLAS is at the copy rate
on large weights but slow on some small ones: on an H200 (``benchmarks/kernel_bench.py``, 2026-11-29) the
Qwen3-30B-A3B o-proj (2048 x 4096) takes 9.5 us with its split-K reduce and the MoE router (128 x 2048)
4.8 us, where ``_gemv_kernel`` takes 8.1 and 2.3 us; the LM heads (151936 x 2048) 153 against 145 us.
Elsewhere cuBLAS is as fast (QKV 5120 x 2048: 8.3 against 8.7 us; 6144 x 4096 and 28672 x 4096: equal)
or faster (14336-long rows: 32.9 against 43.6 us, where the GEMV's few programs run long K loops), and
with several rows its tensor-core kernels win by far (4 rows: 0.1-0.3x). So ``use_gemv`` takes the
GEMV for one row, rows of at most 4096, and weights of at most 2048 rows or at least 65536 (LM heads).

``_gemv_kernel``: grid over N tiles; each program streams ``BLOCK_N`` rows of ``w`` in ``BLOCK_K`` chunks
against the input row, keeps per-lane fp32 partial sums and reduces them once at the end. No host
synchronisation: the choice and the sizes come from shapes, so it sits in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, sm_count

GEMV_MAX_K = 4096
GEMV_MAX_SMALL_N = 2048
GEMV_MIN_LARGE_N = 65536


def use_gemv(m: int, n: int, k: int) -> bool:
    """Whether ``linear_triton`` runs the GEMV kernel for x [m, k] @ w[n, k].T (see the module docstring)."""
    return m == 1 and k <= GEMV_MAX_K and (n <= GEMV_MAX_SMALL_N or n >= GEMV_MIN_LARGE_N)


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def linear_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """Block sizes by the shape of ``w`` ([n, k]): bytes in flight with every SM busy. BLOCK_N is the
    largest of 16, 8, 4 rows that still gives about 2 programs per SM (o-proj 2048: 8 rows, 256 programs;
    router 128: 4 rows, 32, latency-bound whatever the tile); BLOCK_K keeps a step's tile at 4096 elements
    (8 KB of bf16). ``kernel_bench.py --sweep`` times variants."""
    if device.type != "cuda":
        return LinearConfig(16, 32, 4, 1)  # the interpreter: tiny shapes, several K steps, masked edges
    sms = sm_count(device)
    block_n = 4
    for candidate in (16, 8):
        if triton.cdiv(n, candidate) >= 1.9 * sms:
            block_n = candidate
            break
    return LinearConfig(block_n, 256 if block_n == 16 else 512, 4, 3)


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
    if USE_PDL:  # programmatic dependent launch: the previous kernel's writes are visible after this
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
