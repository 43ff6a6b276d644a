"""The MoE block op (routing and experts on one rank): ``moe_block_triton`` against ``moe_block_torch``.

On its small path the Triton op routes inside the two expert kernels (``kernels/triton_moe.py``, ROUTED):
the gate-up kernel picks each pair's expert from the router logits, the down kernel the token's k experts
and weights, and the gate-up kernel counts the pairs. Tests of that path make the routing kernel raise, so
a silent fall-back to it cannot pass for coverage. As in ``tests/test_kernels.py``: without a GPU the
kernels run under the Triton interpreter at tiny shapes; the ``gpu``-marked tests add the Qwen3-30B-A3B
shape, CUDA-graph replay with new logits, and a no-host-sync check.

Logits have no ties (except in the tie test), so the chosen experts, and hence the counters, must equal
the reference's exactly; outputs match the reference computed in float32 under per-dtype bounds. Every
float buffer the op allocates starts as NaN (the autouse fixture), so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from engine.moe.layer import PLACEMENT_TOKEN_ROWS, ExpertPlacement
from kernels import triton_moe
from kernels.moe import moe_block_torch
from kernels.triton_moe_routing import moe_route_triton
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
from tests.test_kernels_moe_routing import EIGHT_ON_ELEVEN, distinct_logits

HIDDEN, INTER = 40, 48  # not multiples of the interpreter's blocks: every mask is exercised


@pytest.fixture
def routed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The routing kernel raises: the call must route inside the expert kernels."""

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("called the routing kernel")

    monkeypatch.setattr(triton_moe, "moe_route_triton", fail)


def placement_of(physical_to_logical: list[int], num_logical: int) -> ExpertPlacement:
    return ExpertPlacement(physical_to_logical, num_logical, DEVICE)


def experts_of(num_physical: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    w13 = randn(num_physical, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_physical, hidden, inter, dtype=dtype, scale=inter**-0.5)
    return w13, w2


def check_block(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    placement: ExpertPlacement,
    what: str,
) -> torch.Tensor:
    """Run both ops from the same counters; compare outputs (bounds) and counter increments (exactly)."""
    num_physical = w13.shape[0]
    start = torch.randint(0, 100, (num_physical,), dtype=torch.int64, device=DEVICE)
    counts, ref_counts = start.clone(), start.clone()
    tables = (placement.logical_to_physical, placement.replica_counts)
    out = TRITON_OPS.moe_block(
        x, logits, w13, w2, top_k, renormalize, *tables, counts, placement.physical_by_token
    )
    x32, w13_32, w2_32 = up(x, w13, w2)
    ref = moe_block_torch(
        x32, logits, w13_32, w2_32, top_k, renormalize, *tables, ref_counts, placement.physical_by_token
    )
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, ref, x.dtype, what)
    assert torch.equal(counts, ref_counts), f"{what}: expert counters differ from the reference"
    return out


@pytest.mark.usefixtures("routed_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("experts", "top_k"), [(8, 1), (8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_routed_small_path_matches_reference(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype
) -> None:
    if not triton_moe.use_small_path(tokens * top_k, experts):
        pytest.skip("past the small path")
    torch.manual_seed(300 + tokens + experts + top_k)
    w13, w2 = experts_of(experts, HIDDEN, INTER, dtype)
    x = randn(tokens, HIDDEN, dtype=dtype)
    logits = distinct_logits(tokens, experts, dtype)
    for renormalize in (True, False):
        check_block(x, logits, w13, w2, top_k, renormalize, placement_of(list(range(experts)), experts),
                    f"{tokens} tokens, E={experts}, k={top_k}, renormalize={renormalize}")  # fmt: skip


