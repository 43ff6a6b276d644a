"""The Triton MoE routing kernel (``kernels/triton_moe_routing.py``) against ``moe_route_torch``.

As in ``tests/test_kernels.py``: without a GPU the kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) at small shapes; the ``gpu``-marked tests add
Qwen3-30B-A3B shapes (E = 128, k = 8, bf16), a no-host-sync check and CUDA-graph capture.

Every output buffer the op allocates starts poisoned (floats NaN, integers a sentinel), so an unwritten
element fails. Logits have no ties (torch.topk's order among ties is unspecified), so the physical ids
must match the reference exactly; the weights match the float32 reference under per-dtype bounds.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import moe_route_torch
from kernels.triton_moe_routing import moe_route_triton
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import DEVICE, DTYPES, assert_close, gpu, needs_cuda

INT_POISON = -7_777_777


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor from torch.empty starts as NaN (floats) or a sentinel (integers)."""
    empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else INT_POISON)

    monkeypatch.setattr(torch, "empty", poisoned)


class Placement:
    """A layer's replica tables, built as ``engine.moe.layer.ExpertPlacement`` builds them."""

    def __init__(self, physical_to_logical: list[int], num_logical: int) -> None:
        replicas: list[list[int]] = [[] for _ in range(num_logical)]
        for phys, logical in enumerate(physical_to_logical):
            replicas[logical].append(phys)
        width = max(len(r) for r in replicas)
        table = [r + [-1] * (width - len(r)) for r in replicas]
        self.num_physical = len(physical_to_logical)
        self.logical_to_physical = torch.tensor(table, dtype=torch.int64, device=DEVICE)
        self.replica_counts = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=DEVICE)


# 8 logical experts on 11 physical ones, in no logical order: expert 1 has 3 replicas, expert 3 has 2.
EIGHT_ON_ELEVEN = [3, 1, 6, 0, 1, 5, 3, 2, 7, 1, 4]


def random_placement(num_logical: int, extra: int, seed: int) -> Placement:
    """Every logical expert once plus ``extra`` replicas of random experts, shuffled over physical slots."""
    g = torch.Generator().manual_seed(seed)
    p2l = list(range(num_logical)) + torch.randint(0, num_logical, (extra,), generator=g).tolist()
    order = torch.randperm(len(p2l), generator=g).tolist()
    return Placement([p2l[i] for i in order], num_logical)


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with no two equal in a row, exactly representable in ``dtype``."""
    if dtype == torch.float32:
        x = torch.randn(tokens, experts, device=DEVICE) * 2
    else:
        # Distinct integers in [-128, 128) (exact in bf16 and fp16) scaled by a power of two.
        codes = torch.rand(tokens, 256, device=DEVICE).argsort(dim=-1)[:, :experts]
        x = (codes - 128).float() / 32
    x = x.to(dtype)
    if x.numel():
        assert (x.float().sort(dim=-1).values.diff(dim=-1) != 0).all(), "tied logits"
    return x


def check_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    placement: Placement,
    out_dtype: torch.dtype,
    counts_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route with both ops (from the same starting counters) and compare everything they produce."""
    if counts_start is None:
        counts_start = torch.zeros(placement.num_physical, dtype=torch.int64, device=DEVICE)
    counts, ref_counts = counts_start.clone(), counts_start.clone()
    tables = (placement.logical_to_physical, placement.replica_counts)
    weights, ids = moe_route_triton(logits, top_k, renormalize, *tables, counts, out_dtype)
    ref_w, ref_ids = moe_route_torch(logits, top_k, renormalize, *tables, ref_counts, torch.float32)
    assert weights.dtype == out_dtype and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, ref_ids), "physical ids differ from the reference"
    assert_close(weights, ref_w, out_dtype, "routing weights")
    assert torch.equal(counts, ref_counts), "expert_counts increments differ from the reference"
    return weights, ids


