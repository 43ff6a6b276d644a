"""Writing new K/V into the block-major KV pool: Triton kernel with the semantics of ``kernels/kv_cache.py``.

Pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, addressed through its strides;
slot = block_id * block_size + offset; a negative slot (padding) writes nothing. One program writes one
token's K and V (all KV heads). No host synchronisation: safe inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_pool_kv, v.to(pool_ptr.dtype.element_ty), mask=mask)


def pool_strides(kv_pool: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Strides of the pool's block, layer, K/V, slot and head dimensions; head_dim must be contiguous."""
    if kv_pool.stride(-1) != 1:
        raise ValueError("kv_pool must be contiguous in head_dim")
    return kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4)


def write_kv_triton(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int (negative slots are skipped: padding)."""
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
        BLOCK_SIZE=kv_pool.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
