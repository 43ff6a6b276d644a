"""Paged causal attention over the block-major KV pool: PyTorch reference.

One op serves prefill, chunked prefill with a cached prefix, and decode: sequence ``b`` brings
``q_len_b = query_start_loc[b+1] - query_start_loc[b]`` new query tokens, which are the last ``q_len_b``
of its ``seq_lens[b]`` tokens; its K/V (new tokens included) are already in the pool. Query token ``j``
attends to keys ``[0, seq_lens[b] - q_len_b + j]``.
"""

from __future__ import annotations

import torch

from kernels.kv_cache import check_kv_scales


def paged_attention_torch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, Hq, D]; block_tables: [B, max_blocks] int32; seq_lens: [B]; query_start_loc: [B+1]. -> [T, Hq, D].

    ``out`` (optional, [T, Hq, D] of q's dtype): where the result goes, for callers with a static buffer
    (the prefill graphs); it is returned. ``k_scale``, ``v_scale``: the layer's KV scales, by which a
    float8 pool's keys and values are multiplied as they are read."""
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    result = _paged_attention(
        q, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
    )
    if out is None:
        return result
    check_out(out, q.shape, q.dtype, "attention")
    return out.copy_(result)


def check_out(out: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, op: str) -> None:
    """An ``out`` buffer for an op's [T, H, D] result: that shape and dtype, unit last stride."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(
            f"{op} out must be {tuple(shape)} {dtype} with a unit last stride; "
            f"got {tuple(out.shape)} {out.dtype}, strides {out.stride()}"
        )


def _paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // num_kv_heads
    if q.shape[0] == seq_lens.shape[0] > 1 and bool((query_start_loc.diff() == 1).all()):
        return _decode_batched(q, kv_pool, layer, block_tables, seq_lens, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        kv = kv_pool[blocks, layer]  # [n, 2, bs, Hkv, D]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        qb = q[q0:q1].to(torch.float32).transpose(0, 1)  # [Hq, q_len, D]
        k = _widen(k, k_scale).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        v = _widen(v, v_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, q_len, S]
        q_len = q1 - q0
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def _decode_batched(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """One query token per sequence (pure decode): every sequence at once, keys padded to the widest
    block table and masked past each sequence's length. Same function as the per-sequence loop."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    group = num_heads // num_kv_heads
    kv = kv_pool[block_tables.long(), layer]  # [B, nblk, 2, bs, Hkv, D]
    k = _widen(kv[:, :, 0].reshape(batch, -1, num_kv_heads, head_dim), k_scale)  # [B, S, Hkv, D]
    v = _widen(kv[:, :, 1].reshape(batch, -1, num_kv_heads, head_dim), v_scale)
    qg = q.to(torch.float32).reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) * scale  # [B, Hkv, G, S]
    positions = torch.arange(k.shape[1], device=q.device)
    scores = scores.masked_fill(
        (positions[None, :] >= seq_lens[:, None]).view(batch, 1, 1, -1), float("-inf")
    )
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def _widen(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Pool values in float32, times their scale (a float8 pool's; 1.0 otherwise)."""
    x = x.to(torch.float32)
    return x * scale if scale != 1.0 else x
