"""Writing new K/V into the block-major KV pool: PyTorch reference.

Pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``. The pool's dtype is the model's, or float8 e4m3 (``kv_cache_dtype``
fp8): values are then stored unscaled (a scale of 1.0, vLLM's default without calibrated scales),
clamped to the format's largest finite value, and rounded to nearest even; readers widen them back.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the pool stores it: a plain cast, or for a float8 pool, clamped to its finite range first
    (so that an outlier saturates instead of depending on how a cast treats overflow)."""
    if dtype in FP8_KV_DTYPES:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def write_kv_torch(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int (negative slots are skipped: padding)."""
    block_size = kv_pool.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_pool[blocks, layer, 0, offsets] = to_pool_dtype(k, kv_pool.dtype)
    kv_pool[blocks, layer, 1, offsets] = to_pool_dtype(v, kv_pool.dtype)
