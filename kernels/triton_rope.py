"""Rotary position embedding (rotate-half / NeoX style): Triton kernel with the semantics of ``kernels/rope.py``.

One program rotates every query and key head of one token, so the token's cos/sin row is read once.
q and k may be strided views (for example slices of a fused QKV projection); only the last dimension
must be contiguous. The results are new contiguous tensors, as in the reference; inputs are not modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src_t,
    stride_src_h,
    stride_dst_t,
    stride_dst_h,
    token,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    src = src_ptr + token * stride_src_t + heads[:, None] * stride_src_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dst_t + heads[:, None] * stride_dst_h + dims[None, :]
    # rotate_half(x) = [-x2, x1]; out = x * cos + rotate_half(x) * sin, with cos/sin repeated over halves.
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cache_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        token,
        num_q_heads,
        cos,
        sin,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        token,
        num_k_heads,
        cos,
        sin,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T], cos_sin_cache: [max_pos, D] fp32 -> (q', k')."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cache,
        num_q_heads,
        num_k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cache.stride(0),
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
