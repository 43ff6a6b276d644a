"""Float8 expert weights (``kernels.fp8_weight.Fp8Weight``) in the Triton fused MoE (``kernels/triton_moe.py``)
against ``fused_moe_torch`` on the same weights.

As ``tests/test_kernels_moe_small.py``: without a GPU the kernels run in the interpreter at tiny shapes,
every float buffer the op allocates starts as NaN, and the ``gpu``-marked test adds the Qwen3-30B-A3B
shape. Every case runs on both paths (forced, whatever the number of pairs) and, where it says so, in both
scale layouts:

- ``blocks``: 128 x 128 blocks with partial edges. H = 260 makes three K blocks of w13, the last 4 wide
  (the small gate-up's second step ends in a piece wholly past the row); I = 136 puts the gate/up
  boundary inside a row block and gives w2 two K blocks;
- ``rows``: one scale per row, small shapes.

Each block's weights have a magnitude of 1/2, 1 or 2 (at random), so a scale read from the wrong block
shows. Two comparisons: with float32 on the exactly dequantised weights (values times scales, unrounded),
under the 16-bit tests' bound, the kernels' own error; and with the op's reference, which computes in the
model's dtype with each weight rounded to it (``dequantize()``), under twice that bound: the reference is
as far from the exact result as the kernels are (both round gate_up, the activation and the output).
"""

from __future__ import annotations

import pytest
import torch

from kernels import triton_moe
from kernels.fp8_weight import Fp8Weight
from kernels.moe import fused_moe_torch
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    TOL,
    assert_close,
    gpu,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
)
from tests.test_kernels_moe_small import QWEN3_30B_A3B, absent_case, random_ids

# layout: (hidden, inter, scale block; None: one scale per row)
LAYOUTS: dict[str, tuple[int, int, tuple[int, int] | None]] = {
    "blocks": (260, 136, (128, 128)),
    "rows": (40, 48, None),
}


SMALL_KERNELS = (
    "_moe_small_gate_up_kernel",
    "_moe_small_gate_up_fp8_words_kernel",
    "_moe_small_down_kernel",
    "_moe_small_down_fp8_words_kernel",
)
# What the small path launches when both weights are float8 and can be read as 32-bit words.
WORD_KERNELS = ["_moe_small_gate_up_fp8_words_kernel", "_moe_small_down_fp8_words_kernel"]


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the small path's kernels as they launch, so that a silent switch between the word
    kernels, the 16-bit ones and the grouped GEMM cannot pass for coverage."""
    names: list[str] = []

    class Recording:
        def __init__(self, name: str) -> None:
            self.name, self.kernel = name, getattr(triton_moe, name)

        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                names.append(self.name)
                self.kernel[grid](*args, **kwargs)

            return launch

    for name in SMALL_KERNELS:
        monkeypatch.setattr(triton_moe, name, Recording(name))
    return names


@pytest.fixture(params=["small", "grouped"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The path the op takes, whatever the number of pairs (``use_small_path`` patched)."""
    small = request.param == "small"
    monkeypatch.setattr(triton_moe, "use_small_path", lambda *_a: small)
    return request.param


