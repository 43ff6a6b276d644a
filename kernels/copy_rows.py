"""Copying rows between tensors by index: PyTorch reference (the op table's ``copy_rows``).

``copy_rows(src, src_rows, dst, dst_rows)`` writes ``dst[dst_rows[i]] = src[src_rows[i]]`` for every i, the
rows of both tensors taken as their first dimension (any dtype, float8 included; the two tensors' rows hold
the same bytes). ``dst_rows`` are distinct. Where ``src`` is ``dst``, no written row may be read by the same
call (the caller orders its copies so: ``engine/moe/rebalance.py``). Expert placements move expert weights
so, a call a tensor and layer instead of a copy a slot.
"""

from __future__ import annotations

import torch


def copy_rows_torch(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """Two passes (a gather into a temporary, then a scatter), over the rows' bytes (so every dtype):
    contiguous ``src`` and ``dst``."""
    check_copy_rows(src, src_rows, dst, dst_rows)
    if src_rows.numel():
        rows = as_byte_rows(src).index_select(0, src_rows.to(src.device))
        as_byte_rows(dst).index_copy_(0, dst_rows.to(dst.device), rows.to(dst.device))


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as [rows, bytes] (a view)."""
    if not t.is_contiguous():
        raise ValueError("copy_rows needs contiguous tensors")
    return t.view(t.shape[0], -1).view(torch.uint8)


def check_copy_rows(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"copy_rows: rows of {tuple(src.shape[1:])} {src.dtype} into rows of {tuple(dst.shape[1:])} {dst.dtype}"
        )
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(
            f"copy_rows: {tuple(src_rows.shape)} source rows for {tuple(dst_rows.shape)} destinations"
        )
