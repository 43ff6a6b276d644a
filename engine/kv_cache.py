"""The worker's KV pool: one block-major tensor, sized from settings, and its layout."""

from __future__ import annotations

import torch

from engine.models.model_config import ModelConfig
from mesh.kv_layout import KVLayout


def make_layout(cfg: ModelConfig, fingerprint: str, dtype: str, block_size: int) -> KVLayout:
    return KVLayout(fingerprint, dtype, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def num_blocks_for(layout: KVLayout, memory_gb: float) -> int:
    return max(1, int(memory_gb * (1 << 30)) // layout.block_nbytes)


def allocate_pool(
    layout: KVLayout, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, contiguous, zero-filled."""
    return torch.zeros((num_blocks, *layout.block_shape), dtype=dtype, device=device)
