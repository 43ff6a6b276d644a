"""SiLU-and-mul for gated MLPs: Triton kernel with the semantics of ``kernels/activation.py``.

Grid (rows, column tiles). SiLU is computed in fp32 and rounded to the input dtype before the multiply,
as PyTorch's ``F.silu(gate) * up`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_device import pdl_kwargs, pdl_wait


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # programmatic dependent launch: the previous kernel's writes are visible after this
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] (gate || up) -> [..., I]."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, **pdl_kwargs(x.device), num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
