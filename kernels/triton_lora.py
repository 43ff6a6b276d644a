"""LoRA over stacked adapter slots in two kernels, for passes of up to ``MAX_ROWS`` rows (decode steps):
the semantics of ``kernels/lora.py``. Larger passes take the reference (its two cuBLAS GEMMs are what such
shapes want).

1. Shrink, split over K: program (n block, k split, row block) writes the partial products of its rows
   with its slice of ``a``'s rows, fp32, into ``partial [SPLITS, T, N]``: a skinny GEMM whose N (slots x
   rank) is far too small to keep the GPU's loads in flight without splitting K.
2. Expand and add, in place: program (m block, row block) sums its rows' partials over the splits, masks
   each column by its row's slot (``row_slots[row, column // W]``), rounds to ``x``'s dtype (as the
   reference's shrink output is), and adds ``t @ b[m block]^T`` into ``y``.

The reference's mask is a kernel of its own; here it is folded into the expand, and each launch is sized
for rows this few (one-row tiles pad to 16 for ``tl.dot``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora import lora_apply_torch
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait

MAX_ROWS = 256  # passes with more rows take the reference
# The Triton backend's choice (``lora_apply_small``): up to this many rows the two kernels beat the reference's
# cuBLAS GEMMs on an H100 (6% of decode tok/s at 1 row, 2% at 16; 5% slower at 64: performance.md).
FASTER_UP_TO = 16
BLOCK_T = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, partial_ptr, T, N, K, K_PER_SPLIT,
    stride_x, stride_a, stride_ps, stride_pt,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid_n, split, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * K_PER_SPLIT
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < tl.minimum(k_begin + K_PER_SPLIT, K)
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                     mask=(rows[:, None] < T) & kmask[None, :], other=0.0)  # fmt: skip
        at = tl.load(a_ptr + cols[:, None].to(tl.int64) * stride_a + ks[None, :],
                     mask=(cols[:, None] < N) & kmask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
    out = partial_ptr + split * stride_ps + rows[:, None] * stride_pt + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < T) & (cols[None, :] < N))


@triton.jit
def _lora_expand_kernel(
    partial_ptr, slots_ptr, b_ptr, y_ptr, T, N, M, W, SPLITS, S,
    stride_ps, stride_pt, stride_slots, stride_b, stride_y,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid_m, pid_t = tl.program_id(0), tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_N)
    tn_mask = (rows[:, None] < T) & (cols[None, :] < N)
    t = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for split in range(0, SPLITS):
        t += tl.load(partial_ptr + split * stride_ps + rows[:, None] * stride_pt + cols[None, :], mask=tn_mask,
                     other=0.0)  # fmt: skip
    slot = cols // W
    onehot = tl.load(slots_ptr + rows[:, None] * stride_slots + slot[None, :],
                     mask=tn_mask & (slot[None, :] < S), other=0.0)  # fmt: skip
    t = (t * onehot.to(tl.float32)).to(y_ptr.dtype.element_ty)  # rounded as the reference's shrink output
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    bt = tl.load(b_ptr + ms[:, None].to(tl.int64) * stride_b + cols[None, :],
                 mask=(ms[:, None] < M) & (cols[None, :] < N), other=0.0)  # fmt: skip
    delta = tl.dot(t, tl.trans(bt), input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + ms[None, :]
    ymask = (rows[:, None] < T) & (ms[None, :] < M)
    y = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=ymask)


def lora_apply_triton(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``kernels.lora.lora_apply_torch`` in two kernels, ``y`` updated in place and returned, for up to
    ``MAX_ROWS`` rows of plain layouts; otherwise the reference."""
    rows, k = x.shape
    n, m, slots = a.shape[0], b.shape[0], row_slots.shape[1]
    plain = (
        x.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous() and y.stride(-1) == 1
        and row_slots.stride(-1) == 1 and x.dtype == a.dtype == b.dtype == y.dtype == row_slots.dtype
        and n % slots == 0 and n <= 1024
    )  # fmt: skip
    if not plain or rows > MAX_ROWS or rows == 0:
        return lora_apply_torch(x, a, b, row_slots, y)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    n_blocks = triton.cdiv(n, block_n)
    row_blocks = triton.cdiv(rows, BLOCK_T)
    block_k = 128
    # Enough programs to keep loads in flight over a's n x k (rows share them): ~2 per SM.
    splits = max(1, min(triton.cdiv(k, block_k), 256 // (n_blocks * row_blocks)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    precision = dot_precision(x.dtype)
    pdl = pdl_kwargs(x.device)
    _lora_shrink_kernel[(n_blocks, splits, row_blocks)](
        x, a, partial, rows, n, k, k_per_split, x.stride(0), a.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, **pdl, num_warps=4,
    )  # fmt: skip
    block_m = 64
    _lora_expand_kernel[(triton.cdiv(m, block_m), row_blocks)](
        partial, row_slots, b, y, rows, n, m, n // slots, splits, slots,
        partial.stride(0), partial.stride(1), row_slots.stride(0), b.stride(0), y.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m, PRECISION=precision,
        **pdl, num_warps=4,
    )  # fmt: skip
    return y


def lora_apply_small(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The Triton backend's LoRA op: ``lora_apply_triton`` up to ``FASTER_UP_TO`` rows, where it was
    measured faster, the reference beyond."""
    if x.shape[0] > FASTER_UP_TO:
        return lora_apply_torch(x, a, b, row_slots, y)
    return lora_apply_triton(x, a, b, row_slots, y)
