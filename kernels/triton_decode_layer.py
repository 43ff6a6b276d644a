"""One mixture-of-experts decoder layer for one token, as one persistent Triton kernel.

Why: at decode batch 1 a Qwen3-30B-A3B layer moves ~113 MB of weights (27 us at the H200's copy rate)
but took ~53 us as eleven launches (add+norm, QKV GEMV, prologue, attention split and merge, o GEMV,
add+norm, router GEMV, routing, expert gate-up, expert down). Each launch costs 1.5-3 us of ramp and tail
even with programmatic dependent launch, and the small ones (norms, prologue, routing, merge) move almost
no bytes. Here the whole layer is one launch of a grid that fits on the GPU at once: its programs walk
seven phases and wait for each other at a grid-wide barrier between phases (six barriers), and the small
steps ride inside the large ones:

1. every program computes ``x + residual`` and its RMSNorm itself (8 KB from L2), then its share of the
   QKV GEMV rows;
2. attention, one item per (KV head, KV split): the item recomputes q-norm and RoPE for its group's q
   heads; the item whose split holds the new token also norms, rotates and writes the new k and v to the
   pool before it reads its keys; each item writes a partial output and log-sum-exp (flash decoding);
3. merge of the splits, one item per q head;
4. the o-projection GEMV;
5. every program adds the residual and norms again; the router GEMV;
6. every program picks the top-k experts from the router logits itself (program 0 publishes them and
   counts them for EPLB), then its share of the experts' gate-up rows, with SiLU-and-mul;
7. the experts' down rows, weighted by the routing weights and summed over the top-k.

GEMV phases hand out tiles of whole rows round-robin and keep the next two tiles in flight while one
reduces; a phase's first tiles are loaded before the barrier that opens it where they do not depend on it
(o-projection, router, experts' down rows). The barrier is one int32 counter per model (``sync``): a program arrives with a release atomic and
spins on volatile loads until all programs of the barrier have arrived; the last program out resets the
counter, so the next launch starts from zero. Data written during the launch is read with ``.cg`` loads
(L2, never a stale L1 line). Co-residency, which the barrier needs, is guaranteed by sizing the grid from
the compiled kernel's registers and shared memory (``_resident_programs``).

Numerics follow the unfused layer's rounding points op by op (bf16 sums, norm outputs, GEMV outputs,
routing weights, SiLU and the products), with fp32 accumulation; only summation orders differ.

Measured (H200, ``benchmarks/kernel_bench.py --fused-layer``, 2026-11-29, 8 layers per CUDA graph): it is
**slower** than the eleven launches, 62-68 us per layer against 54 us at 512 tokens of context, so it is
off by default. The programs' timer stamps give the split (us, 512 context): QKV 9.2, attention 4.4,
merge 1.5-3.1, o-projection 4.4, norm+router 1.3, gate-up 21-24, down 9-18, and 1.3-2.0 per barrier
(~9 in all). The GEMV phases reach only 2-3 TB/s: the kernel's worst phases (attention, down) need
~220-250 registers, so two 4-warp programs fit per SM, and with one or two register tiles in flight per
program an SM keeps too few bytes outstanding; capping registers (168, 128) spills and was slower still
(76-96 us). The op-by-op kernels run thousands of small programs, many per SM, which the hardware
overlaps. A persistent layer that wins would need loads staged through shared memory (TMA or cp.async
pipelines) rather than registers, and cheaper barriers than a grid-wide one per phase.

``phased=True`` launches the seven phases as seven launches of the same kernel without barriers: the
Triton interpreter (CPU tests) runs programs one after another, where a barrier would never open.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_attention import _attend_tile, num_kv_splits
from kernels.triton_device import pdl_kwargs, sm_count
from kernels.triton_kv_cache import pool_strides
from kernels.triton_prologue import _norm_rotate

NUM_PHASES = 7
# Off: on the H200 the fused layer measured slower than the layer op by op (see the module docstring).
# ``kernel_bench.py --fused-layer`` and ``gpu_bench.py --fused-layer`` turn it on to measure it.
FUSED_DECODE_LAYER_ENABLED = False
# Elements of one weight tile (rows x padded K): 8192 bf16 = 16 KB per tile, two in flight per program.
_TILE_ELEMENTS = 8192
# Keys per attention step: 32 rather than the standalone kernel's 64 keeps the attention phase at ~170
# registers instead of 255 with spills (the grid's programs per SM follow the kernel's worst phase).
_ATTENTION_BLOCK_N = 32
# Largest padded operand a program holds in registers (the down phase's top-k x I tile).
_MAX_TILE_ELEMENTS = 8192
_NUM_WARPS = 4
_PROGRAMS_PER_SM = 8
# Register cap per thread (None: the compiler's choice). Programs per SM follow the registers.
_MAXNREG: int | None = None


@dataclass(frozen=True)
class MoEDecodeLayerWeights:
    """What the fused layer reads of one decoder layer (the tensors the unfused layer uses, by reference)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hk) D, H]
    q_norm: torch.Tensor | None  # [D] (Qwen3) or None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [E, H] router
    w13: torch.Tensor  # [P, 2I, H]
    w2: torch.Tensor  # [P, H, I]
    logical_to_physical: torch.Tensor  # [E, R] int64
    replica_counts: torch.Tensor  # [E] int64
    expert_counts: torch.Tensor  # [P] int64, += 1 per routed pair
    num_heads: int
    num_kv_heads: int
    head_dim: int
    top_k: int
    renormalize: bool
    eps: float


