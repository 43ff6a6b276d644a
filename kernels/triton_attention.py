"""Paged causal attention over the block-major KV pool: Triton kernels with the semantics of
``kernels/attention.py`` (one entry point for prefill, chunked prefill with a cached prefix, and decode).

Two kernel families, chosen from tensor shapes only (no host synchronisation):

* **Decode** (``T <= B``, i.e. about one query token per sequence): split-KV "flash decoding".
  Stage 1, grid ``(T, num_kv_heads, num_splits)``: one program takes one query token and all query heads
  that share one KV head (``tl.dot`` over a ``[heads, D] x [D, BLOCK_N]`` tile), walks its split of the
  keys through the block table with an online softmax, and writes a partial output and its log-sum-exp.
  Stage 2, grid ``(T, Hq)``: merges the splits by log-sum-exp. Each program finds its sequence by a
  binary search over ``query_start_loc``, so the kernel stays exact for any query lengths (it is simply
  slow for long ones). The split count depends on shapes and an optional ``max_seq_len`` only, so a
  decode step can be captured in a CUDA graph.
* **Extend** (prefill / chunked prefill): grid ``(T // BLOCK_M + B, Hq)``, one tile of up to
  ``BLOCK_M`` query tokens of one sequence per program (the tile-to-sequence map is a binary search over
  ``query_start_loc[b] // BLOCK_M + b``, as in vLLM's unified attention, so the grid needs no lengths
  from the device). Loop 1 walks the cached prefix without a mask, loop 2 the new tokens with the causal
  mask, one online softmax over both. Surplus programs exit at once.

The pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` is addressed through its
strides, and one key is located per token (``block_tables[b, pos // block_size]``), so any block size and
any scattered block table work. Softmax runs in base 2 with the scale folded in; accumulation is fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention import check_out
from kernels.kv_cache import FP8_KV_DTYPES, check_kv_scales, inv_scale
from kernels.triton_device import dot_precision, pdl_kwargs, pdl_wait, sm_count
from kernels.triton_kv_cache import pool_strides
from kernels.triton_prologue import _kv_heads, _norm_rotate, qkv_prologue_triton


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2
    # Over a float8 pool read as words (long splits only): 0.5-1.5% shorter steps at 64-256 x 4k than 2
    # stages (H200, two rounds each, performance.md "Twenty-fifth run"); 55 KB of shared memory a program.
    words_num_stages: int = 3
    min_tokens_per_split: int = 128  # 256 was 8% slower at bs 1, ctx 4k (docs/kernels.md)
    max_splits: int = 32
    # One query token (a batch-1 decode step): 64 against 32 made the step at 4k 2.55 -> 2.43 ms (Qwen3-30B-
    # A3B) and 4.10 -> 4.05 (Llama-3.1-8B), 512 unchanged; at two tokens 64 lost 2% at 512 (3.35 -> 3.41 ms,
    # Qwen3-30B-A3B), so it stays 32 there (H200, two rounds each, performance.md "Thirty-fourth run").
    max_splits_one_token: int = 64


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64  # query tokens per program
    block_n: int = 64  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2


# Module-level so that benchmarks/kernel_bench.py can sweep them; see docs/kernels.md for the numbers.
DECODE_CONFIG = DecodeConfig()
EXTEND_CONFIG = ExtendConfig()


@triton.jit
def _find_seq(qsl_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_seqs) with qsl[b] // BLOCK_Q + (b if BLOCK_Q > 1 else 0) <= target."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        key = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 1:
            key = key // BLOCK_Q + mid
        if key <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q,
    acc,
    l_i,
    m_i,
    k_base,
    v_base,
    bt_row_ptr,
    start,
    limit,
    q_pos,
    scale_log2,
    stride_pool_block,
    stride_pool_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N) (those < limit) for a query tile."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < limit
    dims = tl.arange(0, BLOCK_D)
    page = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = page * stride_pool_block + (pos % BLOCK_SIZE) * stride_pool_slot
    kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    qd = _dot_operand(q, k.dtype)
    s = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=DOT_PRECISION) * scale_log2
    mask = valid[None, :]
    if CAUSAL:
        mask = mask & (pos[None, :] <= q_pos[:, None])
    p, alpha, m_new = _softmax_step(tl.where(mask, s, float("-inf")), m_i)
    v = tl.load(v_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(qd.dtype), v.to(qd.dtype), input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, l_i, m_new


@triton.jit
def _dot_operand(q, kv_dtype: tl.constexpr):
    """q as the dots take it, for a pool of ``kv_dtype``: as it is over a pool of q's dtype; over a float8
    pool, in float16 when q is 16-bit. Every e4m3 value is exact in float16, and the e4m3 -> float16 cast is one instruction for two
    values on the GPU, where casting to bfloat16 goes through float32 (the first fp8 kernels, widening to
    bf16, were slower than the bf16 pool: 14.5 against 12.8 ms a step, Llama-3.1-8B shape, 64 x 4k). A
    bfloat16 q is exact in float16 but for magnitudes past float16's range (65504, never an attention
    query's) or below its normal ones (6e-5, which add nothing a dot product keeps)."""
    out = q
    if (kv_dtype == tl.float8e4nv or kv_dtype == tl.float8e5) and q.dtype != tl.float32:  # static; one type
        out = q.to(tl.float16)
    return out


