"""From a fused QKV projection to attention's inputs: the Triton version of ``kernels/qkv_prologue.py``.

Composes the single Triton ops (q/k RMSNorm, RoPE, KV write) over views of ``qkv``.
"""

from __future__ import annotations

import torch

from kernels.triton_kv_cache import write_kv_triton
from kernels.triton_norm import rms_norm_triton
from kernels.triton_rope import apply_rope_triton


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
) -> torch.Tensor:
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_triton(q, q_norm, eps)
        k = rms_norm_triton(k, k_norm, eps)
    q, k = apply_rope_triton(q, k, positions, cos_sin_cache)
    write_kv_triton(kv_pool, layer, k, v, slot_mapping)
    return q
