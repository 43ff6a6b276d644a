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
from kernels.linear import add_rms_norm_linear_torch, linear_torch, silu_mul_linear_torch
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


def record_launches(monkeypatch: pytest.MonkeyPatch, kernel_name: str, w_arg: int) -> list[tuple[int, int]]:
    """Replaces ``triton_linear.<kernel_name>`` with a wrapper that records the (N, K) shape of the
    weight (positional argument ``w_arg``) of every launch, so a silent switch of path cannot pass for
    coverage."""
    launched: list[tuple[int, int]] = []
    kernel = getattr(triton_linear, kernel_name)

    class Recording:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: torch.Tensor, **kwargs: object) -> None:
                launched.append(tuple(args[w_arg].shape))
                kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_linear, kernel_name, Recording())
    return launched


@pytest.fixture
def gemv_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (N, K) of every GEMV launch."""
    yield record_launches(monkeypatch, "_gemv_kernel", 1)


@pytest.fixture
def skinny_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (N, K) of every skinny (2 to SKINNY_MAX_M rows) launch."""
    yield record_launches(monkeypatch, "_skinny_kernel", 1)


@pytest.fixture
def sum_splits_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records the [SPLIT_K, M, N] shape of the partials of every split-K sum launch."""
    yield record_launches(monkeypatch, "_sum_splits_kernel", 0)


@pytest.fixture
def skinny_rows_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (N, K) of every launch of the skinny kernel's one-weight-row variant (few weight rows)."""
    yield record_launches(monkeypatch, "_skinny_rows_kernel", 1)


def make_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return randn(n, k, dtype=dtype, scale=k**-0.5)


def test_use_gemv_rule() -> None:
    """Every projection of one row runs the GEMV; several rows go to cuBLAS."""
    for n, k in ((2048, 4096), (128, 2048), (151936, 2048), (5120, 2048), (4096, 14336), (28672, 4096)):
        assert triton_linear.use_gemv(1, n, k), (n, k)
    assert not triton_linear.use_gemv(2, 2048, 4096)  # several rows: cuBLAS
    assert not triton_linear.use_gemv(1, 0, 4096)  # empty weight: nothing to launch


def test_use_skinny_rule() -> None:
    """Two to SKINNY_MAX_M rows take the skinny kernel, one row the GEMV, more rows cuBLAS."""
    top = triton_linear.SKINNY_MAX_M
    for m in (2, 3, 8, top):
        assert triton_linear.use_skinny(m, 2048, 4096) and not triton_linear.use_gemv(m, 2048, 4096), m
    assert not triton_linear.use_skinny(1, 2048, 4096)  # one row: the GEMV
    assert not triton_linear.use_skinny(top + 1, 2048, 4096)  # more rows: cuBLAS's tiles win
    assert not triton_linear.use_skinny(4, 0, 4096)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 16, 17])
def test_linear_matches_reference(
    m: int, dtype: torch.dtype, gemv_launches: list, skinny_launches: list
) -> None:
    torch.manual_seed(200 + m)
    x, w = randn(m, K, dtype=dtype), make_weight(N, K, dtype)
    out = TRITON_OPS.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, N)
    assert_close(out, linear_torch(*up(x, w)), dtype, f"linear, M={m}")
    assert gemv_launches == ([(N, K)] if m == 1 else [])
    assert skinny_launches == ([(N, K)] if 2 <= m <= triton_linear.SKINNY_MAX_M else [])


def test_skinny_rows_do_not_depend_on_the_batch(skinny_launches: list) -> None:
    """A row's result is the same bits whatever rows come with it (2 to SKINNY_MAX_M of them), so a
    decode row rounds alike in any batch and in a padded CUDA-graph bucket."""
    torch.manual_seed(230)
    top = triton_linear.SKINNY_MAX_M
    # float32: a changed summation order shows in the bits (bf16 rounding would hide most of it here)
    x, w = randn(top, K), make_weight(N, K, torch.float32)
    full = TRITON_OPS.linear(x, w)
    for m in (2, 5, top - 1):
        assert torch.equal(TRITON_OPS.linear(x[:m].clone(), w), full[:m]), m
        assert torch.equal(TRITON_OPS.linear(x[top - m :].clone(), w), full[top - m :]), m
    assert len(skinny_launches) == 7


def test_skinny_strided_rows_and_edges(skinny_launches: list, sum_splits_launches: list) -> None:
    """Rows with a stride over K, w a row slice of a wider matrix, K not a multiple of the step (and
    below one step), N below one tile; K split in two parts where it is longer than two steps (the
    interpreter's tile), the second part shorter than the first."""
    torch.manual_seed(240)
    x = randn(3, 2 * K)[:, 5 : 5 + K]
    w = make_weight(N, K + 24, torch.float32)[:, 3 : 3 + K]
    assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, "strided")
    for n, k in ((25, 7), (33, 32), (27, 300)):
        x, w = randn(4, k), make_weight(n, k, torch.float32)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(x, w), torch.float32, f"N={n}, K={k}")
    assert skinny_launches == [(N, K), (25, 7), (33, 32), (27, 300)]
    assert sum_splits_launches == [(2, 3, N), (2, 4, 27)]  # K 72 and 300 split; 7 and 32 not


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skinny_few_weight_rows(
    dtype: torch.dtype, skinny_rows_launches: list, skinny_launches: list
) -> None:
    """A weight of few rows (a MoE router) takes the one-weight-row variant: K below one step, several
    steps with a masked edge, strided rows; its rows' bits do not depend on the batch either."""
    torch.manual_seed(250)
    for m, n, k in ((2, 1, 7), (5, 3, 32), (16, 17, 300), (3, 23, K)):
        x, w = randn(m, k, dtype=dtype), make_weight(n, k, dtype)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(*up(x, w)), dtype, f"M={m}, N={n}, K={k}")
    x = randn(16, 2 * K, dtype=dtype)[:, 3 : 3 + K]
    w = make_weight(20, K, dtype)
    full = TRITON_OPS.linear(x, w)
    assert_close(full, linear_torch(*up(x, w)), dtype, "strided")
    for m in (2, 9):
        assert torch.equal(TRITON_OPS.linear(x[:m], w), full[:m]), m
    assert skinny_rows_launches == [(1, 7), (3, 32), (17, 300), (23, K), (20, K), (20, K), (20, K)]
    assert skinny_launches == []


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
def test_gpu_linear_real_shapes(
    n: int, k: int, gemv_launches: list, skinny_launches: list, skinny_rows_launches: list
) -> None:
    torch.manual_seed(400)
    dtype = torch.bfloat16
    w = make_weight(n, k, dtype)
    for m in (1, 4, 16, 17):
        x = randn(m, k, dtype=dtype)
        assert_close(TRITON_OPS.linear(x, w), linear_torch(*up(x, w)), dtype, f"linear {n}x{k}, M={m}")
    assert gemv_launches == [(n, k)]  # the GEMV for one row, the skinny kernel for 4 and 16, cuBLAS for 17
    few = triton_linear.use_skinny_rows(n, w.device)  # the router: its one-weight-row variant
    assert (skinny_rows_launches if few else skinny_launches) == [(n, k), (n, k)]
    assert (skinny_launches if few else skinny_rows_launches) == []


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("n", "k"), [(2048, 4096), (4096, 4096), (6144, 4096), (4096, 14336), (128, 2048)], ids=lambda v: str(v)
)
def test_gpu_skinny_rows_do_not_depend_on_the_batch(
    n: int, k: int, skinny_launches: list, skinny_rows_launches: list, sum_splits_launches: list
) -> None:
    """On tensor cores too, each of the tile shapes ``skinny_config`` picks (K in 4 parts, 2 parts, whole,
    and the router's variant): a row's bits do not depend on the batch (2 to SKINNY_MAX_M rows, any
    position)."""
    torch.manual_seed(410)
    top = triton_linear.SKINNY_MAX_M
    x, w = randn(top, k, dtype=torch.bfloat16), make_weight(n, k, torch.bfloat16)
    full = TRITON_OPS.linear(x, w)
    assert_close(full, linear_torch(*up(x, w)), torch.bfloat16, f"linear {n}x{k}, M={top}")
    for m in (2, 3, 7, top - 1):
        assert torch.equal(TRITON_OPS.linear(x[:m].clone(), w), full[:m]), m
        assert torch.equal(TRITON_OPS.linear(x[top - m :].clone(), w), full[top - m :]), m
    assert len(skinny_launches) + len(skinny_rows_launches) == 9
    assert (len(skinny_rows_launches) == 9) == triton_linear.use_skinny_rows(n, w.device)
    split = 1 if skinny_rows_launches else triton_linear.skinny_config(n, k, w.device).split_k
    assert [p[0] for p in sum_splits_launches] == ([split] * 9 if split > 1 else [])  # the parts were summed


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
    w = make_weight(2048, 4096, dtype)
    for m in (1, 4):  # the GEMV and the skinny kernel
        x = randn(m, 4096, dtype=dtype)
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
            x.copy_(randn(m, 4096, dtype=dtype))
            graph.replay()
            torch.cuda.synchronize()
            assert_close(out, linear_torch(*up(x, w)), dtype, f"graph: linear, M={m}")


# ---------------------------------------------------------------------------------------------------------
# The norm fused into the GEMV that reads it (``add_rms_norm_linear``)


@pytest.fixture
def norm_gemv_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Records (N, K) of every fused norm + GEMV launch."""
    yield record_launches(monkeypatch, "_norm_gemv_kernel", 3)


def _check_norm_linear(
    m: int, n: int, k: int, dtype: torch.dtype, with_residual: bool, need_normed: bool, what: str
) -> None:
    x = randn(m, k, dtype=dtype)
    res = randn(m, k, dtype=dtype) if with_residual else None
    g = (1 + 0.2 * randn(k)).to(dtype)
    w = make_weight(n, k, dtype)
    out, normed, summed = TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, need_normed)
    ref_out, ref_normed, ref_summed = add_rms_norm_linear_torch(
        x.float(), None if res is None else res.float(), g.float(), 1e-6, w.float(), True
    )
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref_out, dtype, f"{what}: out")
    assert_close(summed, ref_summed, dtype, f"{what}: x + residual")
    if res is None:
        assert summed is x  # nothing added: the sum is the input itself, as in the reference
    if need_normed:
        assert normed is not None
        assert_close(normed, ref_normed, dtype, f"{what}: normed")
    else:
        assert normed is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_add_rms_norm_linear_matches_reference(
    m: int, dtype: torch.dtype, with_residual: bool, norm_gemv_launches: list
) -> None:
    """One row runs the fused kernel (N not a multiple of its rows, K not a power of two); more rows run
    the norm kernel and the matmul. Both against the reference, with and without the normalised row."""
    torch.manual_seed(500 + m)
    for need_normed in (True, False):
        _check_norm_linear(m, N + 1, K, dtype, with_residual, need_normed, f"M={m}, normed={need_normed}")
    assert norm_gemv_launches == ([(N + 1, K)] * 2 if m == 1 else [])


def test_add_rms_norm_linear_long_row_falls_back(
    monkeypatch: pytest.MonkeyPatch, norm_gemv_launches: list, gemv_launches: list
) -> None:
    """A row longer than ``NORM_GEMV_MAX_K`` runs the norm kernel and then the plain GEMV."""
    monkeypatch.setattr(triton_linear, "NORM_GEMV_MAX_K", K - 1)
    torch.manual_seed(520)
    _check_norm_linear(1, N, K, torch.float32, True, True, "long row")
    assert norm_gemv_launches == [] and gemv_launches == [(N, K)]


def test_add_rms_norm_linear_mixed_dtypes_fall_back(norm_gemv_launches: list) -> None:
    """A norm weight of another dtype than x (the reference promotes) is not fused, and still exact."""
    torch.manual_seed(530)
    x, res = randn(1, K, dtype=torch.bfloat16), randn(1, K, dtype=torch.bfloat16)
    g, w = 1 + 0.2 * randn(K), make_weight(N, K, torch.float32)
    out, normed, summed = TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w.to(torch.bfloat16), True)
    ref = add_rms_norm_linear_torch(x, res, g, 1e-6, w.to(torch.float32), True)
    assert normed is not None and normed.dtype == ref[1].dtype == torch.float32
    assert_close(out, ref[0].to(torch.bfloat16), torch.bfloat16, "mixed: out")
    assert norm_gemv_launches == []


@pytest.mark.parametrize("m", [1, 2])
def test_add_rms_norm_linear_float32_router_over_16_bit_rows(m: int, norm_gemv_launches: list) -> None:
    """DeepSeek's router: a float32 weight over bfloat16 activations multiplies the normalised row in
    float32 and gives float32 logits, as the reference (and transformers) do; one row runs the fused
    kernel, more rows the norm kernel and a float32 matmul."""
    torch.manual_seed(535 + m)
    x, res = randn(m, K, dtype=torch.bfloat16), randn(m, K, dtype=torch.bfloat16)
    g, w = (1 + 0.2 * randn(K)).to(torch.bfloat16), make_weight(N, K, torch.float32)
    out, normed, summed = TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, True)
    ref = add_rms_norm_linear_torch(x, res, g, 1e-6, w, True)
    assert (
        out.dtype == ref[0].dtype == torch.float32 and normed is not None and normed.dtype == torch.bfloat16
    )
    assert_close(out, ref[0], torch.float32, "float32 router: out")
    assert_close(normed, ref[1], torch.bfloat16, "float32 router: normed")
    assert_close(summed, ref[2], torch.bfloat16, "float32 router: sum")
    assert norm_gemv_launches == ([(N, K)] if m == 1 else [])


# ---------------------------------------------------------------------------------------------------------
# The activation fused into the down projection's GEMV (``silu_mul_linear``)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("with_add", [False, True], ids=["plain", "add"])
def test_silu_mul_linear_matches_reference(
    m: int, dtype: torch.dtype, with_add: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row runs the fused kernel (the activation formed inside the GEMV, the add its epilogue), more
    rows the SiLU kernel, the projection and an add; both against the reference, in every dtype."""
    launches = record_launches(monkeypatch, "_silu_mul_gemv_kernel", 1)
    torch.manual_seed(560 + m)
    gate_up, w = randn(m, 2 * K, dtype=dtype) * 2, make_weight(N, K, dtype)
    add = randn(m, N, dtype=dtype) if with_add else None
    out = TRITON_OPS.silu_mul_linear(gate_up, w, add)
    ref = silu_mul_linear_torch(gate_up, w, add)
    assert out.dtype == dtype and out.shape == (m, N)
    assert_close(out, ref, dtype, f"silu_mul_linear M={m} add={with_add}")
    assert launches == ([(N, K)] if m == 1 else [])


# (N, K): Qwen3-30B-A3B QKV, router, LM head; Llama-3.1-8B QKV, gate-up.
NORM_REAL_SHAPES = [(5120, 2048), (128, 2048), (151936, 2048), (6144, 4096), (28672, 4096)]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), NORM_REAL_SHAPES, ids=lambda v: str(v))
def test_gpu_add_rms_norm_linear_real_shapes(n: int, k: int, norm_gemv_launches: list) -> None:
    torch.manual_seed(540)
    for with_residual in (True, False):
        _check_norm_linear(1, n, k, torch.bfloat16, with_residual, True, f"{n}x{k}")
    assert norm_gemv_launches == [(n, k)] * 2


@gpu
@needs_cuda
def test_gpu_add_rms_norm_linear_in_cuda_graph() -> None:
    """Captured once and replayed with new inputs: program 0's writes of the sum and the normalised row,
    and every program's norm, follow the new values."""
    torch.manual_seed(550)
    dtype = torch.bfloat16
    x, res = randn(1, 2048, dtype=dtype), randn(1, 2048, dtype=dtype)
    g, w = (1 + 0.2 * randn(2048)).to(dtype), make_weight(5120, 2048, dtype)
    TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, normed, summed = TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, True)
    for _ in range(3):
        x.copy_(randn(1, 2048, dtype=dtype))
        res.copy_(randn(1, 2048, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = add_rms_norm_linear_torch(*up(x, res, g), 1e-6, w.float(), True)
        for got, want, what in zip((out, normed, summed), ref, ("out", "normed", "sum"), strict=True):
            assert_close(got, want, dtype, f"graph: {what}")
