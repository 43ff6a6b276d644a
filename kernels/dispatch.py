"""The expert-parallel exchange's two row ops (``engine/moe/dispatch.py``): PyTorch reference.

- ``pack_rows_torch``: a rank's hidden rows, expert ids and routing weights into one byte buffer, one
  row per token, so that one all-gather carries the three; with ``live``, the ids of padding rows (live 0)
  become -1, so that those rows run on no expert.
- ``local_routing_torch``: from the gathered ids and weights (views into the gathered buffer), the ids of
  this rank's experts (``id - first``, or -1 where another rank holds the expert) and the weights,
  contiguous, as the fused MoE reads them.
"""

from __future__ import annotations

import torch

# Each part starts on a 16-byte boundary and each row on a 128-byte one: the fused MoE reads the gathered
# hidden rows in place, and rows that straddle an extra cache line cost its grouped GEMM, which reads
# every row once per column tile, up to 22% (H200, 128 rows of Qwen3-30B-A3B, 2026-11-30).
PART_ALIGN, ROW_ALIGN = 16, 128


def packed_layout(dtypes_widths: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offsets of the parts (``width`` elements of ``dtype`` each, in order) in a packed row, and
    the row's bytes."""
    offsets = []
    end = 0
    for dtype, width in dtypes_widths:
        start = -(-end // PART_ALIGN) * PART_ALIGN
        offsets.append(start)
        end = start + width * dtype.itemsize
    return offsets, -(-end // ROW_ALIGN) * ROW_ALIGN


def packed_views(packed: torch.Tensor, dtypes_widths: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Views of a [rows, row_bytes] uint8 buffer as its typed parts (``packed_layout``)."""
    offsets, _ = packed_layout(dtypes_widths)
    return [
        packed[:, off : off + width * dtype.itemsize].view(dtype)
        for off, (dtype, width) in zip(offsets, dtypes_widths, strict=True)
    ]


def check_live(live: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``live`` as a 1-D view of its first ``rows`` entries (nonzero: a real row, zero: a padding row; a
    bool mask, or a graph's ``seq_lens``, zero on its padding rows)."""
    if live is None:
        return None
    flat = live.reshape(-1) if live.dim() > 1 else live
    if flat.shape[0] < rows or (live.dim() > 1 and live.shape[-1] != 1):
        raise ValueError(f"pack_rows: live {tuple(live.shape)} does not cover {rows} rows, one value each")
    return flat[:rows]


def pack_rows_torch(
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], live: torch.Tensor | None = None
) -> torch.Tensor:
    """(x, ids, weights), 2-D tensors of the same rows -> [rows, row_bytes] uint8 (``packed_layout``;
    padding bytes not written). ``live`` (at least ``rows`` values, any dtype): where zero, that row's
    ids are packed as -1."""
    live = check_live(live, parts[1].shape[0])
    if live is not None:
        parts = (parts[0], parts[1].masked_fill((live == 0).unsqueeze(1), -1), parts[2])
    layout = [(p.dtype, p.shape[1]) for p in parts]
    packed = torch.empty(
        (parts[0].shape[0], packed_layout(layout)[1]), dtype=torch.uint8, device=parts[0].device
    )
    for view, p in zip(packed_views(packed, layout), parts, strict=True):
        view.copy_(p)
    return packed


def local_routing_torch(
    ids: torch.Tensor, weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] of physical experts (any strides) -> (ids of experts ``first .. first + count - 1`` minus
    ``first``, else -1, contiguous in ids' dtype; weights, contiguous)."""
    local = (ids >= first) & (ids < first + count)
    return torch.where(local, ids - first, -1), weights.contiguous()