# ---------------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts", [8, 60, 128, 256])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_matches_reference(
    dtype: torch.dtype, num_experts: int, top_k: int, renormalize: bool
) -> None:
    torch.manual_seed(100 + num_experts + top_k)
    placement = random_placement(num_experts, extra=num_experts // 4 + 1, seed=num_experts)
    logits = distinct_logits(13, num_experts, dtype)
    weights, _ = check_route(logits, top_k, renormalize, placement, dtype)
    # Descending weight order within each token.
    assert (weights.float().diff(dim=-1) <= 0).all()
    if renormalize:
        assert_close(weights.float().sum(-1), torch.ones(13, device=DEVICE), dtype, "renormalised sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_replicas_out_of_logical_order(dtype: torch.dtype) -> None:
    torch.manual_seed(101)
    placement = Placement(EIGHT_ON_ELEVEN, 8)
    assert placement.num_physical == 11 and placement.replica_counts.max().item() == 3
    tokens = 37  # several tokens per replica residue, so every replica is used
    logits = distinct_logits(tokens, 8, dtype)
    _, ids = check_route(logits, 2, True, placement, dtype)
    # Each pair's physical expert serves the logical expert the reference picked.
    p2l = torch.tensor(EIGHT_ON_ELEVEN, device=DEVICE)
    top_logical = torch.topk(logits.float(), 2, dim=-1).indices
    assert torch.equal(p2l[ids], top_logical)


def test_moe_route_all_experts_routed() -> None:
    """k = E: every expert appears once per token, so every token adds one to exactly E counters."""
    torch.manual_seed(102)
    placement = Placement(EIGHT_ON_ELEVEN, 8)
    check_route(distinct_logits(9, 8, torch.float32), 8, False, placement, torch.float32)


def test_moe_route_counters_accumulate_across_calls() -> None:
    torch.manual_seed(103)
    placement = Placement(EIGHT_ON_ELEVEN, 8)
    counts = torch.randint(0, 50, (placement.num_physical,), dtype=torch.int64, device=DEVICE)
    ref_counts = counts.clone()
    tables = (placement.logical_to_physical, placement.replica_counts)
    for tokens in (21, 5):
        logits = distinct_logits(tokens, 8, torch.bfloat16)
        moe_route_triton(logits, 2, True, *tables, counts, torch.bfloat16)
        moe_route_torch(logits, 2, True, *tables, ref_counts, torch.bfloat16)
    assert torch.equal(counts, ref_counts)


@pytest.mark.parametrize("live_dtype", [torch.bool, torch.int32])
def test_moe_route_counts_only_live_rows(live_dtype: torch.dtype) -> None:
    """With ``live`` (a graph's live rows, or its sequence lengths: 0 on padding rows, and longer than the
    pass), only live rows' pairs count; the routing itself is the same."""
    torch.manual_seed(106)
    placement = Placement(EIGHT_ON_ELEVEN, 8)
    tables = (placement.logical_to_physical, placement.replica_counts)
    tokens = 23
    live = torch.zeros(32, dtype=live_dtype, device=DEVICE)
    live[torch.tensor([0, 3, 4, 10, 22])] = 7 if live_dtype == torch.int32 else True
    live[25] = 1  # past the pass's rows: not read
    logits = distinct_logits(tokens, 8, torch.bfloat16)
    zero = torch.zeros(placement.num_physical, dtype=torch.int64, device=DEVICE)
    counts, ref_counts, all_counts = zero.clone(), zero.clone(), zero.clone()
    w, ids = moe_route_triton(logits, 2, True, *tables, counts, torch.bfloat16, live)
    ref_w, ref_ids = moe_route_torch(logits, 2, True, *tables, ref_counts, torch.bfloat16, live)
    all_w, all_ids = moe_route_torch(logits, 2, True, *tables, all_counts, torch.bfloat16)
    assert torch.equal(ids, ref_ids) and torch.equal(ref_ids, all_ids) and torch.equal(ref_w, all_w)
    assert torch.equal(counts, ref_counts) and int(counts.sum()) == 5 * 2
    expected = torch.bincount(ids[live[:tokens] != 0].reshape(-1), minlength=placement.num_physical)
    assert torch.equal(counts, expected) and int(all_counts.sum()) == tokens * 2


def test_moe_route_out_dtype_differs_from_logits() -> None:
    """fp32 router logits (a float32 gate), bf16 activations: the weights come out in bf16."""
    torch.manual_seed(104)
    placement = random_placement(60, extra=4, seed=1)
    check_route(distinct_logits(11, 60, torch.float32), 8, True, placement, torch.bfloat16)


def test_moe_route_strided_logits() -> None:
    torch.manual_seed(105)
    placement = random_placement(60, extra=6, seed=2)
    wide = distinct_logits(10, 64, torch.bfloat16)
    check_route(wide[:, :60], 8, True, placement, torch.bfloat16)  # rows with a stride of 64
    column_major = distinct_logits(60, 10, torch.float32).t()  # [10, 60], strides (1, 10)
    check_route(column_major, 2, False, placement, torch.float32)


def test_moe_route_many_tokens_per_program() -> None:
    """Enough tokens that each program routes several (and the last one is partial)."""
    torch.manual_seed(106)
    placement = random_placement(60, extra=8, seed=3)
    check_route(distinct_logits(301, 60, torch.bfloat16), 8, True, placement, torch.bfloat16)


def test_moe_route_no_tokens() -> None:
    placement = Placement(EIGHT_ON_ELEVEN, 8)
    counts = torch.arange(placement.num_physical, dtype=torch.int64, device=DEVICE)
    logits = torch.empty(0, 8, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = moe_route_triton(
        logits, 2, True, placement.logical_to_physical, placement.replica_counts, counts, torch.bfloat16
    )
    assert weights.shape == ids.shape == (0, 2)
    assert weights.dtype == torch.bfloat16 and ids.dtype == torch.int64
    assert torch.equal(counts, torch.arange(placement.num_physical, device=DEVICE))


def test_moe_route_ties_pick_the_lowest_expert() -> None:
    """The documented tie rule (torch.topk leaves it unspecified): equal logits go lowest index first."""
    placement = Placement(list(range(8)), 8)
    counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = 1.0  # one clear winner, then the tie among the rest
    weights, ids = moe_route_triton(
        logits, 3, False, placement.logical_to_physical, placement.replica_counts, counts, torch.float32
    )
    assert ids.tolist() == [[0, 1, 2], [5, 0, 1], [0, 1, 2]]
    assert_close(weights[0], torch.full((3,), 1 / 8, device=DEVICE), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_moe_route_ties_among_negatives_and_signed_zeros(dtype: torch.dtype) -> None:
    """The selection keys (32 bits for 16-bit logits, 64 for float32) keep the tie rule where the sign bit
    flips a key's low bits: -0.0 ties with +0.0, and equal negatives go lowest index first too."""
    placement = Placement(list(range(8)), 8)
    counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    row = [-1.0, -0.0, 0.0, -1.0, -0.0, -2.5, -1.0, -2.5]
    logits = torch.tensor([row, row[::-1]], device=DEVICE, dtype=dtype)
    weights, ids = moe_route_triton(
        logits, 8, False, placement.logical_to_physical, placement.replica_counts, counts, torch.float32
    )
    assert ids.tolist() == [[1, 2, 4, 0, 3, 6, 5, 7], [3, 5, 6, 1, 4, 7, 0, 2]]
    ref_w, _ = moe_route_torch(logits, 8, False, placement.logical_to_physical, placement.replica_counts,
                               torch.zeros_like(counts), torch.float32)  # fmt: skip
    assert_close(weights, ref_w, torch.float32, "weights of tied logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_route_neighbouring_16_bit_logits(dtype: torch.dtype) -> None:
    """Logits one unit in the last place apart (both signs, at two exponents, and a zero), shuffled:
    packing the expert index into the widened mantissa must not reorder any two of them. (Not subnormal or
    tiny ones: their softmax probabilities tie in float32, so the reference leaves their order open.)"""
    torch.manual_seed(107)
    one, four = (0x3F80, 0x4080) if dtype == torch.bfloat16 else (0x3C00, 0x4400)
    codes = [one + i for i in range(16)] + [0x8000 | (one + i) for i in range(16)]
    codes += [four + i for i in range(15)] + [0x8000 | (four + i) for i in range(15)] + [0]
    bits = torch.tensor(codes, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).to(DEVICE)  # 63 distinct values
    logits = torch.stack([values[torch.randperm(63)] for _ in range(5)])
    check_route(logits, 8, True, Placement(list(range(63)), 63), dtype)
    # Every one of the 63, in order: the full ranking survives packing.
    check_route(logits, 63, False, Placement(list(range(63)), 63), torch.float32)


def test_moe_route_neighbouring_float32_logits() -> None:
    """float32 logits one unit in the last place apart (both signs, two exponents), shuffled: their keys
    take 64 bits, and every one of them is ranked by its exact value (a key that dropped low mantissa bits
    would rank such neighbours by index instead). Compared with the logits' own order, as softmax
    probabilities this close may round alike."""
    torch.manual_seed(108)
    codes = [0x3F800000 + i for i in range(16)] + [0xBF800000 + i for i in range(16)]
    codes += [0x40800000 + i for i in range(15)] + [0xC0800000 + i for i in range(16)]
    values = torch.tensor(codes, dtype=torch.int64).to(torch.int32).view(torch.float32).to(DEVICE)
    logits = torch.stack([values[torch.randperm(63)] for _ in range(4)])
    placement = Placement(list(range(63)), 63)
    counts = torch.zeros(63, dtype=torch.int64, device=DEVICE)
    tables = (placement.logical_to_physical, placement.replica_counts)
    weights, ids = moe_route_triton(logits, 63, False, *tables, counts, torch.float32)
    assert torch.equal(ids, logits.argsort(dim=-1, descending=True, stable=True))
    ref_w, _ = moe_route_torch(logits, 63, False, *tables, torch.zeros_like(counts), torch.float32)
    assert_close(weights, ref_w, torch.float32, "weights of neighbouring logits")


def test_moe_route_rejects_k_above_experts() -> None:
    placement = Placement(list(range(8)), 8)
    counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="top_k=9"):
        moe_route_triton(
            torch.zeros(2, 8, device=DEVICE), 9, True, placement.logical_to_physical,
            placement.replica_counts, counts, torch.float32,
        )  # fmt: skip


def test_triton_table_routes_with_the_kernel() -> None:
    assert TRITON_OPS.moe_route is moe_route_triton


# ---------------------------------------------------------------------------------------------------------
# GPU: model shapes, no host sync, CUDA graphs


QWEN3_EXPERTS, QWEN3_TOP_K = 128, 8


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_moe_route_qwen3_shapes(tokens: int, dtype: torch.dtype) -> None:
    """bf16 logits take the 32-bit selection keys, float32 ones the 64-bit keys."""
    torch.manual_seed(200 + tokens)
    placement = random_placement(QWEN3_EXPERTS, extra=16, seed=tokens)
    logits = distinct_logits(tokens, QWEN3_EXPERTS, dtype)
    start = torch.randint(0, 1000, (placement.num_physical,), dtype=torch.int64, device=DEVICE)
    check_route(logits, QWEN3_TOP_K, True, placement, torch.bfloat16, counts_start=start)


@gpu
@needs_cuda
def test_gpu_moe_route_has_no_host_sync() -> None:
    torch.manual_seed(201)
    placement = random_placement(QWEN3_EXPERTS, extra=16, seed=201)
    counts = torch.zeros(placement.num_physical, dtype=torch.int64, device=DEVICE)
    logits = distinct_logits(8, QWEN3_EXPERTS, torch.bfloat16)
    tables = (placement.logical_to_physical, placement.replica_counts)
    moe_route_triton(logits, QWEN3_TOP_K, True, *tables, counts, torch.bfloat16)  # compile outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_route_triton(logits, QWEN3_TOP_K, True, *tables, counts, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@needs_cuda
def test_gpu_moe_route_in_cuda_graph() -> None:
    """Capture once, replay with new logits: the reference's weights, ids and counter increments."""
    torch.manual_seed(202)
    tokens = 16
    placement = random_placement(QWEN3_EXPERTS, extra=16, seed=202)
    tables = (placement.logical_to_physical, placement.replica_counts)
    counts = torch.zeros(placement.num_physical, dtype=torch.int64, device=DEVICE)
    logits = distinct_logits(tokens, QWEN3_EXPERTS, torch.bfloat16)
    moe_route_triton(logits, QWEN3_TOP_K, True, *tables, counts, torch.bfloat16)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = moe_route_triton(logits, QWEN3_TOP_K, True, *tables, counts, torch.bfloat16)
    for _ in range(2):
        logits.copy_(distinct_logits(tokens, QWEN3_EXPERTS, torch.bfloat16))
        before = counts.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_counts = torch.zeros_like(counts)
        ref_w, ref_ids = moe_route_torch(logits, QWEN3_TOP_K, True, *tables, ref_counts, torch.float32)
        assert torch.equal(ids, ref_ids)
        assert_close(weights, ref_w, torch.bfloat16, "graph-replayed routing weights")
        assert torch.equal(counts - before, ref_counts)
