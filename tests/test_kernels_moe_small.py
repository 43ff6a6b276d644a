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

from engine.moe import layer
from engine.moe.layer import ExpertPlacement
from kernels import triton_moe
from kernels.moe import fused_moe_torch, routed_moe_torch
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


# ---------------------------------------------------------------------------------------------------------
# Routing inside the small path (``routed_moe_triton``): the routing launch folded into the two kernels


def placement_with_replicas(num_logical: int, extra: int, seed: int) -> ExpertPlacement:
    """Every logical expert once plus ``extra`` replicas, shuffled over the physical slots."""
    g = torch.Generator().manual_seed(seed)
    p2l = list(range(num_logical)) + torch.randint(0, num_logical, (extra,), generator=g).tolist()
    order = torch.randperm(len(p2l), generator=g).tolist()
    return ExpertPlacement([p2l[i] for i in order], num_logical, torch.device(DEVICE))


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Router logits with no ties in a row (the top-k order among ties is the reference's choice)."""
    codes = torch.rand(tokens, 256, device=DEVICE).argsort(dim=-1)[:, :experts]
    return ((codes - 128).float() / 32).to(dtype)


def routed_pair(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    placement: ExpertPlacement,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed op and the two ops it replaces (route, then the small path) from zeroed counters:
    (routed output, its counters, two-op output, their counters)."""
    p = placement
    tables = (p.logical_to_physical, p.replica_counts)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=DEVICE)
    out = TRITON_OPS.routed_moe(x, logits, w13, w2, top_k, renormalize, *tables, p.physical_by_row, counts)
    two_counts = torch.zeros_like(counts)
    weights, ids = TRITON_OPS.moe_route(logits, top_k, renormalize, *tables, two_counts, x.dtype)
    two_ops = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    return out, counts, two_ops, two_counts


@pytest.fixture
def no_routing_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The routing kernel's entry point raises inside ``triton_moe``: the routed op must route itself."""

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("launched the routing kernel")

    monkeypatch.setattr(triton_moe, "moe_route_triton", fail)


@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "renormalize"), [(1, 3, True), (3, 2, False), (5, 4, True)])
def test_routed_small_path_equals_route_then_experts(
    tokens: int, top_k: int, renormalize: bool, dtype: torch.dtype, logits_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Same experts, weights and counters as the routing op, so the output is the two ops' bit for bit,
    and within bounds of the float32 reference (``routed_moe_torch``); replicas spread the rows."""
    torch.manual_seed(140 + tokens + top_k)
    placement = placement_with_replicas(12, extra=9, seed=tokens)
    w13, w2 = make_weights(21, HIDDEN, INTER, dtype)
    x = randn(tokens, HIDDEN, dtype=dtype)
    logits = distinct_logits(tokens, 12, logits_dtype)
    route = triton_moe.moe_route_triton
    monkeypatch.setattr(triton_moe, "moe_route_triton", lambda *_a, **_k: pytest.fail("routing launch"))
    p = placement
    counts = torch.zeros(21, dtype=torch.int64, device=DEVICE)
    tables = (p.logical_to_physical, p.replica_counts)
    out = TRITON_OPS.routed_moe(x, logits, w13, w2, top_k, renormalize, *tables, p.physical_by_row, counts)
    monkeypatch.setattr(triton_moe, "moe_route_triton", route)
    two_counts = torch.zeros_like(counts)
    weights, ids = route(logits, top_k, renormalize, *tables, two_counts, dtype)
    assert torch.equal(out, TRITON_OPS.fused_moe(x, w13, w2, weights, ids)), "differs from the two ops"
    assert torch.equal(counts, two_counts) and int(counts.sum()) == tokens * top_k
    ref_counts = torch.zeros_like(counts)
    x32, w13_32, w2_32 = up(x, w13, w2)
    ref = routed_moe_torch(x32, logits.float(), w13_32, w2_32, top_k, renormalize, *tables, None, ref_counts)
    assert torch.equal(counts, ref_counts)
    assert_close(out, ref, dtype, "routed small path")


@pytest.mark.usefixtures("small_path_only", "no_routing_launch")
def test_routed_small_path_ties_and_row_table() -> None:
    """Tied logits go lowest expert first in both kernels alike; token t uses row t of the replica table
    (here a table with a replica per row residue that differs for every token)."""
    torch.manual_seed(150)
    placement = ExpertPlacement([0, 1, 2, 3, 1, 1, 2], 4, torch.device(DEVICE))
    w13, w2 = make_weights(7, HIDDEN, INTER, torch.float32)
    x = randn(3, HIDDEN)  # 6 pairs on 7 physical experts: the small path
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 3, device=DEVICE)
    p = placement
    counts = torch.zeros(7, dtype=torch.int64, device=DEVICE)
    tables = (p.logical_to_physical, p.replica_counts)
    out = TRITON_OPS.routed_moe(x, logits, w13, w2, 2, True, *tables, p.physical_by_row, counts)
    # Experts 0 and 1 for every token; expert 1's replicas 1, 4, 5 in turn by token.
    assert counts.tolist() == [3, 1, 0, 0, 1, 1, 0]
    ids = torch.tensor([[0, 1], [0, 4], [0, 5]], device=DEVICE)
    weights = torch.full((3, 2), 0.5, device=DEVICE)
    assert_close(out, fused_moe_torch(x, w13, w2, weights, ids), torch.float32, "tied logits")


def test_routed_falls_back_past_the_small_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """More pairs than the small path takes, or more tokens than the row table holds: the routing kernel
    then the grouped or small path, with the same result as the two ops."""
    torch.manual_seed(160)
    placement = placement_with_replicas(8, extra=3, seed=7)
    w13, w2 = make_weights(11, HIDDEN, INTER, torch.float32)
    x = randn(9, HIDDEN)
    logits = distinct_logits(9, 8, torch.float32)
    out, counts, two_ops, two_counts = routed_pair(x, logits, w13, w2, 2, True, placement)  # 18 > 11 pairs
    assert torch.equal(out, two_ops) and torch.equal(counts, two_counts)
    short = ExpertPlacement(placement.physical_to_logical.tolist(), 8, torch.device(DEVICE))
    short.physical_by_row = short.physical_by_row[:2]  # a table of two rows: three tokens fall back
    out, counts, two_ops, two_counts = routed_pair(x[:3], logits[:3], w13, w2, 2, True, short)
    assert torch.equal(out, two_ops) and torch.equal(counts, two_counts)


def test_physical_by_row_matches_the_replica_rule() -> None:
    placement = placement_with_replicas(6, extra=7, seed=3)
    l2p, reps = placement.logical_to_physical, placement.replica_counts
    table = placement.physical_by_row
    assert table.dtype == torch.int32 and table.shape == (layer.PHYSICAL_ROWS, 6)
    for t in (0, 1, 2, 5, 63):
        for e in range(6):
            assert int(table[t, e]) == int(l2p[e, t % int(reps[e])])


@gpu
@needs_cuda
@pytest.mark.usefixtures("small_path_only")
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_routed_small_path_qwen3_in_cuda_graph(tokens: int) -> None:
    """The Qwen3-30B-A3B shape (bf16 logits: 32-bit keys) with replicas: captured once, replayed with new
    activations and logits; each replay equals the routing op then the small path, counters included."""
    torch.manual_seed(170 + tokens)
    shape = QWEN3_30B_A3B
    placement = placement_with_replicas(shape["experts"], extra=16, seed=tokens)
    w13, w2 = make_weights(shape["experts"] + 16, shape["hidden"], shape["inter"], torch.bfloat16)
    x = randn(tokens, shape["hidden"], dtype=torch.bfloat16)
    logits = distinct_logits(tokens, shape["experts"], torch.bfloat16)
    p = placement
    tables = (p.logical_to_physical, p.replica_counts)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=DEVICE)

    def routed() -> torch.Tensor:
        return TRITON_OPS.routed_moe(
            x, logits, w13, w2, shape["top_k"], True, *tables, p.physical_by_row, counts
        )

    routed()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed()
    for _ in range(3):
        x.copy_(randn(*x.shape, dtype=x.dtype))
        logits.copy_(distinct_logits(tokens, shape["experts"], torch.bfloat16))
        counts.zero_()
        graph.replay()
        two_counts = torch.zeros_like(counts)
        weights, ids = TRITON_OPS.moe_route(logits, shape["top_k"], True, *tables, two_counts, x.dtype)
        assert torch.equal(out, TRITON_OPS.fused_moe(x, w13, w2, weights, ids))
        assert torch.equal(counts, two_counts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        routed()
    finally:
        torch.cuda.set_sync_debug_mode("default")