@pytest.mark.usefixtures("routed_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_routed_small_path_replicas(dtype: torch.dtype) -> None:
    """8 logical experts on 11 physical ones out of logical order: tokens 0-3 use different replicas."""
    torch.manual_seed(301)
    placement = placement_of(EIGHT_ON_ELEVEN, 8)
    assert placement.physical_by_token.shape == (PLACEMENT_TOKEN_ROWS, 8)
    w13, w2 = experts_of(11, HIDDEN, INTER, dtype)
    x = randn(5, HIDDEN, dtype=dtype)
    logits = distinct_logits(5, 8, dtype)
    logits[:, 1] = logits.max() + 1  # every token picks expert 1, whose three replicas take turns
    check_block(x, logits, w13, w2, 2, True, placement, "replicated experts")


@pytest.mark.usefixtures("routed_only")
def test_routed_small_path_float32_logits() -> None:
    """float32 logits take the 64-bit selection keys."""
    torch.manual_seed(302)
    w13, w2 = experts_of(16, HIDDEN, INTER, torch.bfloat16)
    x = randn(2, HIDDEN, dtype=torch.bfloat16)
    logits = distinct_logits(2, 16, torch.float32)
    check_block(x, logits, w13, w2, 4, True, placement_of(list(range(16)), 16), "float32 logits")


@pytest.mark.usefixtures("routed_only")
def test_routed_small_path_strided_logits() -> None:
    torch.manual_seed(303)
    w13, w2 = experts_of(8, HIDDEN, INTER, torch.float32)
    x = randn(3, HIDDEN)
    wide = distinct_logits(3, 16, torch.float32)
    check_block(x, wide[:, ::2], w13, w2, 2, False, placement_of(list(range(8)), 8), "strided logits")


def test_routed_ties_pick_as_the_routing_kernel() -> None:
    """Equal logits: the lowest expert index wins, in the expert kernels as in the routing kernel."""
    torch.manual_seed(304)
    experts, top_k, tokens = 8, 3, 2
    w13, w2 = experts_of(experts, HIDDEN, INTER, torch.float32)
    x = randn(tokens, HIDDEN)
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, 2.0, -1.0, 0.0], [0.0] * 8], device=DEVICE)
    placement = placement_of(list(range(experts)), experts)
    tables = (placement.logical_to_physical, placement.replica_counts)
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE)
    out = TRITON_OPS.moe_block(x, logits, w13, w2, top_k, True, *tables, counts, placement.physical_by_token)
    route_counts = torch.zeros_like(counts)
    weights, ids = moe_route_triton(logits, top_k, True, *tables, route_counts, x.dtype)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.equal(counts, route_counts)
    assert torch.equal(out, TRITON_OPS.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.usefixtures("routed_only")
def test_routed_tokens_do_not_depend_on_the_batch() -> None:
    """Each token's output is the same bits alone as in batches of 2 and 8 (float32: a changed summation
    order would show)."""
    torch.manual_seed(305)
    experts, top_k = 32, 4
    w13, w2 = experts_of(experts, HIDDEN, INTER, torch.float32)
    x = randn(8, HIDDEN)
    logits = distinct_logits(8, experts, torch.float32)
    placement = placement_of(list(range(experts)), experts)
    tables = (
        placement.logical_to_physical,
        placement.replica_counts,
        torch.zeros(experts, dtype=torch.int64, device=DEVICE),
    )

    def run(rows: slice) -> torch.Tensor:
        return TRITON_OPS.moe_block(
            x[rows], logits[rows], w13, w2, top_k, True, *tables, placement.physical_by_token
        )

    full = run(slice(0, 8))
    for rows in (slice(0, 1), slice(5, 6), slice(2, 4)):
        assert torch.equal(run(rows), full[rows]), rows


def test_past_the_small_path_routes_with_the_routing_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """9 tokens x top-8 = 72 pairs: the grouped path, after the routing kernel (called once)."""
    calls = []

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return moe_route_triton(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "moe_route_triton", counted)
    torch.manual_seed(306)
    w13, w2 = experts_of(128, HIDDEN, INTER, torch.float32)
    x = randn(9, HIDDEN)
    logits = distinct_logits(9, 128, torch.float32)
    check_block(x, logits, w13, w2, 8, True, placement_of(list(range(128)), 128), "grouped path")
    assert calls == [1]


def test_more_tokens_than_the_placement_table_routes_with_the_routing_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return moe_route_triton(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "moe_route_triton", counted)
    torch.manual_seed(307)
    w13, w2 = experts_of(8, HIDDEN, INTER, torch.float32)
    x = randn(3, HIDDEN)
    logits = distinct_logits(3, 8, torch.float32)
    placement = placement_of(list(range(8)), 8)
    placement.physical_by_token = placement.physical_by_token[:2]
    check_block(x, logits, w13, w2, 1, True, placement, "3 tokens, a table of 2 rows")
    assert calls == [1]


def test_rejects_k_above_experts() -> None:
    placement = placement_of(list(range(4)), 4)
    w13, w2 = experts_of(4, HIDDEN, INTER, torch.float32)
    with pytest.raises(ValueError, match="top_k=5"):
        TRITON_OPS.moe_block(
            randn(1, HIDDEN), torch.zeros(1, 4, device=DEVICE), w13, w2, 5, True, placement.logical_to_physical,
            placement.replica_counts, torch.zeros(4, dtype=torch.int64, device=DEVICE), placement.physical_by_token,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# GPU: the Qwen3-30B-A3B shape, CUDA graphs, no host sync


QWEN3 = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


def qwen3_inputs(tokens: int, seed: int, num_physical: int = 128) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    w13, w2 = experts_of(num_physical, QWEN3["hidden"], QWEN3["inter"], torch.bfloat16)
    x = randn(tokens, QWEN3["hidden"], dtype=torch.bfloat16)
    return x, distinct_logits(tokens, QWEN3["experts"], torch.bfloat16), w13, w2


@gpu
@needs_cuda
@pytest.mark.usefixtures("routed_only")
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_gpu_routed_qwen3_30b_a3b(tokens: int) -> None:
    placement = placement_of(list(range(128)) + list(range(0, 128, 8)), 128)  # 16 experts twice
    x, logits, w13, w2 = qwen3_inputs(tokens, 310 + tokens, num_physical=144)
    check_block(x, logits, w13, w2, QWEN3["top_k"], True, placement, f"qwen3-30b-a3b, {tokens} tokens")


@gpu
@needs_cuda
@pytest.mark.usefixtures("routed_only")
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_routed_in_cuda_graph(tokens: int) -> None:
    """Capture once, replay with new activations and logits: the reference's output and counters."""
    x, logits, w13, w2 = qwen3_inputs(tokens, 320 + tokens)
    placement = placement_of(list(range(128)), 128)
    tables = (placement.logical_to_physical, placement.replica_counts)
    counts = torch.zeros(128, dtype=torch.int64, device=DEVICE)
    args = (QWEN3["top_k"], True, *tables, counts, placement.physical_by_token)
    TRITON_OPS.moe_block(x, logits, w13, w2, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON_OPS.moe_block(x, logits, w13, w2, *args)
    for _ in range(3):
        x.copy_(randn(*x.shape, dtype=x.dtype))
        logits.copy_(distinct_logits(tokens, 128, torch.bfloat16))
        before = counts.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_counts = torch.zeros_like(counts)
        ref = moe_block_torch(*up(x), logits, *up(w13, w2), QWEN3["top_k"], True, *tables, ref_counts,
                              placement.physical_by_token)  # fmt: skip
        assert_close(out, ref, torch.bfloat16, "graph replay")
        assert torch.equal(counts - before, ref_counts)


@gpu
@needs_cuda
def test_gpu_routed_has_no_host_sync() -> None:
    x, logits, w13, w2 = qwen3_inputs(2, 330)
    placement = placement_of(list(range(128)), 128)
    counts = torch.zeros(128, dtype=torch.int64, device=DEVICE)
    args = (QWEN3["top_k"], True, placement.logical_to_physical, placement.replica_counts, counts,
            placement.physical_by_token)  # fmt: skip
    TRITON_OPS.moe_block(x, logits, w13, w2, *args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.moe_block(x, logits, w13, w2, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