@triton.jit
def _widen_fp8_words(x, PAIR: tl.constexpr):
    """The four float8 bytes of each int32 in x as four float16s (``cvt.rn.f16x2.<PAIR>``, sm_89+)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi; .reg .b16 x, y; mov.b32 {x, y}, $4; cvt.rn.f16x2." + PAIR + " lo, x; "
        "cvt.rn.f16x2." + PAIR + " hi, y; mov.b32 {$0, $1}, lo; mov.b32 {$2, $3}, hi; }",
        "=h,=h,=h,=h,r",
        [x],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _load_fp8_words(base, offs, valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys or values [len(offs), BLOCK_D] of a float8 pool (e4m3 or e5m2), in float16 (exactly): read as
    4-byte words and widened in registers before any layout change (``cvt.rn.f16x2.e4m3x2`` or
    ``.e5m2x2``, sm_89+; no interpreter).

    Loaded as float8 and cast (``x.to(float16)``), each tile reaches the keys' dot as bytes through shared
    memory and is cast there. The four halves widened from a word are rejoined in registers, which Triton
    does not move back past the asm: the keys go from registers into their dot as they are, the values
    through shared memory in float16. Since the values pass ``_opaque`` on both paths the two run close,
    the words 1.5-2.5% faster at 64-256 x 4k (before it, 550 against 768 loop instructions and the words
    made fp8 steps faster than bf16's; docs/kernels.md, "A float8 KV pool"). Offsets and HEAD_DIM are
    multiples of 4 (the launcher checks)."""
    WORDS: tl.constexpr = BLOCK_D // 4
    words = tl.arange(0, WORDS)
    mask = valid[:, None] & (words[None, :] < HEAD_DIM // 4)
    x = tl.load(
        base.to(tl.pointer_type(tl.int32)) + (offs // 4)[:, None] + words[None, :], mask=mask, other=0
    )
    # Bytes 0..3 of a word are dims 4w..4w+3: $0, $1 from the low half, $2, $3 from the high half.
    if base.dtype.element_ty == tl.float8e5:  # static: the same layout, e5m2's conversion
        d0, d1, d2, d3 = _widen_fp8_words(x, "e5m2x2")
    else:
        d0, d1, d2, d3 = _widen_fp8_words(x, "e4m3x2")
    # join(join(d0, d2), join(d1, d3))[w, j, i] is d(2j + i): dims 4w..4w+3 in order once flattened.
    return tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (offs.shape[0], BLOCK_D))


@triton.jit
def _opaque(x):
    """x itself, through a register move the compiler cannot see through (float16 only; anything else is
    returned as it is).

    For a dot with float16 operands Triton 3.6 picks the operands' register layout (``kWidth``) from the
    narrowest load it finds by walking back from each operand through pure elementwise ops and views, and
    it halves that width again past a ``tl.join``: values widened from float8 (either decode path) are
    taken for 8-bit data and given ``kWidth = 4``, so the softmax weights p went to their dot through
    shared memory and the value tile was reshuffled byte by byte. Behind this move the walk stops at
    float16 and the dot gets ``kWidth = 2``, as over a 16-bit pool: p stays in registers and the values
    load with ``ldmatrix``. The same move on the keys made the steps slower (measured), so only values
    take it (docs/kernels.md, "A float8 KV pool")."""
    if x.dtype == tl.float16:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2
        )
    return x


