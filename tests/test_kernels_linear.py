"""The Triton ``linear`` op (``kernels/triton_linear.py``) against its reference.

As in ``tests/test_kernels.py``: without a GPU the kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) at tiny shapes (N and K not multiples of the
blocks, several K steps); the ``gpu``-marked tests add real projection shapes at batch 1, a weight of more
than 2**31 elements and CUDA-graph capture.

Every float buffer the op allocates starts as NaN (the autouse fixture from ``tests/test_kernels.py``),
so an unwritten element fails. Outputs are compared with the reference computed in float32 from the same
inputs, under per-dtype bounds. Tests that must take the GEMV check that it launched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import triton_linear
from kernels.linear import linear_torch
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
    up,
)

# Tiny shapes: not multiples of the interpreter's 16 x 32 blocks, and more than two K steps.
N, K = 40, 72


@pytest.fixture
def gemv_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (N, K) of every GEMV launch, so a silent switch to cuBLAS cannot pass for coverage."""
    launched: list[tuple[int, int]] = []
    kernel = triton_linear._gemv_kernel

    class Recording:
        def __getitem__(self, grid: tuple) -> object:
            def launch(x: torch.Tensor, w: torch.Tensor, *args: object, **kwargs: object) -> None:
                launched.append(tuple(w.shape))
                kernel[grid](x, w, *args, **kwargs)

            return launch

    monkeypatch.setattr(triton_linear, "_gemv_kernel", Recording())
    yield launched


def make_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return randn(n, k, dtype=dtype, scale=k**-0.5)


def test_use_gemv_rule() -> None:
    """Every projection of one row runs the GEMV; several rows go to cuBLAS."""
    for n, k in ((2048, 4096), (128, 2048), (151936, 2048), (5120, 2048), (4096, 14336), (28672, 4096)):
        assert triton_linear.use_gemv(1, n, k), (n, k)
    assert not triton_linear.use_gemv(2, 2048, 4096)  # several rows: cuBLAS
    assert not triton_linear.use_gemv(1, 0, 4096)  # empty weight: nothing to launch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_linear_matches_reference(m: int, dtype: torch.dtype, gemv_launches: list) -> None:
    torch.manual_seed(200 + m)
    x, w = randn(m, K, dtype=dtype), make_weight(N, K, dtype)
    out = TRITON_OPS.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, N)
    assert_close(out, linear_torch(*up(x, w)), dtype, f"linear, M={m}")
    assert gemv_launches == ([(N, K)] if m == 1 else [])


def test_linear_strided_inputs(gemv_launches: list) -> None:
    """A strided x row, and w as a row slice of a wider matrix (row stride > K)."""
    torch.manual_seed(210)
    x = randn(2, 2 * K)[:1, 5 : 5 + K]
    w = make_weight(N, K + 24, torch.float32)[:, 3 : 3 + K]
    assert w.stride(0) == K + 24 and w.stride(-1) == 1
    assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, "strided")
    assert gemv_launches == [(N, K)]


def test_linear_one_step_and_one_row_of_w(gemv_launches: list) -> None:
    """K below one block (a single masked step) and N below one tile; also a K with many steps."""
    torch.manual_seed(220)
    for n, k in ((1, 7), (3, 32), (17, 300)):
        x, w = randn(1, k), make_weight(n, k, torch.float32)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, f"N={n}, K={k}")
    assert len(gemv_launches) == 3


def test_linear_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        TRITON_OPS.linear(randn(2, K), randn(N, K + 1))


def test_linear_column_major_weight_falls_back() -> None:
    """A weight not contiguous in its last dimension goes to the matmul, with the same result."""
    x, w = randn(1, K), randn(K, N).t()
    assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, "column-major w")


def test_linear_empty_batch() -> None:
    out = TRITON_OPS.linear(randn(0, K), make_weight(N, K, torch.float32))
    assert out.shape == (0, N)


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes at batch 1, int64 weight offsets, CUDA graphs

# (N, K): Qwen3-30B-A3B o-proj, router, LM head, QKV; Llama-3.1-8B LM head, down (a long K).
REAL_SHAPES = [(2048, 4096), (128, 2048), (151936, 2048), (128256, 4096), (5120, 2048), (4096, 14336)]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), REAL_SHAPES, ids=lambda v: str(v))
def test_gpu_linear_real_shapes(n: int, k: int, gemv_launches: list) -> None:
    torch.manual_seed(400)
    dtype = torch.bfloat16
    w = make_weight(n, k, dtype)
    for m in (1, 4):
        x = randn(m, k, dtype=dtype)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(*up(x, w)), dtype, f"linear {n}x{k}, M={m}")
    assert gemv_launches == [(n, k)]  # the GEMV for one row, cuBLAS for four


@gpu
@needs_cuda
def test_gpu_linear_weight_over_2_31_elements(gemv_launches: list) -> None:
    """A weight of 2**31 + 4096 * 64 elements (4.3 GB of bf16): rows past 2**31 / K need 64-bit offsets."""
    torch.manual_seed(420)
    k = 4096
    n = (1 << 31) // k + 64
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    x = randn(1, k, dtype=torch.bfloat16)
    assert triton_linear.use_gemv(1, n, k)
    out = TRITON_OPS.linear(x, w)
    assert gemv_launches == [(n, k)]  # the GEMV's 64-bit row offsets ran, not cuBLAS
    for rows in (slice(0, 64), slice(n - 128, n)):
        ref = x.float() @ w[rows].float().t()
        assert_close(out[:, rows], ref, torch.bfloat16, f"rows {rows}")


@gpu
@needs_cuda
def test_gpu_linear_in_cuda_graph_without_host_sync() -> None:
    """Capture once, replay with new inputs; no host synchronisation in the op."""
    torch.manual_seed(440)
    dtype = torch.bfloat16
    x, w = randn(1, 4096, dtype=dtype), make_weight(2048, 4096, dtype)
    TRITON_OPS.linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.linear(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON_OPS.linear(x, w)
    for _ in range(3):
        x.copy_(randn(1, 4096, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, linear_torch(*up(x, w)), dtype, "graph: linear")
