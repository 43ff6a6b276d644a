"""``kernels.copy_rows`` in one pass: program (row pair, chunk) reads its chunk of a source row and writes it
to the destination row, the rows seen as 32-bit words where their bytes allow (wide loads), else bytes.

On an H100 the slot-by-slot copies it replaces (a snapshot of each source, then a copy: four launches an
expert slot) moved expert weights at 11-17% of the copy rate (performance.md, "Expert placements").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.copy_rows import as_byte_rows, check_copy_rows, copy_rows_torch

CHUNK_BYTES = 32 * 1024  # a program's share of a row


@triton.jit
def _copy_rows_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, WORDS, stride_src, stride_dst,
                      BLOCK: tl.constexpr):  # fmt: skip
    pair, chunk = tl.program_id(0), tl.program_id(1)
    s = tl.load(src_rows_ptr + pair).to(tl.int64)
    d = tl.load(dst_rows_ptr + pair).to(tl.int64)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WORDS
    v = tl.load(src_ptr + s * stride_src + offs, mask=mask, cache_modifier=".cg")
    tl.store(dst_ptr + d * stride_dst + offs, v, mask=mask, cache_modifier=".cs")


def _as_word_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as [rows, words]: 32-bit words where a row's bytes are a multiple of 4."""
    rows = as_byte_rows(t)
    if rows.shape[1] % 4 == 0 and rows.data_ptr() % 4 == 0:
        rows = rows.view(torch.int32)
    return rows


def copy_rows_triton(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """One kernel for tensors on one device (the reference otherwise)."""
    check_copy_rows(src, src_rows, dst, dst_rows)
    n = src_rows.numel()
    if n == 0:
        return
    if src.device != dst.device:
        copy_rows_torch(src, src_rows, dst, dst_rows)
        return
    s, d = _as_word_rows(src), _as_word_rows(dst)
    if s.dtype != d.dtype:  # one of them not 4-byte aligned
        s, d = s.view(torch.uint8), d.view(torch.uint8)
    words = s.shape[1]
    block = min(CHUNK_BYTES // s.element_size(), triton.next_power_of_2(words))
    grid = (n, triton.cdiv(words, block))
    _copy_rows_kernel[grid](
        s, src_rows.to(s.device), d, dst_rows.to(s.device), words, s.stride(0), d.stride(0),
        BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