def unsupported_reason(w: MoEDecodeLayerWeights, x: torch.Tensor, kv_pool: torch.Tensor) -> str | None:
    """Why the fused kernel cannot run this layer (None: it can). Callers fall back to the unfused ops."""
    hidden = w.qkv.shape[1]
    inter = w.w2.shape[2]
    if x.dim() != 2 or x.shape[0] != 1:
        return "one token only"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"activations must be bf16 or fp16, not {x.dtype}"
    if any(t.dtype != x.dtype for t in (w.qkv, w.o_proj, w.gate, w.w13, w.w2, w.input_norm, w.post_norm)):
        return "weights and activations must share a dtype"
    if w.head_dim % 2:
        return "RoPE needs an even head_dim"
    if (w.q_norm is None) != (w.k_norm is None):
        return "q_norm and k_norm come together"
    if w.num_heads % w.num_kv_heads:
        return "query heads must group evenly over KV heads"
    widths = (
        triton.next_power_of_2(hidden),
        triton.next_power_of_2(w.num_heads * w.head_dim),
        triton.next_power_of_2(w.top_k) * triton.next_power_of_2(inter),
    )
    if max(widths) > _MAX_TILE_ELEMENTS:
        return f"operands too wide for one program's registers ({widths})"
    if any(t.stride(-1) != 1 for t in (w.qkv, w.o_proj, w.gate, w.w13, w.w2)):
        return "weights must be contiguous in their last dimension"
    if kv_pool.shape[4] != w.num_kv_heads or kv_pool.shape[5] != w.head_dim:
        return "KV pool shape does not match the layer"
    return None


# ---------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _grid_sync(sync_ptr, target):
    """Grid-wide barrier: wait until ``target`` arrivals are counted at ``sync_ptr`` (this one included).
    Every program's earlier global writes are visible to every program after it."""
    tl.debug_barrier()  # the whole program has finished its stores
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")  # scalar: one thread per program
    seen = tl.load(sync_ptr, volatile=True)
    while seen < target:
        seen = tl.load(sync_ptr, volatile=True)
    tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(timing_ptr, slot, pid, nprog, TIMING: tl.constexpr):
    """With TIMING, record the global timer (ns) as ``timing[slot, pid]`` (benchmarks' phase breakdown)."""
    if TIMING:
        tl.store(timing_ptr + slot * nprog + pid, tl.extra.cuda.globaltimer())


