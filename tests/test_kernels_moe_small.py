"""The small-batch path of the Triton fused MoE (``kernels/triton_moe.py``) against ``fused_moe_torch``.

As in ``tests/test_kernels.py``: without a GPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) at tiny shapes; the ``gpu``-marked tests add the
Qwen3-30B-A3B shape (H=2048, I=768, E=128, top-8, bf16) and CUDA-graph capture with replayed routing.

Every float buffer the op allocates starts as NaN (the autouse fixture from ``tests/test_kernels.py``),
so an unwritten element fails. Outputs are compared with the reference computed in float32 from the same
inputs, under per-dtype bounds. Tests that must take one path make the other one raise, so a silent
switch of path cannot pass for coverage.
"""

from __future__ import annotations

import pytest
import torch

from kernels import triton_moe
from kernels.moe import fused_moe_torch
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

# Tiny shapes: H and I not multiples of the interpreter's blocks, so every mask is exercised.
HIDDEN, INTER = 40, 48


def make_weights(
    experts: int, hidden: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    return w13, w2


def random_ids(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Distinct experts within a token (as top-k gives), drawn from all ``experts`` physical ids."""
    return torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])


def run_and_check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    what: str,
) -> torch.Tensor:
    out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_torch(*up(x, w13, w2), weights, ids.long())
    assert out.dtype == x.dtype
    assert_close(out, ref, x.dtype, what)
    return out


@pytest.fixture
def small_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped path's first step raises: the call must take the small path."""

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("took the grouped path")

    monkeypatch.setattr(triton_moe, "moe_align_block_size", fail)


@pytest.fixture
def grouped_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("took the small path")

    monkeypatch.setattr(triton_moe, "_fused_moe_small", fail)


# ---------------------------------------------------------------------------------------------------------
# The small path


@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_small_path_matches_reference(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(100 + 10 * tokens + top_k)
    experts = 24  # up to 4 x top-6 = 24 pairs stay on the small path; top-3 and top-6 mask the k axis
    assert triton_moe.use_small_path(tokens * top_k, experts)
    w13, w2 = make_weights(experts, HIDDEN, INTER, dtype)
    x = randn(tokens, HIDDEN, dtype=dtype)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    run_and_check(x, w13, w2, weights, random_ids(tokens, top_k, experts), "small path")


@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_path_shared_experts(dtype: torch.dtype) -> None:
    """Several tokens choose the same experts (in different top-k slots); a token may use one twice."""
    torch.manual_seed(101)
    w13, w2 = make_weights(8, HIDDEN, INTER, dtype)
    x = randn(4, HIDDEN, dtype=dtype)
    ids = torch.tensor([[3, 5], [5, 3], [3, 0], [7, 7]], device=DEVICE)
    weights = torch.rand(4, 2, device=DEVICE).softmax(-1)
    run_and_check(x, w13, w2, weights, ids, "shared experts")


@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_path_replicated_placement(dtype: torch.dtype) -> None:
    """Physical ids of a multi-replica placement: any id below E, the last one included, int32 or int64."""
    torch.manual_seed(102)
    experts = 24  # e.g. 16 logical experts and 8 replicas of the hot ones
    w13, w2 = make_weights(experts, HIDDEN, INTER, dtype)
    x = randn(3, HIDDEN, dtype=dtype)
    ids = torch.tensor([[23, 0, 17, 9], [16, 23, 1, 22], [4, 20, 23, 16]], device=DEVICE)
    weights = torch.rand(3, 4, device=DEVICE).softmax(-1)
    run_and_check(x, w13, w2, weights, ids, "replicas, int64 ids")
    run_and_check(x, w13, w2, weights, ids.to(torch.int32), "replicas, int32 ids")


@pytest.mark.usefixtures("small_path_only")
def test_small_path_non_contiguous_inputs() -> None:
    """Strided x rows, transposed (non-contiguous) routing tensors and bf16 routing weights."""
    torch.manual_seed(103)
    experts, tokens, top_k = 12, 3, 2
    w13, w2 = make_weights(experts, HIDDEN, INTER, torch.float32)
    x = randn(tokens, 2 * HIDDEN)[:, :HIDDEN]
    ids = random_ids(tokens, top_k, experts).t().contiguous().t()
    weights = torch.rand(top_k, tokens, device=DEVICE).softmax(0).t()
    assert not ids.is_contiguous() and not weights.is_contiguous() and not x.is_contiguous()
    run_and_check(x, w13, w2, weights, ids, "strided inputs")
    run_and_check(x, w13, w2, weights.to(torch.bfloat16), ids, "bf16 routing weights")


@pytest.mark.usefixtures("small_path_only")
def test_small_path_overwrites_every_output() -> None:
    """With NaN-poisoned allocations (autouse fixture), a larger hidden size than one block per program."""
    torch.manual_seed(104)
    experts, tokens, top_k = 8, 2, 3
    w13, w2 = make_weights(experts, 100, 70, torch.float32)
    x = randn(tokens, 100)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    out = run_and_check(x, w13, w2, weights, random_ids(tokens, top_k, experts), "poisoned")
    assert not torch.isnan(out).any()


# ---------------------------------------------------------------------------------------------------------
# Absent pairs: an expert-parallel rank's pairs whose experts other ranks hold (id -1)


def absent_case(
    tokens: int, top_k: int, experts: int, dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER
) -> tuple[torch.Tensor, ...]:
    """Ids over ``2 * experts`` physical experts as an expert-parallel group of two sees them, as rank 0
    gets them: its own experts' ids, -1 for rank 1's. Every token keeps at least one absent pair, and one
    token has only absent pairs."""
    w13, w2 = make_weights(experts, hidden, inter, dtype)
    x = randn(tokens, hidden, dtype=dtype)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    ids = random_ids(tokens, top_k, 2 * experts)
    ids[:, 0] = experts + ids[:, 0] % experts  # rank 1's expert in the first slot
    ids[-1] = experts + torch.randperm(experts, device=DEVICE)[:top_k]  # the last token: all on rank 1
    local_ids = torch.where(ids < experts, ids, -1)
    return x, w13, w2, weights, local_ids


def check_absent(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    """The op against the reference, and the reference against the same pairs given weight 0 at a real
    expert (what the all-gather dispatcher passed before absent ids): absent pairs add exactly nothing."""
    out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids, has_absent=True)
    ref = fused_moe_torch(*up(x, w13, w2), weights, ids.long())
    zero_weight = fused_moe_torch(
        *up(x, w13, w2), torch.where(ids < 0, 0.0, weights), ids.clamp(min=0).long()
    )
    torch.testing.assert_close(ref, zero_weight, rtol=1e-5, atol=1e-6)  # float32: row batches round apart
    assert out.dtype == x.dtype
    assert_close(out, ref, x.dtype, "absent pairs")
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the token with no pair on this rank


@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "top_k"), [(2, 4), (4, 3)])
def test_small_path_skips_absent_pairs(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(130 + tokens)
    check_absent(*absent_case(tokens, top_k, 12, dtype))


@pytest.mark.usefixtures("grouped_path_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(9, 2, 8), (20, 4, 16)])
def test_grouped_path_skips_absent_pairs(tokens: int, top_k: int, experts: int, dtype: torch.dtype) -> None:
    torch.manual_seed(140 + tokens)
    assert not triton_moe.use_small_path(tokens * top_k, experts)
    check_absent(*absent_case(tokens, top_k, experts, dtype))


# ---------------------------------------------------------------------------------------------------------
# The threshold: both sides agree with the reference


def test_threshold_rule() -> None:
    cap = triton_moe.SMALL_PATH_MAX_PAIRS
    assert triton_moe.use_small_path(8, 128)  # Qwen3-30B-A3B decode, batch 1
    assert triton_moe.use_small_path(cap, 128) and not triton_moe.use_small_path(cap + 1, 128)
    assert triton_moe.use_small_path(8, 8) and not triton_moe.use_small_path(10, 8)  # Mixtral, top-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "small"),
    [
        (8, 2, 16, True),  # pairs == E: the small path's edge
        (9, 2, 16, False),  # pairs > E
        (8, 8, 128, True),  # pairs == SMALL_PATH_MAX_PAIRS
        (9, 8, 128, False),
    ],
)
def test_both_sides_of_threshold(
    tokens: int, top_k: int, experts: int, small: bool, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    assert triton_moe.use_small_path(tokens * top_k, experts) is small
    request.getfixturevalue("small_path_only" if small else "grouped_path_only")
    torch.manual_seed(105 + tokens + experts)
    w13, w2 = make_weights(experts, HIDDEN, INTER, dtype)
    x = randn(tokens, HIDDEN, dtype=dtype)
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    ids = random_ids(tokens, top_k, experts)
    ids[1] = ids[0]  # a repeated expert set as well
    run_and_check(x, w13, w2, weights, ids, "small" if small else "grouped")


def check_tokens_do_not_depend_on_the_batch(
    experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype
) -> None:
    """Each token's output is the same bits alone, in any smaller batch, and in the whole batch of 8 (the
    small path's tiles do not change with the token count)."""
    w13, w2 = make_weights(experts, hidden, inter, dtype)
    x = randn(8, hidden, dtype=dtype)
    weights = torch.rand(8, top_k, device=DEVICE).softmax(-1)
    ids = random_ids(8, top_k, experts)
    ids[1, : top_k // 2] = ids[0, top_k - top_k // 2 :]  # experts shared between tokens
    full = run_and_check(x, w13, w2, weights, ids, "8 tokens")
    for rows in (slice(0, 1), slice(0, 2), slice(3, 7), slice(7, 8)):
        part = TRITON_OPS.fused_moe(x[rows].clone(), w13, w2, weights[rows].clone(), ids[rows].clone())
        assert torch.equal(part, full[rows]), rows


@pytest.mark.usefixtures("small_path_only")
def test_small_path_tokens_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(125)
    # float32: a changed summation order shows in the bits (bf16 rounding would hide most of it here)
    check_tokens_do_not_depend_on_the_batch(32, HIDDEN, INTER, 4, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# GPU: the real shape and CUDA graphs


QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


@gpu
@needs_cuda
@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_gpu_small_path_qwen3_30b_a3b(tokens: int) -> None:
    torch.manual_seed(110 + tokens)
    shape = QWEN3_30B_A3B
    w13, w2 = make_weights(shape["experts"], shape["hidden"], shape["inter"], torch.bfloat16)
    x = randn(tokens, shape["hidden"], dtype=torch.bfloat16)
    weights = torch.rand(tokens, shape["top_k"], device=DEVICE).softmax(-1)
    ids = random_ids(tokens, shape["top_k"], shape["experts"])
    if tokens > 1:
        ids[1, :4] = ids[0, 4:]  # experts shared between tokens
    run_and_check(x, w13, w2, weights, ids, f"qwen3-30b-a3b, {tokens} tokens")


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [2, 16])
def test_gpu_absent_pairs_qwen3_30b_a3b(tokens: int) -> None:
    """One of two expert-parallel ranks (64 of the 128 experts): 2 tokens take the small path, 16 the
    grouped one."""
    torch.manual_seed(150 + tokens)
    shape = QWEN3_30B_A3B
    experts = shape["experts"] // 2
    assert triton_moe.use_small_path(tokens * shape["top_k"], experts) is (tokens == 2)
    check_absent(
        *absent_case(tokens, shape["top_k"], experts, torch.bfloat16, shape["hidden"], shape["inter"])
    )


@gpu
@needs_cuda
@pytest.mark.usefixtures("small_path_only")
def test_gpu_small_path_tokens_do_not_depend_on_the_batch() -> None:
    """At the Qwen3-30B-A3B shape, on the GPU's tiles (one tile for every token count since the
    seventeenth run)."""
    torch.manual_seed(126)
    shape = QWEN3_30B_A3B
    check_tokens_do_not_depend_on_the_batch(
        shape["experts"], shape["hidden"], shape["inter"], shape["top_k"], torch.bfloat16
    )


@gpu
@needs_cuda
@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_small_path_in_cuda_graph(tokens: int) -> None:
    """Capture once, then replay with new activations, routing ids and routing weights."""
    torch.manual_seed(120 + tokens)
    shape = QWEN3_30B_A3B
    w13, w2 = make_weights(shape["experts"], shape["hidden"], shape["inter"], torch.bfloat16)
    x = randn(tokens, shape["hidden"], dtype=torch.bfloat16)
    weights = torch.rand(tokens, shape["top_k"], device=DEVICE).softmax(-1)
    ids = random_ids(tokens, shape["top_k"], shape["experts"])
    TRITON_OPS.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    for _ in range(3):
        x.copy_(randn(*x.shape, dtype=x.dtype))
        ids.copy_(random_ids(tokens, shape["top_k"], shape["experts"]))
        weights.copy_(torch.rand(tokens, shape["top_k"], device=DEVICE).softmax(-1))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, fused_moe_torch(*up(x, w13, w2), weights, ids), torch.bfloat16, "graph replay")


@gpu
@needs_cuda
@pytest.mark.usefixtures("small_path_only")
def test_gpu_small_path_has_no_host_sync() -> None:
    torch.manual_seed(130)
    shape = QWEN3_30B_A3B
    w13, w2 = make_weights(shape["experts"], shape["hidden"], shape["inter"], torch.bfloat16)
    x = randn(2, shape["hidden"], dtype=torch.bfloat16)
    weights = torch.rand(2, shape["top_k"], device=DEVICE).softmax(-1)
    ids = random_ids(2, shape["top_k"], shape["experts"])
    TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
