"""The Triton ``lora_apply`` op (``kernels/triton_lora.py``) against its reference (``kernels/lora.py``).

Without a GPU the kernels run in the interpreter at small shapes (K, M and slots x rank not multiples of the
blocks, several K splits, rows with no adapter, rows past a 16-row tile); the ``gpu``-marked test adds a
Llama-3.1-8B-sized projection at decode batches and CUDA-graph capture. Torch allocations start as NaN
(an unwritten partial fails). The reference runs in float32 on the same (rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

from kernels import triton_lora
from kernels.lora import lora_apply_torch
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
)


def _case(rows: int, k: int, m: int, slots: int, width: int, dtype: torch.dtype, seed: int) -> tuple:
    torch.manual_seed(seed)
    x = randn(rows, k, dtype=dtype)
    a = randn(slots * width, k, dtype=dtype, scale=k**-0.5)
    b = randn(m, slots * width, dtype=dtype, scale=0.5)
    y = randn(rows, m, dtype=dtype)
    which = torch.randint(-1, slots, (rows,), device=DEVICE)  # -1: a row with no adapter
    onehot = torch.zeros(
        (rows + 3, slots), dtype=dtype, device=DEVICE
    )  # longer than the pass, as the engine's
    rows_with = (which >= 0).nonzero().flatten()
    onehot[rows_with, which[rows_with]] = 1
    return x, a, b, onehot, y, which


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "m", "slots", "width"), [(1, 72, 40, 1, 8), (5, 200, 70, 3, 12),
                                                                 (19, 130, 33, 4, 16)])  # fmt: skip
def test_lora_apply_matches_the_reference(
    rows: int, k: int, m: int, slots: int, width: int, dtype: torch.dtype
) -> None:
    x, a, b, onehot, y, which = _case(rows, k, m, slots, width, dtype, seed=rows)
    want = lora_apply_torch(*(t.float() for t in (x, a, b, onehot, y)))
    got = triton_lora.lora_apply_triton(x, a, b, onehot, y.clone())
    assert_close(got, want, dtype, f"lora_apply {rows}x{k} -> {m}, {slots} slots of {width}")
    # A row with no adapter is its projection's output exactly.
    plain = (which < 0).nonzero().flatten()
    assert torch.equal(got[plain], y[plain])


def test_the_triton_backend_takes_the_kernels_up_to_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lora_apply_small`` (the Triton table's op): the two kernels up to ``FASTER_UP_TO`` rows, where an
    H100 ran them faster, the reference beyond."""
    from kernels.triton_ops import TRITON_OPS

    assert TRITON_OPS.lora_apply is triton_lora.lora_apply_small
    calls = []
    kernel = triton_lora.lora_apply_triton
    monkeypatch.setattr(triton_lora, "lora_apply_triton", lambda *a: calls.append(1) or kernel(*a))
    for rows in (1, triton_lora.FASTER_UP_TO, triton_lora.FASTER_UP_TO + 1):
        x, a, b, onehot, y, _ = _case(rows, 40, 24, 2, 8, torch.float32, seed=rows)
        got = triton_lora.lora_apply_small(x, a, b, onehot, y.clone())
        assert_close(got, lora_apply_torch(x, a, b, onehot, y.clone()), torch.float32, f"{rows} rows")
    assert len(calls) == 2


def test_large_passes_and_odd_layouts_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    launched = []
    shrink = triton_lora._lora_shrink_kernel

    class Recording:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                launched.append(grid)
                shrink[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_lora, "_lora_shrink_kernel", Recording())
    x, a, b, onehot, y, _ = _case(3, 40, 24, 2, 8, torch.float32, seed=7)
    triton_lora.lora_apply_triton(x, a, b, onehot, y.clone())
    assert len(launched) == 1
    big = torch.zeros((triton_lora.MAX_ROWS + 1, 40), device=DEVICE)
    big_slots = torch.zeros((triton_lora.MAX_ROWS + 1, 2), device=DEVICE)
    big_y = torch.zeros((triton_lora.MAX_ROWS + 1, 24), device=DEVICE)
    triton_lora.lora_apply_triton(big, a, b, big_slots, big_y)
    triton_lora.lora_apply_triton(x, a.t().contiguous().t(), b, onehot, y.clone())  # a not contiguous
    assert len(launched) == 1


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_decode_sized_projections_and_graph_capture(rows: int) -> None:
    """Llama-3.1-8B's fused QKV at rank 16 over 4 slots, bf16, captured in a CUDA graph and replayed."""
    x, a, b, onehot, y, _ = _case(rows, 4096, 6144, 4, 48, torch.bfloat16, seed=rows)
    want = lora_apply_torch(*(t.float() for t in (x, a, b, onehot, y)))
    assert_close(triton_lora.lora_apply_triton(x, a, b, onehot, y.clone()), want, torch.bfloat16, "eager")
    out = y.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        triton_lora.lora_apply_triton(x, a, b, onehot, out)
    out.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, want, torch.bfloat16, "replayed")