@triton.jit
def _softmax_step(s, m_i):
    """The online softmax's step over masked scores ``s`` (base 2): their weights, the factor that rescales
    what came before, and the new running maximum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with every key masked so far keeps m = -inf; exponentiate against 0 so it stays at p = 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.exp2(s - m_safe[:, None]), tl.exp2(m_i - m_safe), m_new


@triton.jit
def _split_keys(seq_total, q_start, q_end, token, split, num_splits, BLOCK_N: tl.constexpr):
    """The keys [start, end) a decode split attends for query ``token`` of the sequence whose queries are
    [q_start, q_end) and whose length is seq_total: its causal prefix cut into num_splits whole tiles."""
    kv_len = seq_total - (q_end - q_start) + (token - q_start) + 1
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, kv_len)


@triton.jit
def _attend_keys(
    q,
    acc,
    l_i,
    m_i,
    k_base,
    v_base,
    page,
    pos,
    valid,
    scale_log2,
    stride_pool_block,
    stride_pool_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_WORDS: tl.constexpr,
    OPAQUE_V: tl.constexpr,
):
    """``_attend_tile`` without the causal mask, for decode: the keys' pages are given (loaded a tile
    ahead), and k and v are loaded together, so a tile waits for one memory round trip, not three. With
    FP8_WORDS (a float8 pool on a GPU) k and v come from ``_load_fp8_words``, already in float16. With
    OPAQUE_V (a float8 pool on a GPU, either path) the values reach their dot through ``_opaque``."""
    dims = tl.arange(0, BLOCK_D)
    offs = page.to(tl.int64) * stride_pool_block + (pos % BLOCK_SIZE) * stride_pool_slot
    if FP8_WORDS:
        k = _load_fp8_words(k_base, offs, valid, HEAD_DIM, BLOCK_D)
        v = _load_fp8_words(v_base, offs, valid, HEAD_DIM, BLOCK_D)
    else:
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    qd = _dot_operand(q, k_base.dtype.element_ty)  # the pool's dtype: the words are float16 already
    v = v.to(qd.dtype)
    if OPAQUE_V:
        v = _opaque(v)
    s = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=DOT_PRECISION) * scale_log2
    p, alpha, m_new = _softmax_step(tl.where(valid[None, :], s, float("-inf")), m_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(qd.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _decode_split_kernel(
    q_ptr,
    pool_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    layer,
    scale_log2,
    num_seqs,
    num_splits,
    stride_qt,
    stride_qh,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    stride_bt,
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    qkv_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qkv_t,
    stride_cache,
    eps,
    k_inv_scale,
    v_inv_scale,
    v_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FROM_QKV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_WORDS: tl.constexpr,
    OPAQUE_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Attention of one query token's GROUP q heads (one KV head) over one split of its keys: partial
    output and log-sum-exp into mid_o / mid_lse for ``_decode_merge_kernel``.

    With FROM_QKV the QKV prologue is folded in (``qkv_attention_triton``): q is normalised and rotated
    here from the raw projection, and the program whose split holds a new token's position writes that
    token's k and v for its KV head into the pool first (``kernels.triton_prologue._kv_heads``), then
    reads the split as usual. Only that program reads the position in its own split (others of the same
    sequence that write it write the same values), so a block barrier orders the write before the read.
    """
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Fast path: in a decode batch token t is sequence t's only query; otherwise search for it. The batch
    # metadata is a step input that no kernel of the step writes, so it is read before the PDL wait,
    # while the previous kernel (the QKV prologue) still runs: one dependent round trip less after it.
    seq = token
    q_start = tl.load(qsl_ptr + token)  # pre-wait: step input
    q_end = tl.load(qsl_ptr + token + 1)  # pre-wait: step input
    seq_total = tl.load(seq_lens_ptr + token)  # pre-wait: step input (token < T <= num_seqs here)
    if FROM_QKV:
        HALF: tl.constexpr = HEAD_DIM // 2
        half_dims = tl.arange(0, BLOCK_D // 2)
        pos = tl.load(pos_ptr + token).to(tl.int64)  # pre-wait: step input
        cos = tl.load(cache_ptr + pos * stride_cache + half_dims)[None, :]  # pre-wait: table
        sin = tl.load(cache_ptr + pos * stride_cache + HALF + half_dims)[None, :]  # pre-wait: table
    # The split's keys, and the pages of its first tile (the block table is a step input too): after the
    # wait the tile's keys are one round trip away, not two.
    start, end = _split_keys(seq_total, q_start, q_end, token, split, num_splits, BLOCK_N)  # pre-wait: math
    keys = tl.arange(0, BLOCK_N)
    bt_row_ptr = bt_ptr + token.to(tl.int64) * stride_bt
    first = start + keys
    page = tl.load(bt_row_ptr + first // BLOCK_SIZE, mask=first < end, other=0)  # pre-wait: step input
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    if (q_start > token) | (q_end <= token):
        seq = _find_seq(qsl_ptr, token, num_seqs, 1)
        q_start = tl.load(qsl_ptr + seq)
        q_end = tl.load(qsl_ptr + seq + 1)
        seq_total = tl.load(seq_lens_ptr + seq)
        start, end = _split_keys(seq_total, q_start, q_end, token, split, num_splits, BLOCK_N)
        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
        first = start + keys
        page = tl.load(bt_row_ptr + first // BLOCK_SIZE, mask=first < end, other=0)
    q_len = q_end - q_start

    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_mask = tl.arange(0, BLOCK_H) < GROUP
    dims = tl.arange(0, BLOCK_D)
    q_mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k_base = pool_ptr + layer * stride_pool_layer + kv_head * stride_pool_head
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    # A split past the end of a short sequence (the split count follows the longest possible context, so
    # at short ones most are) reads and writes nothing but its lse of -inf: no q, no keys (its loop is
    # empty), no partial output (the merge does not read it). It holds none of the new tokens, which all
    # lie below kv_len.
    if FROM_QKV:
        q = tl.zeros([BLOCK_H, BLOCK_D], dtype=qkv_ptr.dtype.element_ty)
    else:
        q = tl.zeros([BLOCK_H, BLOCK_D], dtype=q_ptr.dtype.element_ty)
    if start < end:
        if FROM_QKV:
            q_dtype = qkv_ptr.dtype.element_ty
            row = qkv_ptr + token.to(tl.int64) * stride_qkv_t
            src = row + heads[:, None] * HEAD_DIM + half_dims[None, :]
            x1 = tl.load(src, mask=head_mask[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF, mask=head_mask[:, None], other=0.0).to(tl.float32)
            o1, o2 = _norm_rotate(x1, x2, q_norm_ptr, half_dims, cos, sin, eps, HEAD_DIM, HALF, HAS_NORM,
                                  q_dtype, q_dtype)  # fmt: skip
            q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_H, BLOCK_D))  # halves side by side
            # The new tokens of this sequence whose positions fall in this split: k and v into the pool.
            first_new = seq_total - q_len
            for i in range(tl.maximum(start, first_new) - first_new, tl.minimum(end, seq_total) - first_new):
                new_token = (q_start + i).to(tl.int64)
                slot = tl.load(slot_ptr + new_token).to(tl.int64)
                if slot >= 0:  # a negative slot is padding: nothing is written
                    new_pos = tl.load(pos_ptr + new_token).to(tl.int64)
                    new_cos = tl.load(cache_ptr + new_pos * stride_cache + half_dims)[None, :]
                    new_sin = tl.load(cache_ptr + new_pos * stride_cache + HALF + half_dims)[None, :]
                    _kv_heads(qkv_ptr + new_token * stride_qkv_t, pool_ptr, k_norm_ptr, slot, layer,
                              kv_head + tl.arange(0, 1), num_q_heads, num_kv_heads,
                              stride_pool_block, stride_pool_layer, stride_pool_kv, stride_pool_slot, stride_pool_head,
                              half_dims, new_cos, new_sin, eps, k_inv_scale, v_inv_scale, HEAD_DIM, HALF, BLOCK_SIZE,
                              HAS_NORM, q_dtype)  # fmt: skip
            tl.debug_barrier()  # this block's pool writes are visible to its own reads below
        else:
            q = tl.load(
                q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=q_mask,
                other=0.0,
            )
    for n in range(start, end, BLOCK_N):
        key_pos = n + keys
        # The next tile's pages load while this tile's keys do.
        ahead = key_pos + BLOCK_N
        next_page = tl.load(bt_row_ptr + ahead // BLOCK_SIZE, mask=ahead < end, other=0)
        acc, l_i, m_i = _attend_keys(
            q, acc, l_i, m_i, k_base, k_base + stride_pool_kv, page, key_pos, key_pos < end, scale_log2,
            stride_pool_block, stride_pool_slot, BLOCK_SIZE, HEAD_DIM, BLOCK_D, DOT_PRECISION, FP8_WORDS,
            OPAQUE_V,
        )  # fmt: skip
        page = next_page
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale  # a float8 pool's v scale (else 1)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    mo = mid_o_ptr + token.to(tl.int64) * stride_mo_t + split * stride_mo_s
    # An empty split writes no partial output (the interpreter takes no scalar in a mask: hence the where).
    written = head_mask[:, None] & (dims[None, :] < tl.where(start < end, HEAD_DIM, 0))
    tl.store(mo + heads[:, None] * stride_mo_h + dims[None, :], out, mask=written)
    ml = mid_lse_ptr + token.to(tl.int64) * stride_ml_t + split
    tl.store(ml + heads * stride_ml_h, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(
        mid_lse_ptr + token * stride_ml_t + head * stride_ml_h + splits,
        mask=splits < num_splits,
        other=float("-inf"),
    )
    m = tl.max(lse, axis=0)
    weights = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    # An empty split wrote lse = -inf and no output: its rows are not read (weight 0, and no garbage).
    o = tl.load(
        mid_o_ptr + token * stride_mo_t + head * stride_mo_h + splits[:, None] * stride_mo_s + dims[None, :],
        mask=(lse > float("-inf"))[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _extend_kernel(
    q_ptr,
    pool_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    layer,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    stride_bt,
    stride_ot,
    stride_oh,
    v_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m_block = tile - (q_start // BLOCK_M + seq)
    if m_block * BLOCK_M >= q_len:
        return
    prefix_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_mask = (rows[:, None] < q_len) & (dims[None, :] < HEAD_DIM)
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )
    q_pos = prefix_len + rows

    kv_head = head // GROUP
    k_base = pool_ptr + layer * stride_pool_layer + kv_head * stride_pool_head
    v_base = k_base + stride_pool_kv
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Loop 1: the cached prefix, visible to every query of the tile.
    for n in range(0, prefix_len, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            q, acc, l_i, m_i, k_base, v_base, bt_row_ptr, n, prefix_len, q_pos, scale_log2,
            stride_pool_block, stride_pool_slot,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, False, DOT_PRECISION,
        )  # fmt: skip
    # Loop 2: the new tokens up to this tile's last query, with the causal mask.
    new_end = prefix_len + tl.minimum(q_len, (m_block + 1) * BLOCK_M)
    for n in range(prefix_len, new_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            q, acc, l_i, m_i, k_base, v_base, bt_row_ptr, n, new_end, q_pos, scale_log2,
            stride_pool_block, stride_pool_slot,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, True, DOT_PRECISION,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # a float8 pool's v scale (else 1)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def num_kv_splits(num_tokens: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per (token, KV head): enough programs for about two waves, at least 128 keys per split, at
    most ``DECODE_CONFIG.max_splits`` (``max_splits_one_token`` for one token).

    A power of two, so few variants are ever compiled; it depends on shapes and ``max_seq_len`` only.
    """
    sms = sm_count(device) if device.type == "cuda" else 4
    by_occupancy = triton.cdiv(2 * sms, max(1, num_tokens * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), DECODE_CONFIG.min_tokens_per_split)
    cap = DECODE_CONFIG.max_splits_one_token if num_tokens == 1 else DECODE_CONFIG.max_splits
    splits = max(1, min(by_occupancy, by_length, cap))
    return triton.next_power_of_2(splits)


def paged_attention_triton(
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
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; block_tables: [B, max_blocks] int32; seq_lens: [B]; query_start_loc: [B+1]. -> [T, Hq, D],
    written into ``out`` where given (q's shape and dtype, unit last stride).

    ``max_seq_len`` (optional, an upper bound on ``seq_lens``) only tunes the decode split count; it
    defaults to ``max_blocks * block_size``, read from shapes. Nothing here reads device values on the host.
    ``k_scale``, ``v_scale``: a float8 pool's KV scales (``kernels.kv_cache``): k_scale is folded into the
    softmax scale, and the output is multiplied by v_scale.
    """
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        check_out(out, q.shape, q.dtype, "attention")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    scales = _Scales(k_scale, v_scale)
    if num_tokens <= num_seqs:
        _decode(
            out, q, None, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale, max_seq_len, scales
        )
        return out

    ecfg = EXTEND_CONFIG
    block_size = kv_pool.shape[3]
    grid = (num_tokens // ecfg.block_m + num_seqs, num_heads)
    _extend_kernel[grid](
        q, kv_pool, block_tables, seq_lens, query_start_loc, out,
        layer, scale * k_scale * math.log2(math.e), num_seqs,
        q.stride(0), q.stride(1), *pool_strides(kv_pool), block_tables.stride(0), out.stride(0), out.stride(1),
        v_scale, GROUP=num_heads // kv_pool.shape[4], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=ecfg.block_m, BLOCK_N=ecfg.block_n, BLOCK_D=_block_d(head_dim),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=ecfg.num_warps, num_stages=ecfg.num_stages,
    )  # fmt: skip
    return out


# Keys a decode split spans at the longest context (max_seq_len / splits) from which it reads a float8 pool
# as words. The words are register loads, which Triton does not request a tile ahead (the cast path's
# float8 tiles go to shared memory asynchronously, num_stages deep), so a split of a few tiles waits a
# memory round trip for each: at batch 1 (32 splits of 256 keys at an 8k limit) the split kernel took
# 12.3 us a layer against 9.7 us (Qwen3-30B-A3B shape, 4k context, H200). Requesting them a tile ahead
# by hand cost 160 registers and the large batches' gain. Long splits (batch 64: one or two a sequence)
# are where the words pay (docs/kernels.md, "A float8 KV pool").
FP8_WORDS_MIN_KEYS = 1024


def fp8_words(kv_pool: torch.Tensor, keys_per_split: int) -> bool:
    """Whether the decode kernel reads this pool through ``_load_fp8_words``: float8 (e4m3 or e5m2) on a
    GPU with the float8 -> float16 conversion instructions (compute capability 8.9+), every head row
    starting on a 4-byte boundary, and splits of at least ``FP8_WORDS_MIN_KEYS`` keys at the longest
    context. Elsewhere (the interpreter included) it loads float8 and casts; both give the same float16
    operands and dots."""
    if kv_pool.dtype not in FP8_KV_DTYPES or kv_pool.device.type != "cuda":
        return False
    if keys_per_split < FP8_WORDS_MIN_KEYS:
        return False
    index = kv_pool.device.index if kv_pool.device.index is not None else torch.cuda.current_device()
    aligned = kv_pool.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in pool_strides(kv_pool))
    return aligned and kv_pool.shape[-1] % 4 == 0 and _capability(index) >= (8, 9)


def opaque_values(kv_pool: torch.Tensor) -> bool:
    """Whether the decode kernel passes the values through ``_opaque`` (inline asm: not the interpreter):
    a float8 pool on a GPU, for both of its paths, which then give the same dots bit for bit."""
    return kv_pool.dtype in FP8_KV_DTYPES and kv_pool.device.type == "cuda"


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _split_scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The split kernel's fp32 partials (module-level so that a test can poison them: an empty split writes
    no partial output, and the merge must not read it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class _Scales:
    """A float8 pool's KV scales for one layer (1.0 and 1.0 for any other pool)."""

    k: float = 1.0
    v: float = 1.0


@dataclass(frozen=True)
class _Prologue:
    """What the split kernel needs to fold the QKV prologue in (``qkv_attention_triton``)."""

    qkv: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float


def _decode(
    out: torch.Tensor,
    q: torch.Tensor | None,
    prologue: _Prologue | None,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
    scales: _Scales,
) -> None:
    """The split-KV decode attention into ``out`` [T, Hq, D], from q, or from the raw QKV projection with the
    prologue folded into the split kernel (exactly one of ``q`` and ``prologue``)."""
    num_tokens, num_heads, head_dim = out.shape
    block_size, num_kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // num_kv_heads
    dcfg = DECODE_CONFIG
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    splits = num_kv_splits(num_tokens, num_kv_heads, max_seq_len, out.device)
    mid_o = _split_scratch((num_tokens, num_heads, splits, head_dim), out.device)
    mid_lse = _split_scratch((num_tokens, num_heads, splits), out.device)
    if prologue is None:
        assert q is not None
        qkv = cache = pos = slots = q  # never read without FROM_QKV
        q_norm = k_norm = q
        eps, stride_qkv, stride_cache, has_norm = 0.0, 0, 0, False
    else:
        qkv, cache = prologue.qkv, prologue.cos_sin_cache
        pos, slots = prologue.positions, prologue.slot_mapping
        has_norm = prologue.q_norm is not None
        q_norm = prologue.q_norm if has_norm else qkv
        k_norm = prologue.k_norm if has_norm else qkv
        eps, stride_qkv, stride_cache = prologue.eps, qkv.stride(0), cache.stride(0)
        q = out  # never read with FROM_QKV
    block_d = _block_d(head_dim)
    words = fp8_words(kv_pool, max_seq_len // splits)
    _decode_split_kernel[(num_tokens, num_kv_heads, splits)](
        q, kv_pool, block_tables, seq_lens, query_start_loc, mid_o, mid_lse,
        layer, scale * scales.k * math.log2(math.e), seq_lens.shape[0], splits,
        q.stride(0), q.stride(1), *pool_strides(kv_pool), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        qkv, pos, slots, cache, q_norm, k_norm, num_heads, num_kv_heads, stride_qkv, stride_cache, eps,
        inv_scale(scales.k), inv_scale(scales.v), scales.v, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=dcfg.block_n,
        DOT_PRECISION=dot_precision(out.dtype), FROM_QKV=prologue is not None, HAS_NORM=has_norm,
        FP8_WORDS=words, OPAQUE_V=opaque_values(kv_pool), **pdl_kwargs(out.device), num_warps=dcfg.num_warps,
        num_stages=dcfg.words_num_stages if words else dcfg.num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(num_tokens, num_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=splits, BLOCK_D=block_d, **pdl_kwargs(out.device), num_warps=4,
    )  # fmt: skip


def qkv_attention_triton(
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
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """``kernels.attention.qkv_attention_torch`` on the GPU: the QKV prologue (which writes k and v into the
    pool) and attention, from the raw projection. In the decode shape (T <= B) the prologue is folded into
    the split kernel: one launch less per layer, and q never goes through memory. Elsewhere, or where the
    fold does not apply (head_dim not a power of two of at least 16, norm weights of another dtype than
    qkv), the prologue kernel and then ``paged_attention_triton``. ``k_scale``, ``v_scale``: a float8
    pool's KV scales (``kernels.kv_cache``)."""
    check_kv_scales(kv_pool.dtype, k_scale, v_scale)
    num_tokens, num_seqs = qkv.shape[0], seq_lens.shape[0]
    foldable = (
        0 < num_tokens <= num_seqs
        and head_dim >= 16
        and head_dim == triton.next_power_of_2(head_dim)
        and (q_norm is None) == (k_norm is None)
        and (q_norm is None or q_norm.dtype == k_norm.dtype == qkv.dtype)
    )
    if not foldable:
        q = qkv_prologue_triton(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, positions,
                                cos_sin_cache, kv_pool, layer, slot_mapping, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        return paged_attention_triton(q, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale,
                                      max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    prologue = _Prologue(
        qkv if qkv.stride(-1) == 1 else qkv.contiguous(),
        positions,
        slot_mapping,
        cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous(),
        q_norm,
        k_norm,
        eps,
    )
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    _decode(out, None, prologue, kv_pool, layer, block_tables, seq_lens, query_start_loc, scale, max_seq_len,
            _Scales(k_scale, v_scale))  # fmt: skip
    return out
