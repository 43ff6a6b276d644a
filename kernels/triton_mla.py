"""DeepSeek-V3's ops in Triton: the grouped routing (``kernels/moe_routing.py::moe_route_grouped_torch``)
in one launch, and the latent attention (``kernels/mla_attention.py``) as a split-KV kernel and a merge: a
row a sequence for decode calls (``decode=True``), a row a query token for prompt chunks (each over its
context up to itself). Shapes outside the kernels' power-of-two sizes take the torch reference.

Routing, one token per program: sigmoid scores of the float32 logits, the choice bias, each group's score
(its two best choices summed), the ``topk_group`` best groups, then the k best experts within them, each by
a max-reduction that breaks ties towards the lowest index; weights the unbiased scores, renormalised
(plus 1e-20) and scaled; then the physical replica (``token % replicas``) and a relaxed atomic count, as
``moe_route_triton`` does. No host synchronisation: graph-safe.

Latent attention (decode): program ``(b, s, g)`` takes sequence ``b``'s tokens of split ``s`` (its own
length cut into the splits' runs of whole tiles on the device, so a short sequence spreads over them however
wide the block table) and heads ``g * BLOCK_H ..``; each tile of ``BLOCK_N`` cached latents is loaded once for those heads (the latent's
first ``R`` values and its ``P`` rotary ones, read across the pool's K and V halves), scores are two
``tl.dot``s (the absorbed query against the latent, the rotary query against the rotary key), the values
are the same latent tile; an online softmax keeps the split's output and log-sum-exp in float32 scratch,
which the merge combines (a split without tokens weighs nothing; a row of seq_len 0 gets zeros). A float8
pool's tiles are widened to the query's dtype (exact) before the dots; the prologue writes the latents into
it through ``to_pool`` (clamped, rounded to nearest even, as the reference's ``write_kv_torch``; the latent
is stored unscaled, vLLM's default for MLA).

Unabsorbed prefill (``mla_prefill_triton``, one sequence's prompt queries): its latents up-projected by one
GEMM into every head's keys and values, then a causal flash-attention kernel, program ``(query block, head)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import FP8_KV_DTYPES
from kernels.mla_attention import (
    context_latents,
    mla_attention_torch,
    mla_prefill_torch,
    mla_prologue_composed,
    mla_value_proj_torch,
)
from kernels.moe_routing import moe_route_grouped_torch
from kernels.triton_attention import num_kv_splits
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait
from kernels.triton_kv_cache import to_pool, write_kv_triton
from kernels.triton_norm import rms_norm_triton
from kernels.triton_rope import apply_rope_triton


@triton.jit
def _grouped_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, l2p_ptr, replica_counts_ptr, counts_ptr, live_ptr,
    stride_lt, stride_l2p_e, stride_l2p_r, scaling,
    E: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_LIVE: tl.constexpr, SOFTMAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    GS: tl.constexpr = E // N_GROUP
    e = tl.arange(0, E)
    logit = tl.load(logits_ptr + t * stride_lt + e).to(tl.float32)
    if SOFTMAX:  # DeepSeek-V2: softmax scores, no bias, a group scored by its best
        exp = tl.exp(logit - tl.max(logit, axis=0))
        score = exp / tl.sum(exp, axis=0)
        choice = score
    else:
        score = 1.0 / (1.0 + tl.exp(-logit))
        choice = score + tl.load(bias_ptr + e).to(tl.float32)
    if N_GROUP > 1:
        grouped = tl.reshape(choice, (N_GROUP, GS))
        first = tl.max(grouped, axis=1)
        if SOFTMAX:
            group_score = first
        elif GS > 1:
            ties = tl.sum((grouped == first[:, None]).to(tl.int32), axis=1)
            below = tl.max(tl.where(grouped < first[:, None], grouped, float("-inf")), axis=1)
            group_score = first + tl.where(ties > 1, first, below)
        else:
            group_score = first
        g = tl.arange(0, N_GROUP)
        keep = tl.zeros([N_GROUP], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0, tie_break_left=True)
            keep = keep | (g == best)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E,))
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_e = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0, tie_break_left=True)
        taken = e == best
        top_w = tl.where(slots == j, tl.sum(tl.where(taken, score, 0.0), axis=0), top_w)
        top_e = tl.where(slots == j, best.to(tl.int64), top_e)
        choice = tl.where(taken, float("-inf"), choice)
    valid = slots < TOP_K
    if RENORMALIZE:
        top_w = top_w / (tl.sum(tl.where(valid, top_w, 0.0), axis=0) + 1e-20)
    top_w = top_w * scaling
    replicas = tl.load(replica_counts_ptr + top_e, mask=valid, other=1)
    physical = tl.load(l2p_ptr + top_e * stride_l2p_e + (t % replicas) * stride_l2p_r, mask=valid, other=0)
    tl.store(weights_ptr + t * TOP_K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=valid)
    tl.store(ids_ptr + t * TOP_K + slots, physical, mask=valid)
    count = valid
    if HAS_LIVE:
        count = count & (tl.load(live_ptr + t + slots * 0) != 0)  # the row's flag, in every lane
    tl.atomic_add(
        counts_ptr + physical, tl.full([BLOCK_K], 1, counts_ptr.dtype.element_ty), mask=count, sem="relaxed"
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def moe_route_grouped_triton(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    logical_to_physical: torch.Tensor,
    replica_counts: torch.Tensor,
    expert_counts: torch.Tensor,
    out_dtype: torch.dtype,
    live: torch.Tensor | None = None,
    *,
    softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route_grouped_torch`` in one launch (the same arguments and results); expert counts that are
    not a power of two, or groups that do not divide them so, take the reference."""
    tokens, experts = router_logits.shape
    if not (_pow2(experts) and _pow2(n_group) and experts % n_group == 0):
        return moe_route_grouped_torch(router_logits, bias, top_k, n_group, topk_group, renormalize, scaling,
                                       logical_to_physical, replica_counts, expert_counts, out_dtype, live,
                                       softmax=softmax)  # fmt: skip
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    _grouped_route_kernel[(tokens,)](
        logits, bias, weights, ids, logical_to_physical, replica_counts, expert_counts,
        live if live is not None else expert_counts, logits.stride(0),
        logical_to_physical.stride(0), logical_to_physical.stride(1), float(scaling),
        E=experts, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, HAS_LIVE=live is not None, SOFTMAX=softmax, num_warps=1 if experts <= 64 else 2,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _mla_split_kernel(
    q_ptr, pool_ptr, tables_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    stride_qt, stride_qh, stride_pb, stride_pl, stride_ph, stride_pt, stride_tb,
    layer, num_heads, scale,
    R: tl.constexpr, P: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    pdl_wait(USE_PDL)
    seq_len = tl.load(seq_lens_ptr + b)
    # The sequence's own length cut into NUM_SPLITS runs of whole tiles (the last ones may be empty).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    r = tl.arange(0, R)
    p = tl.arange(0, P)
    q_row = q_ptr + b * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=head_mask[:, None], other=0.0)
    q_rope = tl.load(q_row + R + p[None, :], mask=head_mask[:, None], other=0.0)
    # A latent column c sits in the pool's K half below HALF, in its V half (at c - HALF) from there.
    r_off = tl.where(r < HALF, r, stride_ph + r - HALF)
    p_off = tl.where(R + p < HALF, R + p, stride_ph + R + p - HALF)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(tables_ptr + b * stride_tb + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = pool_ptr + block * stride_pb + layer * stride_pl + (n % BLOCK_SIZE) * stride_pt
        # A float8 pool's values widened to the query's dtype (exact; a no-op for a pool of that dtype).
        k_lat = tl.load(tok[:, None] + r_off[None, :], mask=n_mask[:, None], other=0.0).to(q_lat.dtype)
        k_rope = tl.load(tok[:, None] + p_off[None, :], mask=n_mask[:, None], other=0.0).to(q_rope.dtype)
        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(l_sum, 1e-30)[:, None]
    lse = tl.where(l_sum > 0, m + tl.log(tl.maximum(l_sum, 1e-30)), float("-inf"))
    row = (b * NUM_SPLITS + s) * num_heads + heads
    tl.store(o_ptr + row[:, None] * R + r[None, :], out, mask=head_mask[:, None])
    tl.store(lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _mla_merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, num_heads, stride_ot, stride_oh,
    R: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    rows = (b * NUM_SPLITS + s) * num_heads + h
    pdl_wait(USE_PDL)
    lse = tl.load(lse_ptr + rows)
    top = tl.max(lse, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # every split empty (seq_len 0): no -inf - -inf
    total = tl.sum(tl.exp(lse - top), axis=0)
    r = tl.arange(0, R)
    # The parts in chunks of up to 8 splits (8 x R float32 values at once: up to 64 splits, as a batch-1
    # step takes, would not fit in registers); an empty split's part is never read (its weight is 0).
    CHUNK: tl.constexpr = 8 if NUM_SPLITS > 8 else NUM_SPLITS
    c = tl.arange(0, CHUNK)
    acc = tl.zeros([R], tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, CHUNK):
        chunk_rows = (b * NUM_SPLITS + s0 + c) * num_heads + h
        chunk_lse = tl.load(lse_ptr + chunk_rows)
        used = chunk_lse > float("-inf")
        parts = tl.load(o_part_ptr + chunk_rows[:, None] * R + r[None, :], mask=used[:, None], other=0.0)
        acc += tl.sum(parts * tl.exp(chunk_lse - top)[:, None], axis=0)
    merged = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + r, merged.to(out_ptr.dtype.element_ty))


def mla_attention_triton(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """``mla_attention_torch``'s contract: the split-KV kernel and its merge when the latent's parts are
    powers of two and the value part is the latent's (``v_dim`` = kv_lora_rank); other shapes take the
    reference. Decode calls (``decode``: one query a sequence) are one row a sequence; other calls (prompt
    chunks) one row a query token, over its sequence's block table and its context up to itself
    (``per_token_rows``), so a prompt's keys are read once a token from L2 rather than its scores held.

    ``num_splits``: splits a sequence (a power of two; default: ``num_kv_splits``'s rule for the batch,
    its head groups and the block table's span). Each sequence's own length is cut into that many runs of
    whole tiles on the device, so a short sequence in a wide table still spreads over the splits."""
    latent = q.shape[2]
    rope = latent - v_dim
    half = kv_pool.shape[-1]
    if not (_pow2(v_dim) and _pow2(rope)) or kv_pool.shape[4] != 1 or 2 * half != latent:
        return mla_attention_torch(q, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale, v_dim,
                                   decode=decode)  # fmt: skip
    q = q if q.stride(2) == 1 else q.contiguous()
    out = q.new_empty((q.shape[0], q.shape[1], v_dim))
    if q.shape[0] == 0:
        return out
    if decode:
        _attend_rows(q, kv_pool, layer, block_tables, seq_lens, scale, v_dim, num_splits, out)
        return out
    # Prompt chunks (and mixed steps): every query token a row of its own over its context up to itself,
    # through the same kernels, PROMPT_ROWS tokens a launch (their split parts are H x R floats a token).
    seq_of, lens = per_token_rows(seq_lens, query_start_loc, q.shape[0])
    for t0 in range(0, q.shape[0], PROMPT_ROWS):
        rows = slice(t0, min(q.shape[0], t0 + PROMPT_ROWS))
        _attend_rows(q[rows], kv_pool, layer, block_tables[seq_of[rows]], lens[rows], scale, v_dim, num_splits,
                     out[rows])  # fmt: skip
    return out


# Query tokens of a prompt pass attended in one launch of the split kernel (their float32 split outputs take
# PROMPT_ROWS x heads x kv_lora_rank floats: 256 MiB at DeepSeek-V3's 128 heads).
PROMPT_ROWS = 1024


def per_token_rows(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of a pass's ``tokens`` query tokens as a row of its own (a causal query sees its context up to
    itself): its sequence's index and its length then (int32). Vectorised, no host synchronisation."""
    device = seq_lens.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), q_lens, output_size=tokens)
    t = torch.arange(tokens, device=device)
    lens = seq_lens.long()[seq_of] - q_lens[seq_of] + (t - query_start_loc.long()[seq_of]) + 1
    return seq_of, lens.to(torch.int32)


def _attend_rows(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    num_splits: int | None,
    out: torch.Tensor,
) -> None:
    """One query a row: the split kernel and the merge into ``out`` [rows, H, v_dim]."""
    o_part, lse = mla_splits(q, kv_pool, layer, block_tables, seq_lens, scale, v_dim, num_splits)
    _mla_merge_kernel[(q.shape[0], q.shape[1])](
        o_part, lse, out, q.shape[1], out.stride(0), out.stride(1), R=v_dim, NUM_SPLITS=lse.shape[1],
        num_warps=4, **pdl_kwargs(q.device),
    )  # fmt: skip


def mla_splits(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    num_splits: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's launch (``mla_attention_triton``'s first stage: one query a row, a sequence's at
    decode or a prompt token's): each split's normalised output [B, S, H, v_dim] and log-sum-exp [B, S, H]
    (-inf: no key)."""
    batch, heads = q.shape[0], q.shape[1]
    block_size = kv_pool.shape[3]
    block_h = max(16, min(64, triton.next_power_of_2(heads)))
    groups = triton.cdiv(heads, block_h)
    if num_splits is None:
        splits = num_kv_splits(batch, groups, block_tables.shape[1] * block_size, q.device)
    else:
        splits = triton.next_power_of_2(max(1, num_splits))
    o_part = torch.empty((batch, splits, heads, v_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, splits, heads), dtype=torch.float32, device=q.device)
    _mla_split_kernel[(batch, splits, groups)](
        q, kv_pool, block_tables, seq_lens, o_part, lse,
        q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        block_tables.stride(0), layer, heads, float(scale),
        R=v_dim, P=q.shape[2] - v_dim, HALF=kv_pool.shape[-1], BLOCK_SIZE=block_size, BLOCK_H=block_h,
        BLOCK_N=16, NUM_SPLITS=splits, PRECISION=dot_precision(q.dtype), num_warps=4, **pdl_kwargs(q.device),
    )  # fmt: skip
    return o_part, lse


# Tokens up to which the prologue and the value projection run their own kernels (decode steps, MTP and
# speculative verification). Each 16-token block re-reads its head's W_uk / W_uv chunks from L2, so a long
# prompt would read them hundreds of times where the reference's batched matmuls read them about once a
# 128-token tile: longer passes (prefill) take the reference composed of the Triton norm, RoPE and pool-write
# kernels and cuBLAS.
MLA_FUSED_MAX_TOKENS = 64


@triton.jit
def _mla_prologue_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, w_ptr, pool_ptr, slots_ptr, out_ptr,
    num_tokens, stride_qt, stride_kvt, stride_cs, stride_wh, stride_wn, stride_ot, stride_oh,
    stride_pb, stride_pl, stride_ph, stride_pt, layer, eps,
    NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, RC: tl.constexpr, NC: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    c = tl.program_id(2)
    t_mask = t < num_tokens
    t64 = t.to(tl.int64)
    q_row = q_ptr + t64[:, None] * stride_qt + h * (NOPE + ROPE)
    out_row = out_ptr + t64[:, None] * stride_ot + h * stride_oh
    pdl_wait(USE_PDL)
    if c < NC:  # a chunk of the absorbed query: q_nope [BLOCK_T, NOPE] @ W_uk[h, :, chunk]
        n = tl.arange(0, NOPE)
        cols = c * RC + tl.arange(0, RC)
        w = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + cols[None, :])
        q_nope = tl.load(q_row + n[None, :], mask=t_mask[:, None], other=0.0)
        q_lat = tl.dot(q_nope, w, input_precision=PRECISION)
        tl.store(out_row + cols[None, :], q_lat.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])
    else:  # the rotary query of head h; head 0's program also writes the tokens' latents
        HR: tl.constexpr = ROPE // 2
        j = tl.arange(0, HR)
        pos = tl.load(pos_ptr + t64, mask=t_mask, other=0).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos[:, None] * stride_cs + j[None, :], mask=t_mask[:, None], other=0.0)
        sin = tl.load(
            cos_sin_ptr + pos[:, None] * stride_cs + HR + j[None, :], mask=t_mask[:, None], other=0.0
        )
        x1 = tl.load(q_row + NOPE + j[None, :], mask=t_mask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(q_row + NOPE + HR + j[None, :], mask=t_mask[:, None], other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_row + R + j[None, :], (x1 * cos - x2 * sin).to(dt), mask=t_mask[:, None])
        tl.store(out_row + R + HR + j[None, :], (x2 * cos + x1 * sin).to(dt), mask=t_mask[:, None])
        if h == 0:
            slot = tl.load(slots_ptr + t64, mask=t_mask, other=-1).to(tl.int64)
            live = t_mask & (slot >= 0)
            dest = (
                pool_ptr
                + (slot // BLOCK_SIZE) * stride_pb
                + layer * stride_pl
                + (slot % BLOCK_SIZE) * stride_pt
            )
            # A latent column c sits in the pool's K half below HALF, in its V half (at c - HALF) from there.
            r = tl.arange(0, R)
            x = tl.load(kv_ptr + t64[:, None] * stride_kvt + r[None, :], mask=t_mask[:, None], other=0.0)
            xf = x.to(tl.float32)
            normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / R + eps)[:, None]
            # As the reference: normalised values rounded to the activations' dtype, then times the weight.
            weight = tl.load(norm_ptr + r)
            pt = pool_ptr.dtype.element_ty
            latent = to_pool((normed.to(x.dtype) * weight).to(x.dtype), pt, 1.0)
            r_off = tl.where(r < HALF, r, stride_ph + r - HALF)
            tl.store(dest[:, None] + r_off[None, :], latent, mask=live[:, None])
            k1 = tl.load(kv_ptr + t64[:, None] * stride_kvt + R + j[None, :], mask=t_mask[:, None], other=0.0)
            k2 = tl.load(
                kv_ptr + t64[:, None] * stride_kvt + R + HR + j[None, :], mask=t_mask[:, None], other=0.0
            )
            k1 = k1.to(x.dtype).to(tl.float32)
            k2 = k2.to(x.dtype).to(tl.float32)
            c1 = R + j
            c2 = R + HR + j
            o1 = tl.where(c1 < HALF, c1, stride_ph + c1 - HALF)
            o2 = tl.where(c2 < HALF, c2, stride_ph + c2 - HALF)
            tl.store(
                dest[:, None] + o1[None, :],
                to_pool((k1 * cos - k2 * sin).to(x.dtype), pt, 1.0),
                mask=live[:, None],
            )
            tl.store(
                dest[:, None] + o2[None, :],
                to_pool((k2 * cos + k1 * sin).to(x.dtype), pt, 1.0),
                mask=live[:, None],
            )


def mla_prologue_triton(
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
    """``mla_prologue_torch`` in one launch: program ``(token block, head, chunk)`` computes a chunk of
    the head's absorbed query for up to 16 tokens (one ``tl.dot`` against ``W_uk``'s chunk, read once for
    them), and a last program per head rotates the head's rotary query (head 0's also normalises the tokens'
    latents, rotates their keys and writes both into the pool). Passes of more than
    ``MLA_FUSED_MAX_TOKENS`` tokens and shapes outside the kernel's powers of two take the reference
    composed of the Triton norm, RoPE and pool-write kernels (no host synchronisation, so CUDA graphs
    capture it too)."""
    t, heads = q.shape[0], w_kv.shape[0]
    rank = w_kv.shape[2]
    rope = kv.shape[1] - rank
    nope = q.shape[1] // heads - rope
    half = kv_pool.shape[-1]
    if (
        t > MLA_FUSED_MAX_TOKENS
        or not (_pow2(nope) and _pow2(rope) and _pow2(rank) and nope >= 16 and rank >= 16 and rope >= 2)
        or (
            kv_pool.shape[4] != 1
            or 2 * half != rank + rope
            or w_kv.stride(2) != 1
            or kv_pool.dtype not in (q.dtype, *FP8_KV_DTYPES)
        )
    ):
        return mla_prologue_composed(q, kv, positions, cos_sin, norm_weight, eps, w_kv, kv_pool, layer,
                                     slot_mapping, rms_norm_triton, apply_rope_triton, write_kv_triton)  # fmt: skip
    out = q.new_empty((t, heads, rank + rope))
    if t == 0:
        return out
    q = q if q.stride(1) == 1 else q.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    chunk = min(64, rank)
    block_t = 16
    _mla_prologue_kernel[(triton.cdiv(t, block_t), heads, rank // chunk + 1)](
        q, kv, positions, cos_sin, norm_weight, w_kv, kv_pool, slot_mapping, out,
        t, q.stride(0), kv.stride(0), cos_sin.stride(0), w_kv.stride(0), w_kv.stride(1), out.stride(0),
        out.stride(1), kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), layer, float(eps),
        NOPE=nope, ROPE=rope, R=rank, HALF=half, BLOCK_SIZE=kv_pool.shape[3], BLOCK_T=block_t, RC=chunk,
        NC=rank // chunk, PRECISION=dot_precision(q.dtype), num_warps=4, **pdl_kwargs(q.device),
    )  # fmt: skip
    return out


@triton.jit
def _mla_value_kernel(
    o_ptr, w_ptr, out_ptr, num_tokens, stride_ot, stride_oh, stride_wh, stride_wn, stride_outt,
    V_OFF: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, VC: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    v = tl.program_id(2) * VC + tl.arange(0, VC)
    t_mask = t < num_tokens
    t64 = t.to(tl.int64)
    r = tl.arange(0, R)
    pdl_wait(USE_PDL)
    w = tl.load(w_ptr + h * stride_wh + (V_OFF + v[None, :]) * stride_wn + r[:, None])  # [R, VC]
    o = tl.load(
        o_ptr + t64[:, None] * stride_ot + h * stride_oh + r[None, :], mask=t_mask[:, None], other=0.0
    )
    out = tl.dot(o, w, input_precision=PRECISION)
    dest = out_ptr + t64[:, None] * stride_outt + h * V + v[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])


def mla_value_proj_triton(o: torch.Tensor, w_kv: torch.Tensor, v_dim: int) -> torch.Tensor:
    """``mla_value_proj_torch`` in one launch: program ``(token block, head, v chunk)`` multiplies up to 16
    tokens' latent outputs by the chunk's value rows (read once for them). Passes of more than
    ``MLA_FUSED_MAX_TOKENS`` tokens and other shapes take the reference."""
    t, heads, rank = o.shape
    if (
        t > MLA_FUSED_MAX_TOKENS
        or not (_pow2(rank) and _pow2(v_dim) and rank >= 16 and v_dim >= 16)
        or o.stride(2) != 1
        or w_kv.stride(2) != 1
    ):
        return mla_value_proj_torch(o, w_kv, v_dim)
    out = o.new_empty((t, heads * v_dim))
    if t == 0:
        return out
    chunk = min(32, v_dim)
    block_t = 16
    _mla_value_kernel[(triton.cdiv(t, block_t), heads, v_dim // chunk)](
        o, w_kv, out, t, o.stride(0), o.stride(1), w_kv.stride(0), w_kv.stride(1), out.stride(0),
        V_OFF=w_kv.shape[1] - v_dim, V=v_dim, R=rank, BLOCK_T=block_t, VC=chunk,
        PRECISION=dot_precision(o.dtype), num_warps=4, **pdl_kwargs(o.device),
    )  # fmt: skip
    return out


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kv_ptr, kp_ptr, out_ptr, o32_ptr, lse_ptr,
    n, q_pos0, k0, n_keys, num_heads,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_kvt, stride_kpt, stride_ot, stride_oh, scale,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    row_mask = rows < n
    pos = q_pos0 + rows  # the queries' positions in the sequence
    dn = tl.arange(0, NOPE)
    dp = tl.arange(0, ROPE)
    dv = tl.arange(0, V)
    qn = tl.load(
        qn_ptr + rows[:, None] * stride_qnt + h * stride_qnh + dn[None, :], mask=row_mask[:, None], other=0.0
    )
    qp = tl.load(
        qp_ptr + rows[:, None] * stride_qpt + h * stride_qph + dp[None, :], mask=row_mask[:, None], other=0.0
    )
    state = rows * num_heads + h
    if FIRST:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V], tl.float32)
    else:  # the earlier key chunks' normalised output and log-sum-exp: weight 1 at m = lse
        m = tl.load(lse_ptr + state, mask=row_mask, other=0.0)
        l_sum = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.load(o32_ptr + state[:, None] * V + dv[None, :], mask=row_mask[:, None], other=0.0)
    # The chunk's keys (positions k0 + j) that the block's last query can see.
    hi = tl.minimum(n_keys, q_pos0 + tl.program_id(0) * BLOCK_M + BLOCK_M - k0)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_mask = j < n_keys
        key = kv_ptr + j[:, None] * stride_kvt + h * (NOPE + V)
        kn = tl.load(key + dn[None, :], mask=j_mask[:, None], other=0.0)
        kp = tl.load(kp_ptr + j[:, None] * stride_kpt + dp[None, :], mask=j_mask[:, None], other=0.0)
        scores = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
        scores += tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
        seen = j_mask[None, :] & ((k0 + j)[None, :] <= pos[:, None])
        scores = tl.where(seen, scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(probs, axis=1)
        v = tl.load(key + NOPE + dv[None, :], mask=j_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(l_sum, 1e-30)[:, None]
    if LAST:
        dest = out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :]
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        tl.store(o32_ptr + state[:, None] * V + dv[None, :], out, mask=row_mask[:, None])
        tl.store(lse_ptr + state, m + tl.log(tl.maximum(l_sum, 1e-30)), mask=row_mask)


# The most bytes of up-projected keys and values the unabsorbed prefill holds at once (a longer context is
# attended in key chunks, each merged into the running output and log-sum-exp).
PREFILL_KEY_CHUNK_BYTES = 256 << 20


def mla_prefill_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    seq_len: int,
    w_kv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``mla_prefill_torch``'s contract: the context's latents gathered and widened to the queries' dtype,
    up-projected by one GEMM (cuBLAS) into every head's keys and values, then a causal flash-attention kernel
    (program: a block of query tokens of one head; the rotary key shared by the heads). Contexts whose keys
    and values exceed ``PREFILL_KEY_CHUNK_BYTES`` go in key chunks, the running output and log-sum-exp
    kept in float32 between them. Shapes outside the kernel's (power-of-two parts of at least 16) take the
    reference."""
    n, heads, nope = q_nope.shape
    rope, rank = q_pe.shape[2], w_kv.shape[2]
    v_dim = w_kv.shape[1] - nope
    if (
        not all(_pow2(d) and d >= 16 for d in (nope, rope, v_dim))
        or kv_pool.shape[4] != 1
        or q_nope.stride(2) != 1
        or q_pe.stride(2) != 1
    ):
        return mla_prefill_torch(q_nope, q_pe, kv_pool, layer, block_table, seq_len, w_kv, scale)
    out = q_nope.new_empty((n, heads, v_dim))
    if n == 0:
        return out
    latent = context_latents(kv_pool, layer, block_table, seq_len).to(q_nope.dtype)
    k_pe = latent[:, rank:]
    w = w_kv.reshape(heads * (nope + v_dim), rank)
    chunk = max(64, PREFILL_KEY_CHUNK_BYTES // (heads * (nope + v_dim) * q_nope.element_size()))
    o32 = lse = out  # unused with one chunk
    if seq_len > chunk:
        o32 = torch.empty((n, heads, v_dim), dtype=torch.float32, device=out.device)
        lse = torch.empty((n, heads), dtype=torch.float32, device=out.device)
    block_m, block_n, warps = (64, 64, 4) if q_nope.is_cuda else (16, 16, 4)
    for k0 in range(0, seq_len, chunk):
        k1 = min(seq_len, k0 + chunk)
        kv = torch.matmul(latent[k0:k1, :rank], w.t())  # [keys, H * (nope + v_dim)]
        _mla_prefill_kernel[(triton.cdiv(n, block_m), heads)](
            q_nope, q_pe, kv, k_pe[k0:k1], out, o32, lse, n, seq_len - n, k0, k1 - k0, heads,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), k_pe.stride(0),
            out.stride(0), out.stride(1), float(scale),
            NOPE=nope, ROPE=rope, V=v_dim, BLOCK_M=block_m, BLOCK_N=block_n, FIRST=k0 == 0, LAST=k1 == seq_len,
            PRECISION=dot_precision(q_nope.dtype), num_warps=warps,
        )  # fmt: skip
    return out
