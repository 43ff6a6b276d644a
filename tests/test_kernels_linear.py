"""The Triton ``linear`` and ``norm_linear`` ops (``kernels/triton_linear.py``) against their references.

As in ``tests/test_kernels.py``: without a GPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) at tiny shapes (N and K not multiples of the
blocks, several K steps); the ``gpu``-marked tests add real projection shapes at batch 1, a weight of more
than 2**31 elements and CUDA-graph capture.

Every float buffer the op allocates starts as NaN (the autouse fixture from ``tests/test_kernels.py``),
so an unwritten element fails. Outputs are compared with the reference computed in float32 from the same
inputs, under per-dtype bounds. M runs over both sides of ``SMALL_M``; tests that must take the GEMV
make the cuBLAS fallback raise, and the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.linear import linear_torch, norm_linear_torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels import triton_linear  # noqa: E402
from kernels.triton_ops import TRITON_OPS  # noqa: E402
from tests.test_kernels import (  # noqa: E402
    assert_close,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
    up,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL_M = triton_linear.SMALL_M
ROWS = [1, 2, 3, SMALL_M, SMALL_M + 1]
# Tiny shapes: not multiples of the interpreter's 16 x 32 blocks, and more than two K steps.
N, K = 40, 72
EPS = 1e-6

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def expect_path(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    """The GEMV launch raises when M > SMALL_M: a silent switch of path cannot pass for coverage. (The
    fallback is ``x @ w.t()``, which cannot be patched; so only the GEMV side is guarded.)"""
    launch = triton_linear._launch_gemv

    def guarded(x: torch.Tensor, *args: object) -> None:
        assert x.shape[0] <= SMALL_M, "GEMV launched above SMALL_M"
        launched.append(x.shape[0])
        launch(x, *args)  # type: ignore[arg-type]

    launched: list[int] = []
    monkeypatch.setattr(triton_linear, "_launch_gemv", guarded)
    yield
    m = request.node.callspec.params["m"]
    assert launched == ([m] if m <= SMALL_M else []), launched


def make_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return randn(n, k, dtype=dtype, scale=k**-0.5)


def check_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    w: torch.Tensor,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = x.dtype
    out, normed, summed = TRITON_OPS.norm_linear(x, residual, norm_weight, EPS, w)
    res32 = None if residual is None else residual.float()
    ref_out, ref_normed, ref_sum = norm_linear_torch(x.float(), res32, norm_weight.float(), EPS, w.float())
    assert out.dtype == normed.dtype == dtype, (out.dtype, normed.dtype)
    assert_close(out, ref_out, dtype, f"{what}: out")
    assert_close(normed, ref_normed, dtype, f"{what}: normed")
    if residual is None:
        assert summed is x, f"{what}: without a residual, x itself is the residual"
    elif dtype == torch.bfloat16 and INTERPRETED:
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does).
        assert_close(summed, ref_sum, dtype, f"{what}: residual sum")
    else:
        assert summed.dtype == dtype and torch.equal(summed, x + residual), f"{what}: residual sum not exact"
    return out, normed, summed


# ---------------------------------------------------------------------------------------------------------
# linear


@pytest.mark.usefixtures("expect_path")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_linear_matches_reference(m: int, dtype: torch.dtype) -> None:
    torch.manual_seed(200 + m)
    x, w = randn(m, K, dtype=dtype), make_weight(N, K, dtype)
    out = TRITON_OPS.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, N)
    assert_close(out, linear_torch(*up(x, w)), dtype, f"linear, M={m}")


@pytest.mark.parametrize("m", [1, 3])
def test_linear_strided_inputs(m: int) -> None:
    """Strided x rows, and w as a row slice of a wider matrix (row stride > K)."""
    torch.manual_seed(210 + m)
    x = randn(m, 2 * K)[:, 5 : 5 + K]
    w = make_weight(N, K + 24, torch.float32)[:, 3 : 3 + K]
    assert x.stride(0) == 2 * K and w.stride(0) == K + 24 and w.stride(-1) == 1
    assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, "strided")


def test_linear_one_step_and_one_row_of_w() -> None:
    """K below one block (a single masked step) and N below one tile; also a larger K with many steps."""
    torch.manual_seed(220)
    for n, k in ((1, 7), (3, 32), (17, 300)):
        x, w = randn(2, k), make_weight(n, k, torch.float32)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, f"N={n}, K={k}")
        assert_close(TRITON_OPS.linear(x[:1], w), linear_torch(x[:1], w), torch.float32, f"M=1, N={n}")


def test_linear_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        TRITON_OPS.linear(randn(2, K), randn(N, K + 1))
    with pytest.raises(ValueError, match="contiguous"):
        TRITON_OPS.linear(randn(2, K), randn(K, N).t())


def test_linear_empty_batch() -> None:
    out = TRITON_OPS.linear(randn(0, K), make_weight(N, K, torch.float32))
    assert out.shape == (0, N)


# ---------------------------------------------------------------------------------------------------------
# norm_linear


@pytest.mark.usefixtures("expect_path")
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_norm_linear_matches_reference(m: int, dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(300 + m)
    x = randn(m, K, dtype=dtype)
    residual = randn(m, K, dtype=dtype) if with_residual else None
    norm_weight = (1.0 + 0.1 * randn(K)).to(dtype)
    check_norm_linear(x, residual, norm_weight, make_weight(N, K, dtype), f"M={m}")


@pytest.mark.parametrize("m", [1, 3])
def test_norm_linear_strided_and_scaled_inputs(m: int) -> None:
    """Strided x and residual rows; rows of very different scale (the RMS is per row)."""
    torch.manual_seed(310 + m)
    x = randn(m, 3 * K)[:, K : 2 * K]
    x.mul_(torch.logspace(-2, 2, m, device=DEVICE)[:, None])
    residual = randn(m, 2 * K)[:, :K]
    assert x.stride(0) == 3 * K and residual.stride(0) == 2 * K
    norm_weight = randn(K)
    w = make_weight(N, K, torch.float32)
    check_norm_linear(x, residual, norm_weight, w, "strided")
    check_norm_linear(x, None, norm_weight, w, "strided, first layer")


def test_norm_linear_matches_the_separate_ops() -> None:
    """The fused op gives what the decoder computes today: fused_add_rms_norm, then the projection."""
    torch.manual_seed(320)
    dtype = torch.float16
    x, residual, norm_weight = randn(2, K, dtype=dtype), randn(2, K, dtype=dtype), randn(K, dtype=dtype)
    w = make_weight(N, K, dtype)
    out, normed, summed = TRITON_OPS.norm_linear(x, residual, norm_weight, EPS, w)
    ref_normed, ref_sum = TRITON_OPS.fused_add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(summed, ref_sum)
    assert_close(normed, ref_normed, dtype, "normed")
    assert_close(out, (ref_normed.float() @ w.float().t()), dtype, "out")


def test_norm_linear_rejects_bad_norm_weight() -> None:
    with pytest.raises(ValueError, match="norm_weight"):
        TRITON_OPS.norm_linear(randn(1, K), None, randn(K + 1), EPS, make_weight(N, K, torch.float32))


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes at batch 1, int64 weight offsets, CUDA graphs

# (N, K): Qwen3-30B-A3B QKV, o-proj, router; Llama-3.1-8B QKV, gate-up, down; Qwen3 LM head.
REAL_SHAPES = [
    (5120, 2048),
    (2048, 4096),
    (128, 2048),
    (6144, 4096),
    (28672, 4096),
    (4096, 14336),
    (151936, 2048),
]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), REAL_SHAPES, ids=lambda v: str(v))
def test_gpu_linear_real_shapes(n: int, k: int) -> None:
    torch.manual_seed(400)
    dtype = torch.bfloat16
    w = make_weight(n, k, dtype)
    for m in (1, SMALL_M):
        x = randn(m, k, dtype=dtype)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(*up(x, w)), dtype, f"linear {n}x{k}, M={m}")


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(5120, 2048), (2048, 4096), (128, 2048), (6144, 4096)], ids=str)
def test_gpu_norm_linear_real_shapes(n: int, k: int) -> None:
    torch.manual_seed(410)
    dtype = torch.bfloat16
    w, norm_weight = make_weight(n, k, dtype), (1.0 + 0.1 * randn(k)).to(dtype)
    for m in (1, 4):
        x, residual = randn(m, k, dtype=dtype), randn(m, k, dtype=dtype)
        check_norm_linear(x, residual, norm_weight, w, f"{n}x{k}, M={m}")
        check_norm_linear(x, None, norm_weight, w, f"{n}x{k}, M={m}, first layer")


@gpu
@needs_cuda
def test_gpu_linear_weight_over_2_31_elements() -> None:
    """A weight of 2**31 + 4096 * 64 elements (4.3 GB of bf16): rows past 2**31 / K need 64-bit offsets."""
    torch.manual_seed(420)
    k = 4096
    n = (1 << 31) // k + 64
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    x = randn(2, k, dtype=torch.bfloat16)
    out = TRITON_OPS.linear(x, w)
    for rows in (slice(0, 64), slice(n - 128, n)):
        ref = x.float() @ w[rows].float().t()
        assert_close(out[:, rows], ref, torch.bfloat16, f"rows {rows}")


@gpu
@needs_cuda
def test_gpu_linear_has_no_host_sync() -> None:
    torch.manual_seed(430)
    x, residual = randn(1, 2048, dtype=torch.bfloat16), randn(1, 2048, dtype=torch.bfloat16)
    norm_weight, w = randn(2048, dtype=torch.bfloat16), make_weight(5120, 2048, torch.bfloat16)
    TRITON_OPS.linear(x, w)
    TRITON_OPS.norm_linear(x, residual, norm_weight, EPS, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.linear(x, w)
        TRITON_OPS.norm_linear(x, residual, norm_weight, EPS, w)
        TRITON_OPS.norm_linear(x, None, norm_weight, EPS, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_linear_in_cuda_graph(m: int) -> None:
    """Capture linear and norm_linear (with and without a residual) once, replay with new inputs."""
    torch.manual_seed(440 + m)
    dtype = torch.bfloat16
    k, n = 2048, 5120
    x, residual = randn(m, k, dtype=dtype), randn(m, k, dtype=dtype)
    norm_weight, w = (1.0 + 0.1 * randn(k)).to(dtype), make_weight(n, k, dtype)

    def step() -> tuple:
        return (
            TRITON_OPS.linear(x, w),
            TRITON_OPS.norm_linear(x, residual, norm_weight, EPS, w),
            TRITON_OPS.norm_linear(x, None, norm_weight, EPS, w),
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lin, fused, first = step()
    for _ in range(3):
        x.copy_(randn(m, k, dtype=dtype))
        residual.copy_(randn(m, k, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(lin, linear_torch(*up(x, w)), dtype, "graph: linear")
        ref = norm_linear_torch(x.float(), residual.float(), norm_weight.float(), EPS, w.float())
        for got, want, name in zip(fused, ref, ("out", "normed", "sum"), strict=True):
            assert_close(got, want, dtype, f"graph: norm_linear {name}")
        ref = norm_linear_torch(x.float(), None, norm_weight.float(), EPS, w.float())
        assert_close(first[0], ref[0], dtype, "graph: norm_linear first layer out")
        assert_close(first[1], ref[1], dtype, "graph: norm_linear first layer normed")
