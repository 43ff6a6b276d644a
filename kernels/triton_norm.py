"""RMSNorm and fused residual-add RMSNorm: Triton kernels with the semantics of ``kernels/norm.py``.

One program normalises one row. Statistics are accumulated in fp32; the normalised row is rounded to the
input dtype before the weight multiply, as the reference (and transformers) do. Inputs are never modified:
the fused variant returns a new ``x + residual`` tensor, like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to its dtype before it is normalised, as in the reference.
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (xf + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
        xf = summed.to(tl.float32)
        in_dtype = sum_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(in_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, hidden] with a unit last stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    summed = torch.empty(x2.shape, dtype=in_dtype, device=x.device) if residual is not None else out
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            out,
            summed,
            hidden,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            summed.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            **pdl_kwargs(x.device),
            num_warps=min(16, max(1, block // 512)),
        )
    out = out.view(x.shape)
    return out, (summed.view(x.shape) if residual is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H] -> [..., H] in promote(weight, x) dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); neither input is modified."""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
