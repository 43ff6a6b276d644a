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
    layer's k or v scale), clamped to its finite range (448; e5m2 57344) and rounded to its precision
    (nearest, ties to even) before the cast, which is then exact. A 16-bit pool takes x as it is (its scale is 1). Rounding
    first gives the Triton interpreter's results too (its own fp32 -> fp8 cast loses the carry into the
    exponent: 31.9 becomes 16, not 32), and costs a few integer operations a value on the GPU."""
    if pool_dtype == tl.float8e5:
        # e5m2: 2 mantissa bits, normal from 2^-14, subnormals multiples of 2^-16 (192 = 1.5 * 2^7 has an
        # fp32 spacing of 2^-16), finite to 57344.
        y = tl.clamp(x.to(tl.float32) * inv_scale, -57344.0, 57344.0)
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0xFFFFF + ((bits >> 21) & 1)) & -0x200000).to(tl.float32, bitcast=True)
        tiny = (tl.abs(y) + 192.0) - 192.0
        tiny = tl.where(bits < 0, -tiny, tiny)
        return tl.where(tl.abs(y) < 0.00006103515625, tiny, normal).to(pool_dtype)
    if pool_dtype == tl.float8e4nv:
        y = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
        # Normal e4m3 values keep 3 of fp32's 23 mantissa bits: round the 20 dropped ones away.
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # Below 2^-6 e4m3 is subnormal, multiples of 2^-9: adding 1.5 * 2^14 (whose fp32 spacing is 2^-9)
        # to the magnitude and taking it away again rounds to them; the sign is put back (-0.0 stays).
        tiny = (tl.abs(y) + 24576.0) - 24576.0
        tiny = tl.where(bits < 0, -tiny, tiny)
        return tl.where(tl.abs(y) < 0.015625, tiny, normal).to(pool_dtype)
    return x.to(pool_dtype)


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
