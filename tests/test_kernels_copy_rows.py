"""The ``copy_rows`` op (``kernels/triton_copy_rows.py``, ``kernels/copy_rows.py``) and the expert moves
built on it (``engine/moe/rebalance.move_experts``).

Without a GPU the kernel runs in the interpreter. Rows of every dtype the expert tensors have (bf16 weights,
float8 values, float32 scales) and rows whose bytes are not a multiple of 4 (the byte path); rows not written
keep their bytes; rows of one tensor copied within it where no written row is read. The moves: a placement
with chains, cycles and replicas applied by both backends gives every slot its expert's weights.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.copy_rows import copy_rows_torch
from kernels.triton_copy_rows import copy_rows_triton
from tests.kernel_testing import DEVICE, gpu, needs_cuda


def _rows(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (n, *shape[:-1], shape[-1] * torch.finfo(dtype).bits // 8), generator=g)
    return bits.to(torch.uint8).view(dtype).to(DEVICE)


CASES = [
    ((3, 40), torch.bfloat16),  # 240 bytes a row: words
    ((5,), torch.float8_e4m3fn),  # 5 bytes: the byte path
    ((2, 3), torch.float32),  # a float8 weight's scales
    ((7, 1030), torch.bfloat16),  # several chunks of a row when the chunk is small (below)
]


@pytest.mark.parametrize("op", [copy_rows_torch, copy_rows_triton], ids=["torch", "triton"])
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_copy_rows_between_tensors_and_within_one(op, shape, dtype, monkeypatch) -> None:
    from kernels import triton_copy_rows

    monkeypatch.setattr(triton_copy_rows, "CHUNK_BYTES", 1024)
    src = _rows(6, shape, dtype, seed=1)
    dst = _rows(9, shape, dtype, seed=2)
    before = dst.clone()
    src_rows = torch.tensor([4, 0, 4, 5], device=DEVICE)
    dst_rows = torch.tensor([8, 1, 3, 0], device=DEVICE)
    op(src, src_rows, dst, dst_rows)
    want = before.clone()
    want.view(9, -1).view(torch.uint8)[dst_rows] = src.view(6, -1).view(torch.uint8)[src_rows]
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))  # untouched rows kept too
    # Within one tensor: rows 2, 5, 7 read, rows 0, 4 written.
    t = _rows(8, shape, dtype, seed=3)
    old = t.clone()
    op(t, torch.tensor([2, 5], device=DEVICE), t, torch.tensor([4, 0], device=DEVICE))
    raw, was = t.view(8, -1).view(torch.uint8), old.view(8, -1).view(torch.uint8)
    assert torch.equal(raw[4], was[2]) and torch.equal(raw[0], was[5])
    assert torch.equal(raw[[1, 2, 3, 5, 6, 7]], was[[1, 2, 3, 5, 6, 7]])
    kept = t.clone()
    none = torch.tensor([], dtype=torch.int64, device=DEVICE)
    op(t, none, t, none)
    assert torch.equal(t.view(torch.uint8), kept.view(torch.uint8))


@pytest.mark.parametrize("op", [copy_rows_torch, copy_rows_triton], ids=["torch", "triton"])
def test_copy_rows_refuses_rows_that_differ(op) -> None:
    a = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    idx = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="rows of"):
        op(a, idx, torch.zeros(4, 8, dtype=torch.float32, device=DEVICE), idx)
    with pytest.raises(ValueError, match="rows of"):
        op(a, idx, torch.zeros(4, 9, dtype=torch.bfloat16, device=DEVICE), idx)
    with pytest.raises(ValueError, match="destinations"):
        op(a, idx, a, torch.tensor([1, 2], device=DEVICE))


def _chains_and_cycles(num_logical: int, num_physical: int) -> list[int]:
    """A placement from the identity (plus replicas of expert 0) with a 3-cycle, a swap, a chain into a
    replica and a replica of a moved expert: every case of the move's ordering."""
    new = list(range(num_logical)) + [0] * (num_physical - num_logical)
    new[0], new[1], new[2] = new[1], new[2], new[0]  # 3-cycle
    new[3], new[4] = new[4], new[3]  # swap
    new[num_logical] = 5  # a replica slot takes expert 5
    new[5] = 6  # ... whose slot takes 6, whose slot keeps 6 (a chain, read before written)
    new[num_logical + 1] = 1  # expert 1 again, read from its old slot now rewritten
    return new


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_moves_reach_the_placement_through_chains_and_cycles(backend: str) -> None:
    from engine import LLM
    from engine.moe.rebalance import move_experts
    from kernels.ops import get_ops

    llm = LLM("tiny-moe", num_kv_blocks=16, enable_eplb=True, num_redundant_experts=4)
    try:
        blocks = llm.engine.model.moe_blocks()
        layout = llm.engine.moe_layout()
        ops = get_ops(backend)
        for seed, block in enumerate(blocks):
            block.ops = ops
            old = list(block.placement.host)
            w13, w2 = block.w13.detach().clone(), block.w2.detach().clone()
            new = _chains_and_cycles(layout.num_logical, layout.num_physical)
            if seed:  # later layers: the same experts shuffled (longer chains and cycles)
                random.Random(seed).shuffle(new)
            first = {logical: slot for slot, logical in reversed(list(enumerate(old)))}
            moved = move_experts(block, new)
            assert moved == sum(a != b for a, b in zip(old, new, strict=True))
            for slot, logical in enumerate(new):
                assert torch.equal(block.w13[slot], w13[first[logical]]), (slot, logical)
                assert torch.equal(block.w2[slot], w2[first[logical]]), (slot, logical)
            assert block.placement.host == new
    finally:
        llm.close()


@gpu
@needs_cuda
def test_copy_rows_moves_expert_sized_rows_on_the_gpu() -> None:
    """Qwen3-30B-A3B's gate-up rows (6 MiB each), within one tensor: the kernel's chunks at full size."""
    t = torch.randn(24, 1536, 2048, dtype=torch.bfloat16, device="cuda")
    old = t.clone()
    src = torch.tensor([3, 7, 11, 3], device="cuda")
    dst = torch.tensor([0, 20, 21, 22], device="cuda")
    copy_rows_triton(t, src, t, dst)
    torch.cuda.synchronize()
    assert torch.equal(t[dst], old[src])
    keep = [i for i in range(24) if i not in (0, 20, 21, 22)]
    assert torch.equal(t[keep], old[keep])
