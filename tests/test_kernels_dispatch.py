"""The expert-parallel exchange's row ops (``kernels/triton_dispatch.py``) against ``kernels/dispatch.py``.

Without a GPU the kernels run in the Triton interpreter (``tests/conftest.py``). Both are exact (copies and
a selection), so the Triton results must equal the reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kernels.dispatch import (
    PART_ALIGN,
    ROW_ALIGN,
    local_routing_torch,
    pack_rows_torch,
    packed_layout,
    packed_views,
)
from kernels.triton_dispatch import local_routing_triton, pack_rows_triton
from tests.kernel_testing import DEVICE, DTYPES, poison_allocations, randn  # noqa: F401  (autouse fixture)


def routing_case(
    tokens: int, top_k: int, hidden: int, dtype: torch.dtype, experts: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, ids, weights) as the dispatcher packs them."""
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE)
    weights = torch.rand(tokens, top_k, device=DEVICE).to(dtype)
    x = randn(tokens, 2 * hidden, dtype=dtype)[:, :hidden]  # rows with a stride wider than the row
    return x, ids, weights


def part_views(packed: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return packed_views(packed, [(p.dtype, p.shape[1]) for p in parts])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 40), (3, 3, 100), (5, 2, 24), (2, 2, 4100)])
def test_pack_rows_matches_reference(tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(300 + tokens)
    parts = routing_case(tokens, top_k, hidden, dtype)
    got, want = pack_rows_triton(parts), pack_rows_torch(parts)
    assert got.shape == want.shape == (tokens, want.shape[1]) and got.dtype == torch.uint8
    assert want.shape[1] % ROW_ALIGN == 0
    for g, w, p in zip(part_views(got, parts), part_views(want, parts), parts, strict=True):
        assert g.dtype == p.dtype and torch.equal(g, w) and torch.equal(g, p)  # padding bytes excepted
        assert (g.data_ptr() - got.data_ptr()) % PART_ALIGN == 0 and g.stride(
            0
        ) * g.element_size() % ROW_ALIGN == 0


@pytest.mark.parametrize("live_kind", ["bool", "seq_lens", "column"])
def test_pack_rows_marks_padding_rows_absent(live_kind: str) -> None:
    """``live`` zero on a row: its ids are packed as -1 (no expert runs it); everything else as without."""
    torch.manual_seed(301)
    parts = routing_case(6, 8, 72, torch.bfloat16)
    real = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool, device=DEVICE)  # longer than the rows
    live = {
        "bool": real,
        "seq_lens": torch.where(real, torch.arange(3, 11, device=DEVICE), 0).to(torch.int32),
        "column": real.unsqueeze(1),
    }[live_kind]
    got, want = pack_rows_triton(parts, live), pack_rows_torch(parts, live)
    (gx, gids, gw), (wx, wids, ww) = part_views(got, parts), part_views(want, parts)
    assert torch.equal(gx, wx) and torch.equal(gw, ww) and torch.equal(gids, wids)
    assert torch.equal(gx, parts[0]) and torch.equal(gw, parts[2])
    padding = ~real[:6]
    assert bool(gids[padding].eq(-1).all()) and torch.equal(gids[~padding], parts[1][~padding])
    assert parts[1].ge(0).all()  # the inputs are untouched
    with pytest.raises(ValueError, match="does not cover"):
        pack_rows_triton(parts, real[:5])
    with pytest.raises(ValueError, match="does not cover"):
        pack_rows_torch(parts, real.view(2, 4))


def test_packed_layout() -> None:
    """Parts in order, each on a 16-byte boundary, rows a multiple of 128 bytes."""
    layout = [(torch.bfloat16, 2048), (torch.int64, 8), (torch.bfloat16, 8)]
    assert packed_layout(layout) == ([0, 4096, 4160], 4224)
    assert packed_layout([(torch.float16, 3), (torch.int64, 1), (torch.float32, 5)]) == ([0, 16, 32], 128)


def test_pack_rows_checks_its_parts() -> None:
    x, ids, weights = routing_case(2, 4, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        pack_rows_triton((x.t().contiguous().t(), ids, weights))
    assert pack_rows_triton((x[:0], ids[:0], weights[:0])).shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rank", "ranks"), [(0, 2), (1, 2), (2, 4)])
def test_local_routing_matches_reference(rank: int, ranks: int, dtype: torch.dtype) -> None:
    """On views into a gathered buffer, as the dispatcher calls it: every rank's ids, -1 where another
    rank holds the expert."""
    torch.manual_seed(310 + rank)
    experts = 16
    parts = routing_case(7, 4, 40, dtype, experts)
    _, ids, weights = part_views(pack_rows_torch(parts), parts)
    assert not ids.is_contiguous()
    per_rank = experts // ranks
    got_ids, got_w = local_routing_triton(ids, weights, rank * per_rank, per_rank)
    want_ids, want_w = local_routing_torch(ids, weights, rank * per_rank, per_rank)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert got_ids.is_contiguous() and got_w.is_contiguous() and got_ids.dtype == ids.dtype
    mine = (parts[1] // per_rank) == rank
    assert torch.equal(got_ids, torch.where(mine, parts[1] % per_rank, -1))
    assert (got_ids == -1).any() and (got_ids >= 0).any()
    empty_ids, empty_w = local_routing_triton(ids[:0], weights[:0], 0, per_rank)
    assert empty_ids.shape == (0, 4) and empty_w.shape == (0, 4)
