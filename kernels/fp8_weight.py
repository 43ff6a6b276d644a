"""Weights kept in float8 on the device: ``Fp8Weight``, which the linear and MoE ops take where a weight
tensor goes.

A float8 checkpoint (``engine/fp8_weights.py``) or ``quantization="fp8"`` stores each linear weight
[..., N, K] (stacked experts have a leading expert axis) as float8 values with float32 scales, at one
byte a weight instead of two. Two layouts, each a grid of scales over blocks of the weight:

- blocks of ``block = (bn, bk)`` weights (DeepSeek-V3's and Qwen3-FP8's 128 x 128): ``scale`` is
  [..., ceil(N / bn), ceil(K / bk)], edge blocks partial;
- one scale per row (``block = (1, K)``): ``scale`` is [..., N, 1]. Per-tensor and per-channel checkpoints
  take this one (a per-tensor scale repeated down the rows), so fused projections (q || k || v) can hold
  parts with different scales.

The weight stands for ``dequantize()``: each value times its scale in float32, rounded once to the model's
dtype; the PyTorch reference ops compute with exactly that tensor. The Triton kernels read the float8
values and apply the scales to their float32 partial sums instead (a block's sum times its scale), as
float8 GEMMs do: they differ from the reference by the rounding of each weight to the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The scale block's sides the kernels index by shifts: a power of two, at least KERNEL_K_STEP along K (the
# kernels' K steps are this long and never straddle two blocks), or the whole row.
KERNEL_K_STEP = 128


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def kernel_layout_ok(block: tuple[int, int], n: int, k: int) -> bool:
    """Whether the kernels read a weight [n, k] with scales over ``block``: each side the whole weight,
    one row (bn = 1), or a power of two (bk also a multiple of KERNEL_K_STEP)."""
    bn, bk = block

    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    return (bn >= n or pow2(bn)) and (bk >= k or (pow2(bk) and bk % KERNEL_K_STEP == 0))


class Fp8Weight(nn.Module):
    """A weight [..., N, K] as float8 ``weight`` and float32 ``weight_scale`` over blocks of ``block``;
    ``dtype`` is the model's dtype, the one it stands for (module docstring)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        block: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        super().__init__()
        if fp8_dtype not in FP8_WEIGHT_DTYPES:
            raise ValueError(f"float8 weights are {FP8_WEIGHT_DTYPES}, not {fp8_dtype}")
        *lead, n, k = shape
        bn, bk = min(block[0], n), min(block[1], k)
        if not kernel_layout_ok((bn, bk), n, k):
            raise ValueError(f"scale block {block} of a [{n}, {k}] weight is not one the kernels read")
        self.block = (bn, bk)
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(*shape, dtype=fp8_dtype, device=device), requires_grad=False)
        grid = (-(-n // bn), -(-k // bk))
        self.weight_scale = nn.Parameter(
            torch.ones(*lead, *grid, dtype=torch.float32, device=device), requires_grad=False
        )

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dim(self) -> int:
        return self.weight.dim()

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4

    def full_scales(self) -> torch.Tensor:
        """The scale of every weight, float32 [..., N, K]."""
        (n, k), (bn, bk) = self.weight.shape[-2:], self.block
        s = self.weight_scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
        return s[..., :n, :k]

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for: float8 values times their scales in float32, rounded once to ``dtype``."""
        return (self.weight.to(torch.float32) * self.full_scales()).to(self.dtype)

    def views(self, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The values and scales of one stacked expert (of the whole weight where None), as views."""
        if expert is None:
            return self.weight.data, self.weight_scale.data
        return self.weight.data[expert], self.weight_scale.data[expert]

    def block_rows(self, rows: slice | None) -> slice:
        """The rows of the scale grid that weight rows ``rows`` (block-aligned) cover."""
        n, bn = self.weight.shape[-2], self.block[0]
        rows = rows or slice(0, n)
        if rows.start % bn or (rows.stop % bn and rows.stop != n):
            raise ValueError(f"rows {rows.start}:{rows.stop} are not aligned to scale blocks of {bn} rows")
        return slice(rows.start // bn, -(-rows.stop // bn))

    def store_(
        self, values: torch.Tensor, scales: torch.Tensor, rows: slice | None = None, expert: int | None = None
    ) -> None:
        """Store float8 ``values`` [rows, K] with their ``scales`` in this weight's layout (the grid rows that
        ``rows`` cover) into rows ``rows`` (all where None) of expert ``expert``."""
        weight, scale = self.views(expert)
        rows = rows or slice(0, weight.shape[-2])
        grid_rows = self.block_rows(rows)
        if values.shape != weight[rows].shape or scales.shape != scale[grid_rows].shape:
            raise ValueError(
                f"float8 values {tuple(values.shape)} with scales {tuple(scales.shape)} do not fit rows "
                f"{rows.start}:{rows.stop} of {tuple(weight.shape)} with scales {tuple(scale.shape)}"
            )
        weight[rows] = values.to(device=weight.device, dtype=weight.dtype)
        scale[grid_rows] = scales.to(device=scale.device, dtype=torch.float32)

    def quantize_(self, w: torch.Tensor, rows: slice | None = None, expert: int | None = None) -> None:
        """Quantise w (any float dtype; [..., rows, K], with the leading expert axis where ``expert`` is
        None and the weight is stacked) into rows ``rows`` (all where None; block-aligned): each block's
        scale is its largest magnitude over the float8 maximum, values rounded to nearest."""
        weight, scale = self.views(expert)
        rows = rows or slice(0, weight.shape[-2])
        grid_rows = self.block_rows(rows)
        bn, bk = self.block
        w = w.to(device=weight.device, dtype=torch.float32)
        *lead, n, k = w.shape
        gn, gk = -(-n // bn), -(-k // bk)
        pad = torch.zeros(*lead, gn * bn, gk * bk, dtype=torch.float32, device=w.device)
        pad[..., :n, :k] = w.abs()
        amax = pad.reshape(*lead, gn, bn, gk, bk).amax(dim=(-3, -1))
        del pad
        block_scale = (amax / fp8_max(weight.dtype)).clamp(min=torch.finfo(torch.float32).tiny)
        full = block_scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
        weight[..., rows, :] = (w / full).to(weight.dtype)
        scale[..., grid_rows, :] = block_scale

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}, {self.weight.dtype}, block={self.block}, as {self.dtype}"


def as_dense(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """The weight as a tensor of the model's dtype (a float8 one dequantized)."""
    return w.dequantize() if isinstance(w, Fp8Weight) else w


def scale_args(w: Fp8Weight) -> tuple[int, int, int, int, int]:
    """What a kernel indexes a weight's scales by: (stride over experts, stride over row blocks, stride
    over K blocks, rows a block, K a block); a grid side of one block gets stride 0 and side 1, so
    the kernels need no special case for per-row or per-tensor scales."""
    s = w.weight_scale
    gn, gk = s.shape[-2:]
    se = s.stride(0) if s.dim() == 3 else 0
    sn, bn = (s.stride(-2), w.block[0]) if gn > 1 else (0, 1)
    sk, bk = (s.stride(-1), w.block[1]) if gk > 1 else (0, 1)
    return se, sn, sk, bn, bk


@dataclass(frozen=True)
class Fp8Layout:
    """How a model keeps its linear weights in float8: scale blocks of ``block`` (None: one scale a row)."""

    block: tuple[int, int] | None
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def describe(self) -> str:
        blocks = f"{self.block[0]}x{self.block[1]} block" if self.block else "row"
        return f"{str(self.fp8_dtype).removeprefix('torch.')} with a scale per {blocks}"


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A model's parameter of ``shape`` (uninitialised: the loader fills it), without gradients."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def linear_weight(
    shape: tuple[int, ...],
    fp8: Fp8Layout | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Parameter | Fp8Weight:
    """A model's linear weight [..., N, K]: a parameter of ``dtype``, or float8 in ``fp8``'s layout."""
    if fp8 is None:
        return empty_param(*shape, dtype=dtype, device=device)
    return Fp8Weight(shape, fp8.block or (1, shape[-1]), dtype, device, fp8.fp8_dtype)
