"""Writing new K/V into the block-major KV pool: PyTorch reference.

Pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch


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
    kv_pool[blocks, layer, 0, offsets] = k.to(kv_pool.dtype)
    kv_pool[blocks, layer, 1, offsets] = v.to(kv_pool.dtype)
