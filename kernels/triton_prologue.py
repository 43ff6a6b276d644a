"""From a fused QKV projection to attention's inputs: one Triton kernel for ``kernels/qkv_prologue.py``.

One launch splits ``qkv`` into q, k and v heads, applies the per-head q/k RMSNorm where the model has one
(Qwen3), rotates q and k (RoPE, rotate-half), writes k and v into the block-major KV pool at
``slot_mapping`` and stores the rotated q into a new contiguous ``[T, Hq, D]`` tensor. The composition it
replaces launched rms_norm x2, rope and write_kv: on the Qwen3-30B-A3B decode step at batch 1 this turns
4 launches per layer into 1, and 2 into 1 for Llama (rope + write_kv); k never round-trips through memory.

Grid ``(T, q_groups + 1)``: program ``(t, g)`` with ``g < q_groups`` handles a group of about ``2 * Hk``
q heads of token t (a power of two, masked at the end), the last program of each token its k and v heads
(k with norm and RoPE, v copied), so the programs do about equal work (Qwen3-30B-A3B: 4 programs of 8 q
heads and 1 of 4 k + 4 v heads). Each program loads the token's position and cos/sin row (L2-resident)
itself. On an H200 in bf16 this layout timed the same as one program per token (all q heads in one
program) from T = 1 (1.8-2.0 us, launch-bound) to T = 8192 (52-57 us, about 3.3-3.5 TB/s), so there is one
layout and one compiled variant per model; the 3-4 launch composition it replaces took 3.3 us (Llama-3.1-8B)
and 5.8 us (Qwen3-30B-A3B) at T = 1, and 63 us and 320 us at T = 8192 (CUDA-graph replay, bf16, D = 128).

Numerics follow the reference's rounding points: the norm is computed in fp32 and rounded to qkv's dtype
before the weight multiply, whose product is rounded to the output dtype; RoPE runs in fp32 and is rounded
to the output dtype; k is then cast to the pool's dtype. Nothing is read back to the host: safe inside a
captured CUDA graph. ``qkv`` may be a strided row view (only its last dimension must be contiguous); any
even head_dim and any head counts are supported through masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import check_out
from kernels.kv_cache import check_kv_scales, inv_scale
from kernels.triton_device import pdl_kwargs, pdl_wait
from kernels.triton_kv_cache import pool_strides, to_pool


@triton.jit
def _norm_rotate(
    x1,
    x2,
    w_ptr,
    dims,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """Per-head RMSNorm (optional) then RoPE of heads given as halves [H, HALF] in fp32; rounded to OUT_DTYPE."""
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        # Rounded to the input dtype before the weight multiply, and the product to the output dtype.
        x1 = (w1 * (x1 * inv_rms).to(IN_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(IN_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; out = x * cos + rotate_half(x) * sin, with cos/sin repeated over halves.
    return (x1 * cos - x2 * sin).to(OUT_DTYPE), (x2 * cos + x1 * sin).to(OUT_DTYPE)


@triton.jit
def _q_heads(
    row,
    q_out_ptr,
    w_ptr,
    token,
    group,
    num_q_heads,
    stride_qo_t,
    stride_qo_h,
    dims,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
):
    """q heads [group * BLOCK_HQ, ...) of one token: norm, rotate, store to q_out."""
    heads = group * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
    mask = (heads[:, None] < num_q_heads) & (dims[None, :] < HALF)
    src = row + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out_dtype = q_out_ptr.dtype.element_ty
    o1, o2 = _norm_rotate(
        x1, x2, w_ptr, dims, cos, sin, eps, HEAD_DIM, HALF, HAS_NORM, row.dtype.element_ty, out_dtype
    )
    dst = q_out_ptr + token * stride_qo_t + heads[:, None] * stride_qo_h + dims[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)


@triton.jit
def _kv_heads(
    row,
    pool_ptr,
    w_ptr,
    slot,
    layer,
    heads,
    num_q_heads,
    num_kv_heads,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    dims,
    cos,
    sin,
    eps,
    k_inv_scale,
    v_inv_scale,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """k heads ``heads`` (norm, rotate) and v heads (copy) of one token into its pool slot, cast to the
    pool dtype (a float8 pool: times the layer's inverse k and v scales first); k is first rounded to
    OUT_DTYPE, q's dtype (promote(norm weight, qkv), as in the reference)."""
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HALF)
    dst = (
        pool_ptr
        + (slot // BLOCK_SIZE) * stride_pool_block
        + layer * stride_pool_layer
        + (slot % BLOCK_SIZE) * stride_pool_slot
        + heads[:, None] * stride_pool_head
        + dims[None, :]
    )
    pool_dtype = pool_ptr.dtype.element_ty
    k_src = row + (num_q_heads + heads[:, None]) * HEAD_DIM + dims[None, :]
    x1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _norm_rotate(
        x1, x2, w_ptr, dims, cos, sin, eps, HEAD_DIM, HALF, HAS_NORM, row.dtype.element_ty, OUT_DTYPE
    )
    tl.store(dst, to_pool(o1, pool_dtype, k_inv_scale), mask=mask)
    tl.store(dst + HALF, to_pool(o2, pool_dtype, k_inv_scale), mask=mask)
    v_src = k_src + num_kv_heads * HEAD_DIM
    v1 = tl.load(v_src, mask=mask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
    tl.store(dst + stride_pool_kv, to_pool(v1, pool_dtype, v_inv_scale), mask=mask)
    tl.store(dst + stride_pool_kv + HALF, to_pool(v2, pool_dtype, v_inv_scale), mask=mask)


@triton.jit
def _qkv_prologue_kernel(
    qkv_ptr,
    q_out_ptr,
    pool_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    layer,
    num_q_heads,
    num_kv_heads,
    stride_qkv_t,
    stride_qo_t,
    stride_qo_h,
    stride_cache,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    eps,
    k_inv_scale,
    v_inv_scale,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    row = qkv_ptr + token * stride_qkv_t
    dims = tl.arange(0, BLOCK_HALF)
    # Positions and the cos/sin table are step inputs no kernel of the step writes: read them before the
    # PDL wait, while the QKV projection still runs, so only qkv is read after it.
    pos = tl.load(pos_ptr + token).to(tl.int64)  # pre-wait: step input
    half_mask = dims < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=half_mask, other=0.0)  # pre-wait: table
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=half_mask, other=0.0)  # pre-wait: table
    cos = cos[None, :]
    sin = sin[None, :]
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    if group < tl.num_programs(1) - 1:
        _q_heads(
            row,
            q_out_ptr,
            q_norm_ptr,
            token,
            group,
            num_q_heads,
            stride_qo_t,
            stride_qo_h,
            dims,
            cos,
            sin,
            eps,
            HEAD_DIM,
            HALF,
            HAS_NORM,
            BLOCK_HQ,
        )
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # a negative slot is padding: nothing is written
            _kv_heads(
                row,
                pool_ptr,
                k_norm_ptr,
                slot,
                layer,
                tl.arange(0, BLOCK_HKV),
                num_q_heads,
                num_kv_heads,
                stride_pool_block,
                stride_pool_layer,
                stride_pool_kv,
                stride_pool_slot,
                stride_pool_head,
                dims,
                cos,
                sin,
                eps,
                k_inv_scale,
                v_inv_scale,
                HEAD_DIM,
                HALF,
                BLOCK_SIZE,
                HAS_NORM,
                q_out_ptr.dtype.element_ty,
            )


def _q_heads_per_program(num_heads: int, num_kv_heads: int) -> int:
    """A power of two near the k/v program's 2 * Hk head rows, so that every program does similar work."""
    return min(triton.next_power_of_2(num_heads), triton.next_power_of_2(2 * num_kv_heads))


def qkv_prologue_triton(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hk) * D]; q_norm/k_norm: [D] or None (both or neither). Returns q: [T, Hq, D],
    written into ``out`` where given (of q's dtype, unit last stride: the prefill graphs' static buffer).
    ``k_scale``, ``v_scale``: the layer's KV scales (``kernels.kv_cache``)."""
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together (Qwen3) or both be None (Llama)")
    if q_norm is not None and q_norm.dtype != k_norm.dtype:
        raise ValueError(f"q_norm ({q_norm.dtype}) and k_norm ({k_norm.dtype}) must share a dtype")
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    strides = pool_strides(kv_pool)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    num_tokens = qkv.shape[0]
    out_dtype = qkv.dtype if q_norm is None else torch.promote_types(q_norm.dtype, qkv.dtype)
    if out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=qkv.device)
    else:
        check_out(out, (num_tokens, num_heads, head_dim), out_dtype, "qkv_prologue")
        q_out = out
    if num_tokens == 0:
        return q_out
    block_hq = _q_heads_per_program(num_heads, num_kv_heads)
    half = head_dim // 2
    norm_q = q_norm if q_norm is not None else qkv  # never read without HAS_NORM
    norm_k = k_norm if k_norm is not None else qkv
    _qkv_prologue_kernel[(num_tokens, triton.cdiv(num_heads, block_hq) + 1)](
        qkv,
        q_out,
        kv_pool,
        positions,
        slot_mapping,
        cache,
        norm_q,
        norm_k,
        layer,
        num_heads,
        num_kv_heads,
        qkv.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        cache.stride(0),
        *strides,
        eps,
        inv_scale(k_scale),
        inv_scale(v_scale),
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_SIZE=kv_pool.shape[3],
        HAS_NORM=q_norm is not None,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        **pdl_kwargs(qkv.device),
        num_warps=4,
    )
    return q_out
