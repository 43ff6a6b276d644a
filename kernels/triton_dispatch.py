"""The expert-parallel exchange's row ops as one launch each, semantics of ``kernels/dispatch.py``.

In a decode graph with several ranks each MoE layer packs the rank's rows before the all-gather and
reads the gathered ids and weights after it. As torch ops those were three copies and eight small
element-wise launches a layer; here each side is one launch (a program per row). The pack also marks the
padding rows' pairs absent (id -1, from ``live``, which a graph's static inputs already hold), so that a
graph's padding rows run on no expert at no extra launch. The gathered hidden rows are read by the fused
MoE in place, through a strided view, with no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import check_live, packed_layout, packed_views


@triton.jit
def _pack_rows_kernel(
    ids_ptr, w_ptr, x_ptr, ids_out, w_out, x_out, live_ptr,
    stride_ids, stride_w, stride_x, stride_ids_out, stride_w_out, stride_x_out, stride_live,
    top_k, hidden,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_LIVE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < top_k
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=k_mask)
    if HAS_LIVE:  # a padding row (live 0): its pairs run on no expert
        ids = tl.where(tl.load(live_ptr + row * stride_live) != 0, ids, -1)
    tl.store(ids_out + row * stride_ids_out + ks, ids, k_mask)
    tl.store(w_out + row * stride_w_out + ks, tl.load(w_ptr + row * stride_w + ks, mask=k_mask), k_mask)
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < hidden
        tl.store(x_out + row * stride_x_out + hs, tl.load(x_ptr + row * stride_x + hs, mask=h_mask), h_mask)


def pack_rows_triton(
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], live: torch.Tensor | None = None
) -> torch.Tensor:
    """(x [T, H], ids [T, k], weights [T, k]), last dimensions contiguous -> [T, row] uint8, as
    ``pack_rows_torch`` (``live`` likewise)."""
    x, ids, weights = parts
    if any(p.stride(-1) != 1 for p in parts):
        raise ValueError("pack_rows: parts must be contiguous in their last dimension")
    n, top_k = ids.shape
    live = check_live(live, n)
    hidden = x.shape[1]
    layout = [(p.dtype, p.shape[1]) for p in parts]
    packed = torch.empty((n, packed_layout(layout)[1]), dtype=torch.uint8, device=x.device)
    if n == 0:
        return packed
    x_out, ids_out, w_out = packed_views(packed, layout)
    _pack_rows_kernel[(n,)](
        ids, weights, x, ids_out, w_out, x_out, ids if live is None else live,
        ids.stride(0), weights.stride(0), x.stride(0), ids_out.stride(0), w_out.stride(0), x_out.stride(0),
        0 if live is None else live.stride(0), top_k, hidden,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_H=min(4096, triton.next_power_of_2(hidden)),
        HAS_LIVE=live is not None, num_warps=4,
    )  # fmt: skip
    return packed


@triton.jit
def _local_routing_kernel(
    ids_ptr, w_ptr, ids_out, w_out, stride_ids, stride_w, top_k, first, count, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < top_k
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=k_mask)
    local = (ids >= first) & (ids < first + count)
    tl.store(
        ids_out + row * top_k + ks, tl.where(local, ids - first, -1).to(ids_out.dtype.element_ty), k_mask
    )
    tl.store(w_out + row * top_k + ks, tl.load(w_ptr + row * stride_w + ks, mask=k_mask), k_mask)


def local_routing_triton(
    ids: torch.Tensor, weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``local_routing_torch``: one launch, ids and weights with any row stride (contiguous rows)."""
    n, top_k = ids.shape
    local_ids = torch.empty((n, top_k), dtype=ids.dtype, device=ids.device)
    local_w = torch.empty((n, top_k), dtype=weights.dtype, device=weights.device)
    if n:
        if ids.stride(-1) != 1 or weights.stride(-1) != 1:
            raise ValueError("local_routing: ids and weights must be contiguous in their last dimension")
        _local_routing_kernel[(n,)](
            ids, weights, local_ids, local_w, ids.stride(0), weights.stride(0), top_k, first, count,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
        )  # fmt: skip
    return local_ids, local_w
