"""Writing new K/V into the block-major KV pool: Triton kernel with the semantics of ``kernels/kv_cache.py``.

Pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, addressed through its strides;
slot = block_id * block_size + offset; a negative slot (padding) writes nothing. One program writes one
token's K and V (all KV heads). No host synchronisation: safe inside a captured CUDA graph. ``to_pool``
is every kernel's cast into the pool (a float8 pool: clamped first, as ``to_pool_dtype``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import check_kv_scales, inv_scale


@triton.jit
def to_pool(x, pool_dtype: tl.constexpr, inv_scale):
    """``x`` cast to the pool's dtype; to float8 e4m3 (or e5m2) through fp32 times ``inv_scale`` (1 / the
    layer's k or v scale), clamped to its finite range and rounded to its precision (``_round_fp8``)
    before the cast, which is then exact. A 16-bit pool takes x as it is (its scale is 1). Rounding first
    gives the Triton interpreter's results too (its own fp32 -> fp8 cast loses the carry into the
    exponent: 31.9 becomes 16, not 32 in e4m3), and costs a few integer operations a value on the GPU."""
    if pool_dtype == tl.float8e4nv:  # 3 mantissa bits, normal from 2^-6, finite to 448
        return _round_fp8(x, inv_scale, 20, 0.015625, 24576.0, 448.0).to(pool_dtype)
    if pool_dtype == tl.float8e5:  # 2 mantissa bits, normal from 2^-14, finite to 57344
        return _round_fp8(x, inv_scale, 21, 0.00006103515625, 192.0, 57344.0).to(pool_dtype)
    return x.to(pool_dtype)


@triton.jit
def _round_fp8(x, inv_scale, DROP: tl.constexpr, MIN_NORMAL: tl.constexpr, TINY: tl.constexpr,
               MAX: tl.constexpr):  # fmt: skip
    """``x * inv_scale`` in fp32, clamped to +-MAX and rounded (nearest, ties to even) to a float8 format
    whose normal values keep 23 - DROP of fp32's mantissa bits and start at MIN_NORMAL; below it the
    format is subnormal, in steps of fp32's spacing at TINY (1.5 * 2^k): adding TINY to the magnitude and
    taking it away again rounds to them, and the sign is put back (-0.0 stays)."""
    y = tl.clamp(x.to(tl.float32) * inv_scale, -MAX, MAX)
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & -(1 << DROP)).to(
        tl.float32, bitcast=True
    )
    tiny = (tl.abs(y) + TINY) - TINY
    tiny = tl.where(bits < 0, -tiny, tiny)
    return tl.where(tl.abs(y) < MIN_NORMAL, tiny, normal)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    pool_ptr,
    slot_ptr,
    layer,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    k_inv_scale,
    v_inv_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    dst = (
        pool_ptr
        + block * stride_pool_block
        + layer * stride_pool_layer
        + offset * stride_pool_slot
        + heads * stride_pool_head
        + dims
    )
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(dst, to_pool(k, pool_ptr.dtype.element_ty, k_inv_scale), mask=mask)
    tl.store(dst + stride_pool_kv, to_pool(v, pool_ptr.dtype.element_ty, v_inv_scale), mask=mask)


def pool_strides(kv_pool: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Strides of the pool's block, layer, K/V, slot and head dimensions; head_dim must be contiguous."""
    if kv_pool.stride(-1) != 1:
        raise ValueError("kv_pool must be contiguous in head_dim")
    return kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4)


def write_kv_triton(
    kv_pool: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int (negative slots are skipped: padding); k_scale, v_scale:
    the layer's KV scales (``kernels.kv_cache``)."""
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    strides = pool_strides(kv_pool)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_pool,
        slot_mapping,
        layer,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *strides,
        inv_scale(k_scale),
        inv_scale(v_scale),
        BLOCK_SIZE=kv_pool.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