@triton.jit
def _add_norm(x_ptr, res_ptr, w_ptr, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """(rms_norm(x + residual) * w, x + residual) of one row, rounded like ``kernels/triton_norm.py``."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    xf = tl.load(x_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        xf = (xf + r).to(dtype).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(dtype), xf.to(dtype)


@triton.jit
def _row_tile(w_ptr, tile, n_rows, k, stride_w, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [tile * ROWS, +ROWS) of w, [ROWS, BLOCK_K], zero past n_rows and k."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :],
        mask=(rows < n_rows)[:, None] & (cols < k)[None, :],
        other=0.0,
    )


@triton.jit
def _gemv_rows(
    xv,
    w0,
    w1,
    w_ptr,
    out_ptr,
    n_rows,
    k,
    stride_w,
    pid,
    num_programs,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r] = xv . w[r] (fp32 accumulation, rounded to out's dtype) for the row tiles pid, pid + P, ...;
    xv: [BLOCK_K] fp32, zero past k. ``w0``, ``w1``: the program's first two tiles, loaded by the caller
    (before the barrier that makes xv ready, where it can); two tiles stay in flight while one reduces."""
    offs_r = tl.arange(0, ROWS)
    for tile in range(pid, tl.cdiv(n_rows, ROWS), num_programs):
        w2 = _row_tile(w_ptr, tile + 2 * num_programs, n_rows, k, stride_w, ROWS, BLOCK_K)
        rows = tile * ROWS + offs_r
        acc = tl.sum(w0.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < n_rows)
        w0 = w1
        w1 = w2


@triton.jit
def _down_tile(base, rows, wmask, hidden, stride_n):
    """Rows ``rows`` of every chosen expert's down weights, [top-k, rows, I] (``base`` points at each
    expert's first row and I columns); masked past ``hidden`` and past the top-k and I (``wmask``)."""
    return tl.load(
        base + rows.to(tl.int64)[None, :, None] * stride_n,
        mask=wmask & (rows < hidden)[None, :, None],
        other=0.0,
    )


@triton.jit
def _gate_up_tile(w13_ptr, item, n_items, physical, inter, hidden, stride_e, stride_n, TOP_K: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HID: tl.constexpr):  # fmt: skip
    """Gate rows and the matching up rows of item (tile = item // TOP_K, pair = item % TOP_K), each
    [ROWS, BLOCK_HID]; all masked for an item past n_items."""
    slots = tl.arange(0, BLOCK_K)
    expert = tl.sum(tl.where(slots == item % TOP_K, physical, 0), axis=0)
    rows = tl.where(item < n_items, (item // TOP_K) * ROWS + tl.arange(0, ROWS), inter)
    cols = tl.arange(0, BLOCK_HID)
    ptrs = w13_ptr + expert * stride_e + rows.to(tl.int64)[:, None] * stride_n + cols[None, :]
    mask = (rows < inter)[:, None] & (cols < hidden)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + inter * stride_n, mask=mask, other=0.0)


@triton.jit
def _top_k(logits_ptr, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_K: tl.constexpr):  # fmt: skip
    """Softmax top-k of one token's router logits, as ``kernels/triton_moe_routing.py`` picks them
    (order by logit, ties to the lowest index). Returns (weights [BLOCK_K] fp32, logical ids [BLOCK_K])."""
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    expert_mask = experts < num_experts
    logits = tl.load(logits_ptr + experts, mask=expert_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    logits = tl.where(expert_mask, logits, float("-inf"))
    row_max = tl.max(logits, axis=0)
    denom = tl.sum(tl.exp(logits - row_max), axis=0)
    available = expert_mask
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_e = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        candidates = tl.where(available, logits, float("-inf"))
        best = tl.max(candidates, axis=0)
        choice = tl.min(tl.where(available & (candidates == best), experts, BLOCK_E), axis=0)
        choice = tl.minimum(choice, num_experts - 1)  # a NaN row matches nothing: stay in bounds
        available = available & (experts != choice)
        top_w = tl.where(slots == j, tl.exp(best - row_max) / denom, top_w)
        top_e = tl.where(slots == j, choice.to(tl.int64), top_e)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), axis=0)
    return top_w, top_e


# ---------------------------------------------------------------------------------------------------------
# The kernel


@triton.jit(do_not_specialize=["layer"])
def _moe_decode_layer_kernel(
    # inputs
    x_ptr,
    res_ptr,
    pos_ptr,
    slot_ptr,
    seq_len_ptr,
    bt_ptr,
    cos_sin_ptr,
    # weights
    ln1_ptr,
    wqkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    wo_ptr,
    ln2_ptr,
    wgate_ptr,
    w13_ptr,
    w2_ptr,
    l2p_ptr,
    replica_counts_ptr,
    counts_ptr,
    # state and scratch
    pool_ptr,
    sync_ptr,
    timing_ptr,
    r1_ptr,
    qkv_ptr,
    q_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    attn_ptr,
    o_ptr,
    xn2_ptr,
    logits_ptr,
    topk_w_ptr,
    topk_id_ptr,
    act_ptr,
    # outputs
    res_out_ptr,
    out_ptr,
    # sizes and strides
    layer,
    hidden,
    inter,
    num_experts,
    num_splits,
    eps,
    scale_log2,
    stride_cache,
    stride_w13_e,
    stride_w13_n,
    stride_w2_e,
    stride_w2_n,
    stride_l2p,
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_slot,
    stride_pool_head,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROWS_QKV: tl.constexpr,
    ROWS_O: tl.constexpr,
    ROWS_GATE: tl.constexpr,
    ROWS_DOWN: tl.constexpr,
    PHASE: tl.constexpr,
    TIMING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """PHASE 0: all phases with grid barriers between them; 1..7: that phase alone (no barrier)."""
    if USE_PDL:  # programmatic dependent launch: the previous kernel's writes are visible after this
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    GROUP: tl.constexpr = HQ // HKV
    q_size = HQ * HEAD_DIM
    qkv_rows = (HQ + 2 * HKV) * HEAD_DIM
    _stamp(timing_ptr, 0, pid, nprog, TIMING)

    # ---- 1: x + residual, RMSNorm, QKV ----------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 1):
        wq0 = _row_tile(wqkv_ptr, pid, qkv_rows, hidden, hidden, ROWS_QKV, BLOCK_HID)
        wq1 = _row_tile(wqkv_ptr, pid + nprog, qkv_rows, hidden, hidden, ROWS_QKV, BLOCK_HID)
        xn, r1 = _add_norm(x_ptr, res_ptr, ln1_ptr, hidden, eps, HAS_RESIDUAL, BLOCK_HID)
        if pid == 0:
            cols1 = tl.arange(0, BLOCK_HID)
            tl.store(r1_ptr + cols1, r1, mask=cols1 < hidden)
        _gemv_rows(xn.to(tl.float32), wq0, wq1, wqkv_ptr, qkv_ptr, qkv_rows, hidden, hidden, pid, nprog,
                   ROWS_QKV, BLOCK_HID)  # fmt: skip
    if PHASE == 0:
        _stamp(timing_ptr, 1, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 1 * nprog)
        _stamp(timing_ptr, 2, pid, nprog, TIMING)

    # ---- 2: q/k norm + RoPE, new k/v into the pool, attention over one KV split ----------------------
    if (PHASE == 0) | (PHASE == 2):
        pos = tl.load(pos_ptr).to(tl.int64)
        slot = tl.load(slot_ptr).to(tl.int64)
        kv_len = tl.load(seq_len_ptr)
        split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        dims2 = tl.arange(0, BLOCK_HALF)
        half_mask = dims2 < HALF
        cos = tl.load(cos_sin_ptr + pos * stride_cache + dims2, mask=half_mask, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + dims2, mask=half_mask, other=0.0)[None, :]
        hs2 = tl.arange(0, BLOCK_H)
        full_dims2 = tl.arange(0, BLOCK_D)
        for item in range(pid, HKV * num_splits, nprog):
            kv_head = item // num_splits
            split = item % num_splits
            start2 = split * split_len
            end2 = tl.minimum(start2 + split_len, kv_len)
            # q heads of this KV head: norm and rotate, rounded as the prologue does, into q (every split
            # of the head writes the same values).
            heads2 = kv_head * GROUP + hs2
            q_mask2 = (hs2 < GROUP)[:, None] & half_mask[None, :]
            src2 = qkv_ptr + heads2[:, None] * HEAD_DIM + dims2[None, :]
            x1 = tl.load(src2, mask=q_mask2, other=0.0, cache_modifier=".cg").to(tl.float32)
            x2 = tl.load(src2 + HALF, mask=q_mask2, other=0.0, cache_modifier=".cg").to(tl.float32)
            q1, q2 = _norm_rotate(x1, x2, q_norm_ptr, dims2, cos, sin, eps, HEAD_DIM, HALF, HAS_QK_NORM,
                                  dtype, q_ptr.dtype.element_ty)  # fmt: skip
            dst2 = q_ptr + heads2[:, None] * HEAD_DIM + dims2[None, :]
            tl.store(dst2, q1, mask=q_mask2)
            tl.store(dst2 + HALF, q2, mask=q_mask2)
            k_base = pool_ptr + layer * stride_pool_layer + kv_head * stride_pool_head
            if (start2 <= kv_len - 1) & (kv_len - 1 < end2) & (slot >= 0):
                # The split holding the new token writes its k (norm, rotate) and v into the pool first.
                one = hs2 < 1
                kv_mask = one[:, None] & half_mask[None, :]
                k_src = qkv_ptr + q_size + kv_head * HEAD_DIM + hs2[:, None] * 0 + dims2[None, :]
                k1 = tl.load(k_src, mask=kv_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                k1, k2 = _norm_rotate(k1, k2, k_norm_ptr, dims2, cos, sin, eps, HEAD_DIM, HALF, HAS_QK_NORM,
                                      dtype, q_ptr.dtype.element_ty)  # fmt: skip
                v_src = k_src + HKV * HEAD_DIM
                v1 = tl.load(v_src, mask=kv_mask, other=0.0, cache_modifier=".cg")
                v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0, cache_modifier=".cg")
                pool_dtype = pool_ptr.dtype.element_ty
                kdst = (
                    k_base
                    + (slot // BLOCK_SIZE) * stride_pool_block
                    + (slot % BLOCK_SIZE) * stride_pool_slot
                    + hs2[:, None] * 0
                    + dims2[None, :]
                )
                tl.store(kdst, k1.to(pool_dtype), mask=kv_mask)
                tl.store(kdst + HALF, k2.to(pool_dtype), mask=kv_mask)
                tl.store(kdst + stride_pool_kv, v1.to(pool_dtype), mask=kv_mask)
                tl.store(kdst + stride_pool_kv + HALF, v2.to(pool_dtype), mask=kv_mask)
            tl.debug_barrier()  # this program's q (and k/v) stores are visible to all its threads
            full_mask = (hs2 < GROUP)[:, None] & (full_dims2[None, :] < HEAD_DIM)
            q = tl.load(q_ptr + heads2[:, None] * HEAD_DIM + full_dims2[None, :], mask=full_mask, other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            for n in range(start2, end2, BLOCK_N):
                acc, l_i, m_i = _attend_tile(
                    q, acc, l_i, m_i, k_base, k_base + stride_pool_kv, bt_ptr, n, end2, m_i, scale_log2,
                    stride_pool_block, stride_pool_slot,
                    BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, False, "tf32",
                )  # fmt: skip
            has_keys = l_i > 0.0
            out2 = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            mo = mid_o_ptr + (heads2[:, None] * num_splits + split) * HEAD_DIM + full_dims2[None, :]
            tl.store(mo, out2, mask=full_mask)
            tl.store(mid_lse_ptr + heads2 * num_splits + split, lse2, mask=hs2 < GROUP)
            tl.debug_barrier()  # the next item's q stores must not overtake this item's q loads
    if PHASE == 0:
        _stamp(timing_ptr, 3, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 2 * nprog)
        _stamp(timing_ptr, 4, pid, nprog, TIMING)

    # ---- 3: merge the splits, one q head per item -----------------------------------------------------
    if (PHASE == 0) | (PHASE == 3):
        splits3 = tl.arange(0, BLOCK_S)
        full_dims3 = tl.arange(0, BLOCK_D)
        for head in range(pid, HQ, nprog):
            s_mask3 = splits3 < num_splits
            lse3 = tl.load(mid_lse_ptr + head * num_splits + splits3, mask=s_mask3, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            m3 = tl.max(lse3, axis=0)
            weights3 = tl.exp2(lse3 - tl.where(m3 == float("-inf"), 0.0, m3))
            o3 = tl.load(
                mid_o_ptr + (head * num_splits + splits3[:, None]) * HEAD_DIM + full_dims3[None, :],
                mask=s_mask3[:, None] & (full_dims3[None, :] < HEAD_DIM),
                other=0.0,
                cache_modifier=".cg",
            )
            total3 = tl.sum(weights3, axis=0)
            merged3 = tl.sum(weights3[:, None] * o3, axis=0) / tl.where(total3 > 0.0, total3, 1.0)
            tl.store(attn_ptr + head * HEAD_DIM + full_dims3, merged3.to(dtype), mask=full_dims3 < HEAD_DIM)
    if (PHASE == 0) | (PHASE == 4):  # the o-projection's first tiles need no activation: load them now
        wo0 = _row_tile(wo_ptr, pid, hidden, q_size, q_size, ROWS_O, BLOCK_Q)
        wo1 = _row_tile(wo_ptr, pid + nprog, hidden, q_size, q_size, ROWS_O, BLOCK_Q)
    if PHASE == 0:
        _stamp(timing_ptr, 5, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 3 * nprog)
        _stamp(timing_ptr, 6, pid, nprog, TIMING)

    # ---- 4: o-projection ------------------------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 4):
        cols4 = tl.arange(0, BLOCK_Q)
        av = tl.load(attn_ptr + cols4, mask=cols4 < q_size, other=0.0, cache_modifier=".cg").to(tl.float32)
        _gemv_rows(av, wo0, wo1, wo_ptr, o_ptr, hidden, q_size, q_size, pid, nprog, ROWS_O, BLOCK_Q)
        wr0 = _row_tile(wgate_ptr, pid, num_experts, hidden, hidden, 1, BLOCK_HID)
        wr1 = _row_tile(wgate_ptr, pid + nprog, num_experts, hidden, hidden, 1, BLOCK_HID)
    if PHASE == 0:
        _stamp(timing_ptr, 7, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 4 * nprog)
        _stamp(timing_ptr, 8, pid, nprog, TIMING)

    # ---- 5: o + residual, RMSNorm, router -------------------------------------------------------------
    if PHASE == 5:
        wr0 = _row_tile(wgate_ptr, pid, num_experts, hidden, hidden, 1, BLOCK_HID)
        wr1 = _row_tile(wgate_ptr, pid + nprog, num_experts, hidden, hidden, 1, BLOCK_HID)
    if (PHASE == 0) | (PHASE == 5):
        xn2, r2 = _add_norm(o_ptr, r1_ptr, ln2_ptr, hidden, eps, True, BLOCK_HID)
        if pid == 0:
            cols5 = tl.arange(0, BLOCK_HID)
            tl.store(res_out_ptr + cols5, r2, mask=cols5 < hidden)
            tl.store(xn2_ptr + cols5, xn2, mask=cols5 < hidden)
        _gemv_rows(xn2.to(tl.float32), wr0, wr1, wgate_ptr, logits_ptr, num_experts, hidden, hidden, pid, nprog,
                   1, BLOCK_HID)  # fmt: skip
    if PHASE == 0:
        _stamp(timing_ptr, 9, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 5 * nprog)
        _stamp(timing_ptr, 10, pid, nprog, TIMING)

    # ---- 6: top-k, experts' gate-up with SiLU-and-mul -------------------------------------------------
    if (PHASE == 0) | (PHASE == 6):
        top_w, top_e = _top_k(logits_ptr, num_experts, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        slots6 = tl.arange(0, BLOCK_K)
        slot_mask6 = slots6 < TOP_K
        # Replica (token % replicas) of each chosen expert: token 0 here, so the first replica.
        physical6 = tl.load(l2p_ptr + top_e * stride_l2p, mask=slot_mask6, other=0).to(tl.int64)
        if pid == 0:
            tl.store(topk_w_ptr + slots6, top_w.to(topk_w_ptr.dtype.element_ty), mask=slot_mask6)
            tl.store(topk_id_ptr + slots6, physical6, mask=slot_mask6)
            ones = tl.full([BLOCK_K], 1, dtype=counts_ptr.dtype.element_ty)
            tl.atomic_add(counts_ptr + physical6, ones, mask=slot_mask6, sem="relaxed")
        cols6 = tl.arange(0, BLOCK_HID)
        k_mask6 = cols6 < hidden
        xv = tl.load(xn2_ptr + cols6, mask=k_mask6, other=0.0, cache_modifier=".cg").to(tl.float32)
        tiles_per_expert = tl.cdiv(inter, ROWS_GATE)
        n_items = TOP_K * tiles_per_expert
        # Item = (tile, pair), the pair fastest; two items' rows are in flight while one reduces.
        g0, u0 = _gate_up_tile(w13_ptr, pid, n_items, physical6, inter, hidden, stride_w13_e, stride_w13_n,
                               TOP_K, ROWS_GATE, BLOCK_K, BLOCK_HID)  # fmt: skip
        g1, u1 = _gate_up_tile(w13_ptr, pid + nprog, n_items, physical6, inter, hidden, stride_w13_e,
                               stride_w13_n, TOP_K, ROWS_GATE, BLOCK_K, BLOCK_HID)  # fmt: skip
        offs_r6 = tl.arange(0, ROWS_GATE)
        for item in range(pid, n_items, nprog):
            g2, u2 = _gate_up_tile(w13_ptr, item + 2 * nprog, n_items, physical6, inter, hidden, stride_w13_e,
                                   stride_w13_n, TOP_K, ROWS_GATE, BLOCK_K, BLOCK_HID)  # fmt: skip
            pair6 = item % TOP_K
            rows6 = (item // TOP_K) * ROWS_GATE + offs_r6
            gate = tl.sum(g0.to(tl.float32) * xv[None, :], axis=1).to(dtype).to(tl.float32)
            up = tl.sum(u0.to(tl.float32) * xv[None, :], axis=1).to(dtype).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            tl.store(act_ptr + pair6 * inter + rows6, (silu * up).to(dtype), mask=rows6 < inter)
            g0 = g1
            u0 = u1
            g1 = g2
            u1 = u2
        # The down phase's first tiles: its experts are known now, its activations after the barrier.
        offs_r7 = tl.arange(0, ROWS_DOWN)
        icols = tl.arange(0, BLOCK_I)
        base7 = w2_ptr + physical6[:, None, None] * stride_w2_e + icols[None, None, :]
        wmask7 = slot_mask6[:, None, None] & (icols < inter)[None, None, :]
        rows7 = pid * ROWS_DOWN + offs_r7
        wd0 = _down_tile(base7, rows7, wmask7, hidden, stride_w2_n)
        rows7 = rows7 + nprog * ROWS_DOWN
        wd1 = _down_tile(base7, rows7, wmask7, hidden, stride_w2_n)
    if PHASE == 0:
        _stamp(timing_ptr, 11, pid, nprog, TIMING)
        _grid_sync(sync_ptr, 6 * nprog)
        _stamp(timing_ptr, 12, pid, nprog, TIMING)

    # ---- 7: experts' down rows, weighted and summed over the top-k ------------------------------------
    if (PHASE == 0) | (PHASE == 7):
        slots7 = tl.arange(0, BLOCK_K)
        slot_mask7 = slots7 < TOP_K
        experts7 = tl.load(topk_id_ptr + slots7, mask=slot_mask7, other=0, cache_modifier=".cg").to(tl.int64)
        weights7 = tl.load(topk_w_ptr + slots7, mask=slot_mask7, other=0.0, cache_modifier=".cg")
        offs_r7 = tl.arange(0, ROWS_DOWN)
        icols = tl.arange(0, BLOCK_I)
        i_mask = icols < inter
        base7 = w2_ptr + experts7[:, None, None] * stride_w2_e + icols[None, None, :]
        wmask7 = slot_mask7[:, None, None] & i_mask[None, None, :]
        if PHASE == 7:
            rows7 = pid * ROWS_DOWN + offs_r7
            wd0 = _down_tile(base7, rows7, wmask7, hidden, stride_w2_n)
            rows7 = rows7 + nprog * ROWS_DOWN
            wd1 = _down_tile(base7, rows7, wmask7, hidden, stride_w2_n)
        a7 = tl.load(act_ptr + slots7[:, None] * inter + icols[None, :], mask=slot_mask7[:, None] & i_mask[None, :],
                     other=0.0, cache_modifier=".cg")  # fmt: skip
        aw7 = a7[:, None, :]  # [K, 1, I], kept in its 16-bit dtype: fewer registers
        wk7 = weights7.to(tl.float32)[:, None]
        for tile in range(pid, tl.cdiv(hidden, ROWS_DOWN), nprog):
            rows7 = (tile + 2 * nprog) * ROWS_DOWN + offs_r7
            wd2 = _down_tile(base7, rows7, wmask7, hidden, stride_w2_n)
            rows7 = tile * ROWS_DOWN + offs_r7
            acc7 = tl.sum(tl.sum(wd0.to(tl.float32) * aw7.to(tl.float32), axis=2) * wk7, axis=0)
            tl.store(out_ptr + rows7, acc7.to(out_ptr.dtype.element_ty), mask=rows7 < hidden)
            wd0 = wd1
            wd1 = wd2
    if PHASE == 0:  # noqa: SIM102  (a constexpr test: phased launches must not emit the atomics)
        _stamp(timing_ptr, 13, pid, nprog, TIMING)
        # Leave: the last program out resets the counter for the next launch.
        if tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == 7 * nprog - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")


# ---------------------------------------------------------------------------------------------------------
# Host side


# Grid of the fused launch per compiled variant (a warm-up compile reads its registers and shared memory).
_GRIDS: dict[tuple, int] = {}


def _rows_per_tile(k: int) -> int:
    return max(1, _TILE_ELEMENTS // triton.next_power_of_2(k))


@functools.cache
def _resident_programs(device_index: int, n_regs: int, shared: int, num_warps: int) -> int:
    """Programs of this kernel that fit on the GPU at once (all of them must, or a barrier never opens)."""
    props = torch.cuda.get_device_properties(device_index)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    warp_regs = math.ceil(max(1, n_regs) * 32 / 256) * 256  # allocated per warp, 256 at a time
    by_regs = regs_per_sm // (warp_regs * num_warps)
    by_threads = threads_per_sm // (32 * num_warps)
    by_smem = smem_per_sm // (shared + 1024) if shared else by_threads
    per_sm = max(0, min(by_regs, by_threads, by_smem, _PROGRAMS_PER_SM))
    if per_sm == 0:
        raise RuntimeError(f"the fused decode layer does not fit on an SM ({n_regs} registers, {shared} B)")
    return per_sm * props.multi_processor_count


def moe_decode_layer_triton(
    w: MoEDecodeLayerWeights,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sync: torch.Tensor,
    *,
    phased: bool = False,
    num_programs: int | None = None,
    timing: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE decoder layer of one token: returns (MoE output, residual after attention), as
    ``DecoderLayer.forward`` does. ``sync``: an int32 [1] counter, zero, owned by the model and used by
    one stream at a time. ``phased``: seven barrier-free launches (the interpreter); ``num_programs``
    overrides the grid of a phased launch. ``timing``: int64 [14, programs] to receive each program's
    global-timer stamps (start, arrival at and departure from each barrier, end), for benchmarks."""
    reason = unsupported_reason(w, x, kv_pool)
    if reason is not None:
        raise ValueError(f"the fused decode layer cannot run this layer: {reason}")
    device = x.device
    hidden = x.shape[1]
    inter = w.w2.shape[2]
    num_experts = w.gate.shape[0]
    q_size = w.num_heads * w.head_dim
    dtype = x.dtype
    block_size = kv_pool.shape[3]
    splits = num_kv_splits(1, w.num_kv_heads, block_tables.shape[1] * block_size, device)
    q_dtype = dtype if w.q_norm is None else torch.promote_types(w.q_norm.dtype, dtype)
    f32 = torch.float32
    scratch = {
        "r1": torch.empty(hidden, dtype=dtype, device=device),
        "qkv": torch.empty(w.qkv.shape[0], dtype=dtype, device=device),
        "q": torch.empty(q_size, dtype=q_dtype, device=device),
        "mid_o": torch.empty(w.num_heads * splits * w.head_dim, dtype=f32, device=device),
        "mid_lse": torch.empty(w.num_heads * splits, dtype=f32, device=device),
        "attn": torch.empty(q_size, dtype=dtype, device=device),
        "o": torch.empty(hidden, dtype=dtype, device=device),
        "xn2": torch.empty(hidden, dtype=dtype, device=device),
        "logits": torch.empty(num_experts, dtype=dtype, device=device),
        "topk_w": torch.empty(w.top_k, dtype=dtype, device=device),
        "topk_id": torch.empty(w.top_k, dtype=torch.int64, device=device),
        "act": torch.empty(w.top_k * inter, dtype=dtype, device=device),
    }
    res_out = torch.empty((1, hidden), dtype=dtype, device=device)
    out = torch.empty((1, hidden), dtype=dtype, device=device)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    norm_q = w.q_norm if w.q_norm is not None else w.input_norm  # never read without HAS_QK_NORM
    norm_k = w.k_norm if w.k_norm is not None else w.input_norm
    block_hid = triton.next_power_of_2(hidden)
    block_q = triton.next_power_of_2(q_size)
    block_i = triton.next_power_of_2(inter)
    args = [
        x, residual if residual is not None else x, positions, slot_mapping, seq_lens, block_tables, cache,
        w.input_norm, w.qkv, norm_q, norm_k, w.o_proj, w.post_norm, w.gate, w.w13, w.w2,
        w.logical_to_physical, w.replica_counts, w.expert_counts,
        kv_pool, sync, timing if timing is not None else sync, *scratch.values(), res_out, out,
        layer, hidden, inter, num_experts, splits, w.eps, w.head_dim**-0.5 * math.log2(math.e),
        cache.stride(0), w.w13.stride(0), w.w13.stride(1), w.w2.stride(0), w.w2.stride(1),
        w.logical_to_physical.stride(0), *pool_strides(kv_pool),
    ]  # fmt: skip
    constexprs = dict(
        HQ=w.num_heads,
        HKV=w.num_kv_heads,
        HEAD_DIM=w.head_dim,
        TOP_K=w.top_k,
        RENORMALIZE=w.renormalize,
        HAS_RESIDUAL=residual is not None,
        HAS_QK_NORM=w.q_norm is not None,
        BLOCK_SIZE=block_size,
        BLOCK_HID=block_hid,
        BLOCK_Q=block_q,
        BLOCK_I=block_i,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(w.top_k),
        BLOCK_H=max(16, triton.next_power_of_2(w.num_heads // w.num_kv_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(w.head_dim)),
        BLOCK_HALF=triton.next_power_of_2(w.head_dim // 2),
        BLOCK_N=_ATTENTION_BLOCK_N,
        BLOCK_S=triton.next_power_of_2(splits),
        ROWS_QKV=_rows_per_tile(hidden),
        ROWS_O=_rows_per_tile(q_size),
        ROWS_GATE=max(1, _rows_per_tile(hidden) // 2),  # gate and up tiles together
        ROWS_DOWN=max(1, _MAX_TILE_ELEMENTS // (triton.next_power_of_2(w.top_k) * block_i)),
        TIMING=timing is not None,
    )
    if phased:
        grid = (num_programs or (sm_count(device) * _PROGRAMS_PER_SM if device.type == "cuda" else 3),)
        for phase in range(1, NUM_PHASES + 1):
            _moe_decode_layer_kernel[grid](
                *args, **constexprs, PHASE=phase, USE_PDL=False, num_warps=_NUM_WARPS
            )
        return out, res_out
    if device.type != "cuda":
        raise ValueError("the fused decode layer's barriers need a GPU; use phased=True elsewhere")
    pdl = pdl_kwargs(device)
    launch = dict(pdl, num_warps=_NUM_WARPS)
    if _MAXNREG is not None:
        launch["maxnreg"] = _MAXNREG
    key = (device.index, tuple(constexprs.items()), tuple(launch.items()), dtype, kv_pool.dtype)
    programs = _GRIDS.get(key)
    if programs is None:
        kernel = _moe_decode_layer_kernel.warmup(*args, **constexprs, PHASE=0, **launch, grid=(1,))
        kernel._init_handles()
        programs = _GRIDS[key] = _resident_programs(
            device.index if device.index is not None else torch.cuda.current_device(),
            kernel.n_regs,
            kernel.metadata.shared,
            _NUM_WARPS,
        )
    _moe_decode_layer_kernel[(programs,)](*args, **constexprs, PHASE=0, **launch)
    return out, res_out
