"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the block-major KV pool: PyTorch reference.

The pool holds one latent a token a layer (``kv_lora_rank`` normalised values, then the rotary key),
split across its K and V halves (one head each, half the latent in each). With the key projection
absorbed into the queries (``q_latent = q_nope @ W_uk``, computed by the model), every head attends to
the same latents: scores ``[q_latent, q_rope] . latent * scale`` and values the latent's first
``v_dim`` (``kv_lora_rank``) values, which the model's ``W_uv`` then projects per head. Causality and
the batch's layout are as ``kernels.attention``'s: sequence ``b``'s new queries are its last tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.kv_cache import write_kv_torch
from kernels.norm import rms_norm_torch
from kernels.rope import apply_rope_torch

# The most float32 scores the reference's prompt path holds at once (128 MiB), per query chunk.
SCORE_CHUNK_ELEMENTS = 1 << 25


def mla_attention_torch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    v_dim: int,
    *,
    decode: bool = False,
) -> torch.Tensor:
    """q: [T, H, L] (L = the pool's latent: twice its head_dim); block_tables: [B, max_blocks] int32;
    seq_lens: [B]; query_start_loc: [B+1]. -> [T, H, v_dim] in q's dtype.

    ``decode``: the caller vouches that every sequence brings one query token (T = B; a row of seq_len 0
    gets zeros): every row at once over its whole block-table row, masked past its length, with no host
    synchronisation, so a CUDA graph can capture it."""
    if decode:
        return _decode(q, kv_pool, layer, block_tables, seq_lens, scale, v_dim)
    out = q.new_empty((q.shape[0], q.shape[1], v_dim))
    heads = q.shape[1]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        latent = context_latents(kv_pool, layer, block_tables[b], seq_len).to(torch.float32)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        q_len = q1 - q0
        # Query rows in chunks whose scores [H, rows, S] stay within SCORE_CHUNK_ELEMENTS: a prompt's
        # scores at once would be H x q_len x S floats (8.6 GB for V3's 128 heads over 4k tokens).
        rows = max(1, SCORE_CHUNK_ELEMENTS // (heads * seq_len))
        for r0 in range(0, q_len, rows):
            r1 = min(q_len, r0 + rows)
            qb = q[q0 + r0 : q0 + r1].to(torch.float32).transpose(0, 1)  # [H, rows, L]
            scores = torch.matmul(qb, latent.t()) * scale  # [H, rows, S]
            q_pos = torch.arange(seq_len - q_len + r0, seq_len - q_len + r1, device=q.device).unsqueeze(1)
            probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
            out[q0 + r0 : q0 + r1] = torch.matmul(probs, latent[:, :v_dim]).transpose(0, 1).to(q.dtype)
    return out


def context_latents(
    kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """One sequence's first ``seq_len`` latents of ``layer`` from its ``block_table`` row, in order: [seq_len,
    rank + rope] in the pool's dtype (the K and V halves side by side)."""
    block_size = kv_pool.shape[3]
    kv = kv_pool[block_table[: -(-seq_len // block_size)].long(), layer]  # [blocks, 2, bs, 1, half]
    return torch.cat([kv[:, 0], kv[:, 1]], dim=-1).reshape(-1, 2 * kv_pool.shape[-1])[:seq_len]


def mla_prefill_torch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_len: int,
    w_kv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's prompt queries in the unabsorbed form (vLLM's and SGLang's MLA prefill): its context's
    latents up-projected per head by ``w_kv`` [H, nope + v_dim, rank] into keys (with the shared rotary key)
    and values, then causal attention of ``nope + rope`` dimensions a head instead of the absorbed form's
    ``rank + rope``. q_nope [n, H, nope] (the query projection's), q_pe [n, H, rope] (rotated): the
    queries of the sequence's last ``n`` of ``seq_len`` tokens, whose latents the pool holds (``block_table``:
    the sequence's row; ``seq_len`` a host int). -> [n, H, v_dim] in q_nope's dtype. Float32 arithmetic,
    scores in query chunks of at most ``SCORE_CHUNK_ELEMENTS``."""
    n, heads, nope = q_nope.shape
    rank = w_kv.shape[2]
    latent = context_latents(kv_pool, layer, block_table, seq_len).to(torch.float32)
    w = w_kv.to(torch.float32)
    k_nope = torch.einsum("lr,hnr->hln", latent[:, :rank], w[:, :nope])  # [H, L, nope]
    v = torch.einsum("lr,hvr->hlv", latent[:, :rank], w[:, nope:])  # [H, L, v_dim]
    k_pe = latent[:, rank:]
    out = q_nope.new_empty((n, heads, v.shape[2]))
    k_pos = torch.arange(seq_len, device=q_nope.device).unsqueeze(0)
    rows = max(1, SCORE_CHUNK_ELEMENTS // (heads * seq_len))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qn = q_nope[r0:r1].to(torch.float32).transpose(0, 1)  # [H, rows, nope]
        qp = q_pe[r0:r1].to(torch.float32).transpose(0, 1)
        scores = (torch.matmul(qn, k_nope.transpose(1, 2)) + torch.matmul(qp, k_pe.t())) * scale
        q_pos = torch.arange(seq_len - n + r0, seq_len - n + r1, device=q_nope.device).unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        out[r0:r1] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


def _decode(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    batch = q.shape[0]
    kv = kv_pool[block_tables.long(), layer]  # [B, nblk, 2, bs, 1, L/2]
    latent = torch.cat([kv[:, :, 0], kv[:, :, 1]], dim=-1).reshape(batch, -1, q.shape[2]).to(torch.float32)
    scores = torch.einsum("bhl,bsl->bhs", q.to(torch.float32), latent) * scale
    beyond = torch.arange(latent.shape[1], device=q.device)[None, :] >= seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(beyond[:, None, :], float("-inf")), dim=-1)
    probs = probs.nan_to_num(0.0)  # a row of seq_len 0 (padding) attends to nothing
    return torch.einsum("bhs,bsv->bhv", probs, latent[..., :v_dim]).to(q.dtype)


def mla_prologue_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_kv: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The latent attention's step between its projections and attention: q [T, H * (nope + rope)] (the
    query projection's output), kv [T, rank + rope] (``kv_a_proj_with_mqa``'s), ``w_kv`` the key and value
    up-projection viewed [H, nope + v_dim, rank]. Writes each token's latent (``rank`` values normalised by
    ``norm_weight``, then its rotary key) into the pool at ``slot_mapping`` (negative: skipped) and returns
    the attention's queries [T, H, rank + rope]: ``q_nope @ W_uk`` (the key projection absorbed) and the
    rotary part."""
    return mla_prologue_composed(
        q, kv, positions, cos_sin, norm_weight, eps, w_kv, kv_pool, layer, slot_mapping,
        rms_norm_torch, apply_rope_torch, write_kv_torch,
    )  # fmt: skip


def mla_prologue_composed(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_kv: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    rms_norm: Callable,
    apply_rope: Callable,
    write_kv: Callable,
) -> torch.Tensor:
    """``mla_prologue_torch`` composed of a backend's norm, RoPE and pool-write ops (a backend's own where
    its fused kernel does not take a pass)."""
    t, heads = q.shape[0], w_kv.shape[0]
    rank = w_kv.shape[2]
    rope = kv.shape[1] - rank
    nope = q.shape[1] // heads - rope
    q_nope, q_rope = q.view(t, heads, nope + rope).split([nope, rope], dim=-1)
    latent = rms_norm(kv[:, :rank].contiguous(), norm_weight, eps)
    q_rope, k_rope = apply_rope(q_rope.contiguous(), kv[:, None, rank:].contiguous(), positions, cos_sin)
    cache = torch.cat([latent, k_rope[:, 0]], dim=-1)
    half = kv_pool.shape[-1]
    write_kv(kv_pool, layer, cache[:, None, :half], cache[:, None, half:], slot_mapping)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_kv[:, :nope])
    return torch.cat([q_latent, q_rope], dim=-1)


def mla_value_proj_torch(o: torch.Tensor, w_kv: torch.Tensor, v_dim: int) -> torch.Tensor:
    """The heads' latent outputs o [T, H, rank] through each head's value projection (the last ``v_dim``
    rows a head of ``w_kv``, viewed [H, nope + v_dim, rank]) -> [T, H * v_dim]."""
    t, heads = o.shape[0], o.shape[1]
    return torch.einsum("thr,hvr->thv", o, w_kv[:, -v_dim:]).reshape(t, heads * v_dim)