def quantized(
    experts: int,
    n: int,
    k: int,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> Fp8Weight:
    """Random weights [experts, n, k] (std k**-0.5 times each scale block's magnitude, 1/2, 1 or 2 at
    random) quantised into an Fp8Weight standing for ``dtype``."""
    w = Fp8Weight((experts, n, k), block or (1, k), dtype, DEVICE, fp8_dtype)
    (gn, gk), (bn, bk) = w.weight_scale.shape[-2:], w.block
    magnitude = 2.0 ** torch.randint(-1, 2, (experts, gn, gk), device=DEVICE)
    magnitude = magnitude.repeat_interleave(bn, dim=1).repeat_interleave(bk, dim=2)[:, :n, :k]
    w.quantize_(randn(experts, n, k, scale=k**-0.5) * magnitude)
    return w


def exact(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """A weight in float32; a float8 one as its values times their scales, not rounded to its dtype."""
    return w.weight.float() * w.full_scales() if isinstance(w, Fp8Weight) else w.float()


def assert_within(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, bounds: float, what: str) -> None:
    """``assert_close`` with ``bounds`` times its bound."""
    out32, ref32 = out.float(), ref.float()
    bound = bounds * TOL[dtype] * (ref32.abs() + ref32.abs().mean())
    worst = ((out32 - ref32).abs() / bound).max().item()
    assert worst <= 1.0, f"{what}: max error is {worst:.2f}x {bounds} {dtype} bounds"


def check(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    has_absent: bool = False,
) -> torch.Tensor:
    """The op against float32 on the exact weights (the 16-bit bound) and against the reference on the
    same weights (twice the bound; the module docstring says why)."""
    out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids, has_absent=has_absent)
    assert out.dtype == x.dtype
    exact_out = fused_moe_torch(x.float(), exact(w13), exact(w2), weights, ids.long())
    assert_close(out, exact_out, x.dtype, "float8 weights against float32 on the exact weights")
    ref = fused_moe_torch(x, w13, w2, weights, ids.long())
    assert_within(out, ref, x.dtype, 2.0, "float8 weights against the reference")
    return out


def moe_weights(
    experts: int, layout: str, dtype: torch.dtype, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[Fp8Weight, Fp8Weight]:
    hidden, inter, block = LAYOUTS[layout]
    w13 = quantized(experts, 2 * inter, hidden, block, dtype, fp8_dtype)
    w2 = quantized(experts, hidden, inter, block, dtype, fp8_dtype)
    return w13, w2


def test_layouts_have_partial_blocks() -> None:
    """What the cases cover: edge blocks cut short on both sides of both weights, the up rows starting
    inside a row block, one scale per row."""
    w13, w2 = moe_weights(2, "blocks", torch.bfloat16)
    assert w13.weight_scale.shape == (2, 3, 3) and w2.weight_scale.shape == (2, 3, 2)
    assert 136 % 128 and 260 % 128  # gate/up boundary and K edges inside blocks
    w13, w2 = moe_weights(2, "rows", torch.bfloat16)
    assert w13.weight_scale.shape == (2, 96, 1) and w2.weight_scale.shape == (2, 40, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_weights_match_reference(path: str, layout: str, dtype: torch.dtype, launched: list[str]) -> None:
    """Both layouts in every dtype; the small path reads the weights as words (float16: the down kernel
    scales act itself, which the gate-up cannot write scaled in float16's range)."""
    torch.manual_seed(200)
    experts, tokens, top_k = 4, 3, 2  # few experts: the grouped path's few tiles keep the interpreter quick
    w13, w2 = moe_weights(experts, layout, dtype)
    x = randn(tokens, LAYOUTS[layout][0], dtype=dtype)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    ids = random_ids(tokens, top_k, experts)
    ids[1] = ids[0]  # tokens sharing their experts
    check(x, w13, w2, weights, ids)
    assert launched == (WORD_KERNELS if path == "small" else [])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_weights_skip_absent_pairs(path: str, layout: str, launched: list[str]) -> None:
    """An expert-parallel rank's pairs whose experts another rank holds (id -1) add nothing, and read no
    scales; the last token has no pair on this rank."""
    torch.manual_seed(210)
    hidden, inter, _ = LAYOUTS[layout]
    x, _, _, weights, ids = absent_case(3, 3, 4, torch.bfloat16, hidden, inter)
    w13, w2 = moe_weights(4, layout, torch.bfloat16)
    out = check(x, w13, w2, weights, ids, has_absent=True)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert launched == (WORD_KERNELS if path == "small" else [])


def test_fp8_e5m2_one_scale_per_expert(path: str, launched: list[str]) -> None:
    """e5m2 values under a scale block the size of the weight: one scale per expert, stride 0 along both
    sides (what a per-tensor scale would give)."""
    torch.manual_seed(220)
    hidden, inter, _ = LAYOUTS["rows"]
    whole = (1 << 30, 1 << 30)
    w13 = quantized(4, 2 * inter, hidden, whole, torch.bfloat16, torch.float8_e5m2)
    w2 = quantized(4, hidden, inter, whole, torch.bfloat16, torch.float8_e5m2)
    assert w13.weight_scale.shape == (4, 1, 1)
    x = randn(3, hidden, dtype=torch.bfloat16)
    weights = torch.rand(3, 2, device=DEVICE).softmax(-1)
    check(x, w13, w2, weights, random_ids(3, 2, 4))
    assert launched == (WORD_KERNELS if path == "small" else [])


@pytest.mark.parametrize("fp8", ["w13", "w2"])
def test_one_fp8_weight(path: str, fp8: str, launched: list[str]) -> None:
    """One weight float8, the other bfloat16: each kernel reads its own weight as it is (the float8 gate-up
    writes act unscaled for the 16-bit down kernel; the float8 down kernel scales the 16-bit one's act)."""
    torch.manual_seed(230)
    w13, w2 = moe_weights(4, "rows", torch.bfloat16)
    if fp8 == "w13":
        w2 = w2.dequantize()
    else:
        w13 = w13.dequantize()
    x = randn(3, LAYOUTS["rows"][0], dtype=torch.bfloat16)
    weights = torch.rand(3, 2, device=DEVICE).softmax(-1)
    check(x, w13, w2, weights, random_ids(3, 2, 4))
    if path == "small":
        gate_up, down = WORD_KERNELS if fp8 == "w13" else ("_moe_small_gate_up_kernel", WORD_KERNELS[1])
        assert launched == [gate_up, down if fp8 == "w2" else "_moe_small_down_kernel"]


@pytest.mark.parametrize(("hidden", "inter"), [(42, 48), (40, 46)], ids=["h42", "i46"])
def test_fp8_weights_not_in_words_take_the_grouped_gemm(
    monkeypatch: pytest.MonkeyPatch, launched: list[str], hidden: int, inter: int
) -> None:
    """A float8 weight whose K is not a multiple of 4 cannot be read as 32-bit words: the op takes the
    grouped GEMM even where the batch would take the small path (no small kernel launches), and is right.
    No real model has such a K."""
    monkeypatch.setattr(triton_moe, "use_small_path", lambda *_a: True)
    torch.manual_seed(250)
    w13 = quantized(4, 2 * inter, hidden, None, torch.bfloat16)
    w2 = quantized(4, hidden, inter, None, torch.bfloat16)
    assert not triton_moe.small_path_reads(w13, w2)
    x = randn(3, hidden, dtype=torch.bfloat16)
    weights = torch.rand(3, 2, device=DEVICE).softmax(-1)
    check(x, w13, w2, weights, random_ids(3, 2, 4))
    assert launched == []


def test_fp8_rejects_k_steps_across_scale_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any launch: a grouped K step longer than KERNEL_K_STEP, which would straddle two
    scale blocks; a small-path float8 step that is not a power of two (pieces of KERNEL_K_STEP)."""
    monkeypatch.setattr(triton_moe, "use_small_path", lambda *_a: False)
    monkeypatch.setattr(
        triton_moe, "moe_tile_config", lambda *_a: triton_moe.MoeTileConfig(16, 32, 256, 1, 4, 1)
    )
    w13, w2 = moe_weights(4, "blocks", torch.bfloat16)
    x = randn(1, LAYOUTS["blocks"][0], dtype=torch.bfloat16)
    args = (x, w13, w2, torch.ones(1, 1, device=DEVICE), torch.zeros(1, 1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="straddle"):
        TRITON_OPS.fused_moe(*args)
    monkeypatch.setattr(triton_moe, "use_small_path", lambda *_a: True)
    config = triton_moe.MoeSmallConfig(64, 256, 4, 64, 192, 4)
    monkeypatch.setattr(triton_moe, "moe_small_fp8_config", lambda _device: config)
    with pytest.raises(ValueError, match="powers of two"):
        TRITON_OPS.fused_moe(*args)


# ---------------------------------------------------------------------------------------------------------
# GPU: the real shape


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_gpu_fp8_qwen3_30b_a3b(path: str, tokens: int) -> None:
    """Qwen3-30B-A3B-FP8's layout (128 x 128 blocks, e4m3) at its shape, on both paths at 1, 4 and 64 tokens
    (8, 32 and 512 pairs)."""
    torch.manual_seed(240 + tokens)
    shape = QWEN3_30B_A3B
    experts, hidden, inter, top_k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    w13 = quantized(experts, 2 * inter, hidden, (128, 128), torch.bfloat16)
    w2 = quantized(experts, hidden, inter, (128, 128), torch.bfloat16)
    x = randn(tokens, hidden, dtype=torch.bfloat16)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    ids = random_ids(tokens, top_k, experts)
    if tokens > 1:
        ids[1, :4] = ids[0, 4:]  # experts shared between tokens
    check(x, w13, w2, weights, ids)
