"""The expert-parallel exchange's two row ops (``engine/moe/dispatch.py``): PyTorch reference.

- ``pack_rows_torch``: a rank's expert ids, routing weights and hidden rows into one byte buffer, one row
  per token, so that one all-gather carries the three.
- ``local_routing_torch``: from the gathered ids and weights (views into the gathered buffer), the ids of
  this rank's experts (``id - first``, or -1 where another rank holds the expert) and the weights,
  contiguous, as the fused MoE reads them.
"""

from __future__ import annotations

import torch


def packed_views(packed: torch.Tensor, dtypes_widths: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Views of a [rows, row_bytes] uint8 buffer as consecutive typed parts of ``width`` elements each,
    widest element first (so each part's byte offset is a multiple of its element size)."""
    views = []
    offset = 0
    for dtype, width in dtypes_widths:
        nbytes = width * torch.empty((), dtype=dtype).element_size()
        views.append(packed[:, offset : offset + nbytes].view(dtype))
        offset += nbytes
    return views


def packed_row_bytes(parts: tuple[torch.Tensor, ...]) -> int:
    """Bytes of one packed row: the parts' widths, rounded up to a multiple of 8 (every element size)."""
    return -(-sum(p.shape[1] * p.element_size() for p in parts) // 8) * 8


def pack_rows_torch(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """2-D tensors of the same rows, widest element first -> [rows, packed_row_bytes] uint8."""
    n = parts[0].shape[0]
    packed = torch.empty((n, packed_row_bytes(parts)), dtype=torch.uint8, device=parts[0].device)
    for view, p in zip(packed_views(packed, [(p.dtype, p.shape[1]) for p in parts]), parts, strict=True):
        view.copy_(p)
    return packed


def local_routing_torch(
    ids: torch.Tensor, weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] of physical experts (any strides) -> (ids of experts ``first .. first + count - 1`` minus
    ``first``, else -1, contiguous in ids' dtype; weights, contiguous)."""
    local = (ids >= first) & (ids < first + count)
    return torch.where(local, ids - first, -1), weights.contiguous()
