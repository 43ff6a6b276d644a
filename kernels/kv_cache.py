"""Writing new K/V into the block-major KV pool: PyTorch reference.

Pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``. The pool's dtype is the model's, or float8 e4m3 (``kv_cache_dtype``
fp8, or e5m2 with fp8_e5m2): values are then stored divided by the layer's k or v scale (a checkpoint's calibrated ``k_scale`` /
``v_scale``, else 1.0, as vLLM does), clamped to the format's largest finite value, and rounded to nearest
even; readers widen them back and multiply by the scale. A 16-bit pool stores values as they are.
"""

from __future__ import annotations

import functools

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
FP8_E5M2_MAX = 57344.0  # the largest finite float8 e5m2 value
FP8_MAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype, inv_scale: float = 1.0) -> torch.Tensor:
    """``x`` as the pool stores it: a plain cast, or for a float8 pool, multiplied in float32 by
    ``inv_scale`` (the float32 value of 1 / scale, as the kernels take it) and clamped to its finite range
    (so that an outlier saturates instead of depending on how a cast treats overflow)."""
    if dtype in FP8_KV_DTYPES:
        y = x.float()
        if inv_scale != 1.0:
            y = y * torch.tensor(inv_scale, dtype=torch.float32, device=x.device)
        return y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x.to(dtype)


def check_kv_scales(pool_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """KV scales are for a float8 pool (positive and finite); a 16-bit pool takes none but 1.0."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (0.0 < value < float("inf")):
            raise ValueError(f"{name} must be positive and finite, got {value}")
        if value != 1.0 and pool_dtype not in FP8_KV_DTYPES:
            raise ValueError(f"{name} {value} given for a {pool_dtype} KV pool: scales apply to float8 pools")


@functools.cache
def inv_scale(scale: float) -> float:
    """1 / scale rounded to float32, the multiplier every writer of the pool uses."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def write_kv_torch(
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
    the layer's KV scales (a float8 pool stores k / k_scale and v / v_scale)."""
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    block_size = kv_pool.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_pool[blocks, layer, 0, offsets] = to_pool_dtype(k, kv_pool.dtype, inv_scale(k_scale))
    kv_pool[blocks, layer, 1, offsets] = to_pool_dtype(v, kv_pool.dtype, inv_scale(v_scale))
