"""From a fused QKV projection to attention's inputs: PyTorch reference.

Splits ``qkv`` into q, k, v heads, applies the per-head RMSNorm to q and k where the model has one
(Qwen3), rotates q and k (RoPE), writes k and v into the KV pool and returns the rotated q. The reference
composes the single ops; a fused kernel does it in one pass over the token.
"""

from __future__ import annotations

import torch

from kernels.attention import check_out, paged_attention_torch
from kernels.kv_cache import write_kv_torch
from kernels.norm import rms_norm_torch
from kernels.rope import apply_rope_torch


def qkv_prologue_torch(
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
    """qkv: [T, (Hq + 2 Hk) * D]; q_norm/k_norm: [D] or None (both or neither). Returns q: [T, Hq, D], in
    ``out`` where given (of q's dtype: promote(norm weight, qkv)). ``k_scale``, ``v_scale``: the layer's
    KV scales (``kernels.kv_cache``)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_torch(q, q_norm, eps)
        k = rms_norm_torch(k, k_norm, eps)
    q, k = apply_rope_torch(q, k, positions, cos_sin_cache)
    write_kv_torch(kv_pool, layer, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        return q
    check_out(out, q.shape, q.dtype, "qkv_prologue")
    return out.copy_(q)


def qkv_attention_torch(
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
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The prologue, then attention (``kernels.attention``): one op from the raw QKV projection to the
    attention output [T, Hq, D], so that a backend can fold the prologue into the attention kernel.
    Writes k and v into the pool at ``slot_mapping``, as the prologue does."""
    q = qkv_prologue_torch(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, positions,
                           cos_sin_cache, kv_pool, layer, slot_mapping, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return paged_attention_torch(q, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale,
                                 k_scale=k_scale, v_scale=v_scale)  # fmt: skip
