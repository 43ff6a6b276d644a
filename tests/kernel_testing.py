"""What the Triton kernel tests share: the interpreter on machines without a GPU, the device, dtypes and
error bounds, the ``gpu`` markers, NaN-poisoned allocations, the comparison and a paged-attention case.

Without a GPU the kernels run in the interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``);
importing this module then corrects the interpreter's bf16 dot and bf16 rounding to what compiled code does,
for every kernel test alike. A test module that wants poisoned allocations imports the
``poison_allocations`` fixture by name (it is autouse where it is imported, and nowhere else).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance per dtype: |out - ref| <= tol * (|ref| + mean|ref|), ref in float32.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
TOL[torch.float8_e4m3fn] = 2.0**-3  # a float8 KV pool's values: one e4m3 step (3 mantissa bits) apart

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def needs_gpu(fn: Callable[..., None]) -> Callable[..., None]:
    """Both marks at once: selected by ``-m gpu`` and skipped where there is no GPU."""
    return gpu(needs_cuda(fn))


def _fix_interpreter_bf16_dot() -> None:
    """The interpreter stores bf16 as uint16 and its ``tl.dot`` multiplies the bit patterns
    (triton-lang/triton#11584, unsupported upstream). Upcast bf16 dot operands to fp32, as the GPU's
    bf16 MMA with fp32 accumulation computes exact products; the kernels themselves are unchanged."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pdmesh_bf16_dot", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        bf16 = triton.language.bfloat16
        if a.dtype.scalar == bf16:
            a = self.cast_impl(a, triton.language.float32)
        if b.dtype.scalar == bf16:
            b = self.cast_impl(b, triton.language.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._pdmesh_bf16_dot = True


def _fix_interpreter_bf16_rounding() -> None:
    """The interpreter truncates float32 -> bfloat16 casts where the GPU rounds to nearest even (several
    bf16 ulps apart after a kernel's few roundings, e.g. the QKV prologue's three). Round to nearest even,
    as compiled code does, for every kernel test alike; the kernels themselves are unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pdmesh_bf16_rtne", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._pdmesh_bf16_rtne = True


if INTERPRETED:
    _fix_interpreter_bf16_dot()
    _fix_interpreter_bf16_rounding()


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float tensor from torch.empty / empty_like starts as NaN, so unwritten outputs fail."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    out32, ref32 = out.float(), ref.float()
    assert torch.isfinite(out32).all(), f"{what}: non-finite (unwritten?) elements"
    tol = TOL[dtype]
    bound = tol * (ref32.abs() + ref32.abs().mean())
    err = (out32 - ref32).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} is {worst:.2f}x the {dtype} bound"


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def up(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def make_paged_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_layers: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pool with scattered block tables (padded with garbage ids past each sequence's end)."""
    max_blocks = max(triton.cdiv(s, block_size) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 5
    pool = randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=DEVICE)[: len(seq_lens) * max_blocks]
    block_tables = block_tables.view(len(seq_lens), max_blocks).to(torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEVICE)
    qsl[1:] = torch.tensor(q_lens, device=DEVICE).cumsum(0)
    q = randn(sum(q_lens), num_heads, head_dim, dtype=dtype)
    return q, pool, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl
