"""Linear projections over float8 weights (``kernels/triton_fp8_linear.py``, ``kernels/fp8_weight.py``)
against the reference.

The kernels apply each scale block's scale to float32 partial sums; the exact value they approximate is
x . (float8 value x scale) in float32, which every test computes. The PyTorch op (``linear_torch`` on an
``Fp8Weight``) rounds the widened weight to the model's dtype first, so its outputs must be within the same
per-dtype bounds of that value too. Tiny shapes in the interpreter: scale blocks with partial edges along
both sides, one scale a row, one for the whole weight; the ``gpu``-marked tests add real shapes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import triton_fp8_linear, triton_linear
from kernels.fp8_weight import Fp8Weight, kernel_layout_ok, scale_args
from kernels.linear import add_rms_norm_linear_torch, linear_torch
from kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
)

N, K = 40, 300  # not multiples of the blocks; three KERNEL_K_STEP pieces, the last partial
# (rows, K) a scale block: 16 x 256 blocks (edges partial on both sides), one scale a row, one in all.
# "narrow": blocks of 2 rows, fewer than a GEMV program's rows, so each row takes its own piece scales.
LAYOUTS = {"blocks": (16, 256), "narrow": (2, 128), "rows": (1, K), "tensor": (N, K)}


def make_fp8(n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> Fp8Weight:
    """A float8 weight quantised from random values whose magnitude varies by row and by column block,
    so that every scale differs."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, k, generator=gen) * k**-0.5
    values *= torch.rand(n, 1, generator=gen) + 0.5
    values *= (torch.rand(1, -(-k // 128), generator=gen) + 0.5).repeat_interleave(128, dim=1)[:, :k]
    w = Fp8Weight((n, k), block, dtype, DEVICE)
    w.quantize_(values.to(DEVICE))
    return w


def exact(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x . (float8 value x scale) in float32, with no rounding of the weight to the model's dtype."""
    return x.float() @ (w.weight.float() * w.full_scales()).t()


def record(
    monkeypatch: pytest.MonkeyPatch, kernel_name: str, module: object = triton_fp8_linear
) -> list[dict]:
    """Records the constexpr keyword arguments of each launch of ``<module>.<kernel_name>``."""
    launched: list[dict] = []
    kernel = getattr(module, kernel_name)

    class Recording:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                launched.append({k: v for k, v in kwargs.items() if k.isupper()})
                kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, kernel_name, Recording())
    return launched


@pytest.fixture
def gemvs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    yield record(monkeypatch, "_fp8_gemv_kernel")


@pytest.fixture
def skinnies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    yield record(monkeypatch, "_skinny_kernel", triton_linear)


def test_quantize_round_trip_and_layouts() -> None:
    torch.manual_seed(1)
    values = randn(N, K)
    for name, block in LAYOUTS.items():
        w = Fp8Weight((N, K), block, torch.float32, DEVICE)
        w.quantize_(values)
        assert w.weight.dtype == torch.float8_e4m3fn and w.weight.shape == (N, K)
        grid = {"blocks": (3, 2), "narrow": (N // 2, 3), "rows": (N, 1), "tensor": (1, 1)}[name]
        assert tuple(w.weight_scale.shape) == grid, name
        # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 relative) of the original
        err = (w.dequantize() - values).abs()
        assert (err <= values.abs() / 16 + w.full_scales() * 2.0**-9).all(), name
        assert w.nbytes() < values.numel() * 2 // 1.9  # about a byte a weight
    assert not kernel_layout_ok((24, 128), N, K) and not kernel_layout_ok((16, 64), N, K)
    with pytest.raises(ValueError, match="not one the kernels read"):
        Fp8Weight((N, K), (16, 96), torch.float32, DEVICE)
    stacked = Fp8Weight((3, N, K), (16, 128), torch.float32, DEVICE)
    assert tuple(stacked.weight_scale.shape) == (3, 3, 3) and scale_args(stacked)[0] == 9


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 7, 17, 300])
def test_fp8_linear_matches_reference(
    m: int, dtype: torch.dtype, layout: str, gemvs: list, skinnies: list
) -> None:
    torch.manual_seed(10 + m)
    w = make_fp8(N, K, LAYOUTS[layout], dtype, seed=m)
    x = randn(m, K, dtype=dtype)
    out = TRITON_OPS.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, N)
    ref = exact(x, w)
    assert_close(out, ref, dtype, f"fp8 linear {layout}, M={m}")
    assert_close(linear_torch(x, w), ref, dtype, f"reference {layout}, M={m}")
    # The GEMV for one row, the skinny kernel to FP8_WIDE_MAX_M (16-row tiles to 16 rows, K in parts;
    # wider tiles past that), cuBLAS over the widened weight past that
    assert len(gemvs) == (m == 1)
    on_skinny = 2 <= m <= triton_fp8_linear.FP8_WIDE_MAX_M
    assert [(s["BLOCK_M"], s["SPLIT_K"]) for s in skinnies] == (
        [(16 if m <= 16 else 32, 2)] if on_skinny else []
    )
    for launch in gemvs + skinnies:
        assert launch["ROW_SCALES"] == (layout not in ("blocks", "narrow"))
    for launch in gemvs:
        assert launch["SHARED_SCALES"] == (layout == "blocks")
    assert all(launch["W_FP8"] for launch in skinnies)


def test_dequantize_kernel_equals_the_reference_bit_for_bit() -> None:
    for name, block in LAYOUTS.items():
        for dtype in DTYPES:
            w = make_fp8(N, K, block, dtype, seed=3)
            assert torch.equal(triton_fp8_linear.dequantize_triton(w), w.dequantize()), (name, dtype)


@pytest.mark.parametrize("layout", ["blocks", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 2])
def test_fp8_add_rms_norm_linear(
    m: int, dtype: torch.dtype, layout: str, gemvs: list, skinnies: list
) -> None:
    torch.manual_seed(20 + m)
    w = make_fp8(N, K, LAYOUTS[layout], dtype, seed=7)
    x, res, g = randn(m, K, dtype=dtype), randn(m, K, dtype=dtype), randn(K, dtype=dtype, scale=0.1) + 1
    for residual in (res, None):
        for need_normed in (True, False):
            out, normed, summed = TRITON_OPS.add_rms_norm_linear(x, residual, g, 1e-6, w, need_normed)
            if residual is None:
                h, s = rms_norm_torch(x, g, 1e-6), x
            else:
                h, s = fused_add_rms_norm_torch(x, residual, g, 1e-6)
            what = f"{layout} M={m} residual={residual is not None} normed={need_normed}"
            assert_close(out, exact(h, w), dtype, what)
            assert torch.equal(summed, s), what
            assert (normed is None) == (not need_normed), what
            if need_normed:
                assert_close(normed, h, dtype, what)
            ref_out, _, _ = add_rms_norm_linear_torch(x, residual, g, 1e-6, w, need_normed)
            assert_close(ref_out, exact(h, w), dtype, "reference " + what)
    # The norm kernel, then the projection: the GEMV for one row, the skinny kernel for two
    assert (len(gemvs), len(skinnies)) == ((4, 0) if m == 1 else (0, 4))


def test_fp8_linear_strided_input_and_e5m2(gemvs: list) -> None:
    torch.manual_seed(30)
    w = Fp8Weight((N, K), (16, 128), torch.bfloat16, DEVICE, fp8_dtype=torch.float8_e5m2)
    w.quantize_(randn(N, K, scale=K**-0.5))
    x = randn(1, 2 * K, dtype=torch.bfloat16)[:, ::2]
    assert_close(TRITON_OPS.linear(x, w), exact(x, w), torch.bfloat16, "e5m2, strided x")
    assert len(gemvs) == 1


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes

# (N, K): Qwen3-30B-A3B QKV, o-proj; Llama-3.1-8B QKV, gate-up, down.
REAL_SHAPES = [(5120, 2048), (2048, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), REAL_SHAPES, ids=lambda v: str(v))
def test_gpu_fp8_linear_real_shapes(n: int, k: int, gemvs: list, skinnies: list) -> None:
    torch.manual_seed(40)
    dtype = torch.bfloat16
    for block in ((128, 128), (1, k)):
        w = make_fp8(n, k, block, dtype, seed=n)
        for m in (1, 4, 16, 17, 128, 300):
            x = randn(m, k, dtype=dtype)
            assert_close(TRITON_OPS.linear(x, w), exact(x, w), dtype, f"fp8 {n}x{k} {block}, M={m}")
        g, res = randn(k, dtype=dtype, scale=0.1) + 1, randn(1, k, dtype=dtype)
        x = randn(1, k, dtype=dtype)
        out, _, _ = TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, False)
        h, _ = fused_add_rms_norm_torch(x, res, g, 1e-6)
        assert_close(out, exact(h, w), dtype, f"fp8 norm {n}x{k} {block}")
    # M = 1 and the norm's row on the GEMV; 4 and 16 on 16-row skinny tiles, 17 and 128 on wide ones;
    # 300 on cuBLAS
    assert len(gemvs) == 2 * 2
    assert [s["BLOCK_M"] for s in skinnies] == [16, 16, 64, 64] * 2 and all(s["W_FP8"] for s in skinnies)
