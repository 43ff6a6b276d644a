"""DeepSeek's EPLB policy (eplb_svc/policy.py): every expert kept, even slots per rank, replicas for the hot
experts, better balance on skewed load, slots kept where experts stay, determinism, both paths."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from eplb_svc.policy import (
    balanced_packing,
    keep_slots,
    minimise_moves,
    moved_slots,
    placement_balancedness,
    rank_loads,
    rebalance,
    replicate_experts,
)
from mesh.expert_placement import PlacementError, balancedness, check_placement, initial_placement


def _skewed(layers: int, logical: int, seed: int = 0, hot: int = 3) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        row = [rng.randint(10, 50) for _ in range(logical)]
        for e in rng.sample(range(logical), hot):
            row[e] *= 20
        out.append(row)
    return out


@pytest.mark.parametrize(("logical", "physical", "ranks"), [(8, 10, 2), (16, 16, 4), (16, 24, 4), (8, 12, 1)])
def test_every_logical_expert_kept_and_slots_even_over_ranks(logical: int, physical: int, ranks: int) -> None:
    load = _skewed(3, logical)
    new = rebalance(load, physical, ranks)
    check_placement(new, 3, logical, physical)  # every expert at least once, ids in range
    assert all(len(row) == physical for row in new)


def test_replicas_go_to_the_hottest_experts() -> None:
    load = [[1.0, 1.0, 100.0, 1.0, 1.0, 50.0, 1.0, 1.0]]
    new = rebalance(load, 11, 1)
    counts = Counter(new[0])
    # Highest load per replica first: 100 -> 2 replicas (50 each), then 5 and 2 tie at 50: the lower id.
    assert counts[2] == 3 and counts[5] == 2, counts
    phys, count = replicate_experts(load[0], 11)
    assert phys[:8] == list(range(8)) and count[2] == 3 and count[5] == 2


def test_balancedness_improves_on_skewed_load() -> None:
    load = _skewed(4, 16, seed=3)
    old = initial_placement(4, 16, 20)
    new = rebalance(load, 20, 4)
    before, after = placement_balancedness(load, old, 4), placement_balancedness(load, new, 4)
    assert after > before + 0.1, (before, after)
    assert after > 0.85
    # One layer: the same as mesh.expert_placement.balancedness of the per-rank loads.
    assert placement_balancedness(load[:1], new[:1], 4) == pytest.approx(
        balancedness(rank_loads(load[0], new[0], 4))
    )


def test_balanced_packing_fills_each_pack_equally_lightest_first() -> None:
    place = balanced_packing([9.0, 1.0, 8.0, 2.0], 2)
    packs = {p: sorted(i for i, (q, _) in enumerate(place) if q == p) for p in (0, 1)}
    assert packs == {0: [0, 1], 1: [2, 3]}  # 9 -> pack 0, 8 -> pack 1, 2 -> pack 1 (8 < 9), 1 -> pack 0
    with pytest.raises(PlacementError, match="do not divide"):
        balanced_packing([1.0, 2.0, 3.0], 2)


def test_minimal_moves_keep_an_expert_in_its_old_slot_on_its_rank() -> None:
    old = [0, 1, 2, 3, 4, 5, 6, 7]
    new = [3, 9, 0, 1, 4, 5, 7, 6]  # rank 0 holds {0, 1, 3, 9}; rank 1 the same experts in another order
    kept = keep_slots(old, new, 2)
    assert kept == [0, 1, 9, 3, 4, 5, 6, 7]
    assert sorted(kept[:4]) == sorted(new[:4]) and sorted(kept[4:]) == sorted(new[4:])  # same balance
    load = _skewed(3, 16, seed=5)
    before = initial_placement(3, 16, 20)
    raw = rebalance(load, 20, 4)
    kept_all = minimise_moves(before, raw, 4)
    assert moved_slots(before, kept_all) < moved_slots(before, raw)
    assert placement_balancedness(load, kept_all, 4) == pytest.approx(placement_balancedness(load, raw, 4))


def test_replicas_that_stay_keep_their_slots_too() -> None:
    assert keep_slots([5, 5, 1, 2], [2, 5, 5, 3], 1) == [5, 5, 3, 2]


def test_the_same_inputs_give_the_same_placement() -> None:
    load = _skewed(5, 32, seed=11)
    old = initial_placement(5, 32, 40)
    first = minimise_moves(old, rebalance(load, 40, 8, num_nodes=2, num_groups=4), 8)
    for _ in range(3):
        assert minimise_moves(old, rebalance(load, 40, 8, num_nodes=2, num_groups=4), 8) == first
    ties = [[10.0] * 8]
    assert rebalance(ties, 12, 2) == rebalance(ties, 12, 2)


def test_hierarchical_keeps_each_expert_group_on_one_node() -> None:
    """4 groups of 4 experts over 2 nodes of 2 ranks: each group's experts, replicas included, stay on the
    node its group was packed onto, and the nodes get two groups each."""
    load = _skewed(2, 16, seed=7)
    new = rebalance(load, 24, 4, num_nodes=2, num_groups=4)
    check_placement(new, 2, 16, 24)
    for row in new:
        node_of_group: dict[int, set[int]] = {}
        for slot, e in enumerate(row):
            node_of_group.setdefault(e // 4, set()).add(slot // 12)
        assert all(len(nodes) == 1 for nodes in node_of_group.values()), row
        assert Counter(next(iter(n)) for n in node_of_group.values()) == {0: 2, 1: 2}


def test_global_path_when_groups_do_not_divide_over_nodes() -> None:
    """3 groups over 2 nodes: global placement, the same as asking for one node."""
    load = _skewed(2, 12, seed=9)
    assert rebalance(load, 16, 4, num_nodes=2, num_groups=3) == rebalance(load, 16, 4)
    # and hierarchical differs from global where it applies (groups pinned to nodes)
    load2 = _skewed(2, 16, seed=7)
    assert rebalance(load2, 24, 4, num_nodes=2, num_groups=4) != rebalance(load2, 24, 4)


def test_shapes_that_cannot_be_placed_are_errors() -> None:
    with pytest.raises(PlacementError, match="do not divide over 3 ranks"):
        rebalance([[1.0] * 8], 10, 3)
    with pytest.raises(PlacementError, match="cannot hold"):
        rebalance([[1.0] * 8], 6, 2)


# ---- the same placements as DeepSeek's reference (eplb.py, vendored by vLLM), in torch ----------------


def _ref_balanced_packing(weight, num_packs):  # type: ignore[no-untyped-def]
    import torch

    num_layers, num_groups = weight.shape
    groups_per_pack = num_groups // num_packs
    if groups_per_pack == 1:
        pack_index = torch.arange(num_groups, dtype=torch.int64).expand(weight.shape)
        return pack_index, torch.zeros_like(weight, dtype=torch.int64)
    indices = weight.float().sort(-1, descending=True).indices
    pack_index = torch.full_like(weight, -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for i in range(num_layers):
        pack_weights = [0.0] * num_packs
        pack_items = [0] * num_packs
        for group in indices[i].tolist():
            pack = min(
                (p for p in range(num_packs) if pack_items[p] < groups_per_pack), key=pack_weights.__getitem__
            )
            pack_index[i, group] = pack
            rank_in_pack[i, group] = pack_items[pack]
            pack_weights[pack] += float(weight[i, group])
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def _ref_replicate(weight, num_phy):  # type: ignore[no-untyped-def]
    import torch

    n, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(n, 1)
    rank = torch.zeros(n, num_phy, dtype=torch.int64)
    logcnt = torch.ones(n, num_log, dtype=torch.int64)
    arangen = torch.arange(n, dtype=torch.int64)
    for i in range(num_log, num_phy):
        redundant = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = redundant
        rank[:, i] = logcnt[arangen, redundant]
        logcnt[arangen, redundant] += 1
    return phy2log, rank, logcnt


def _ref_rebalance(weight, num_physical, num_groups, num_nodes, num_gpus):  # type: ignore[no-untyped-def]
    import torch

    num_layers, num_logical = weight.shape
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus

    def inverse(perm):  # type: ignore[no-untyped-def]
        inv = torch.empty_like(perm)
        inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
        return inv

    tokens_per_group = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack_index, group_rank_in_pack = _ref_balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack_index * groups_per_node + group_rank_in_pack) * group_size).unsqueeze(-1)
        + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = inverse(log2mlog)
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, _, mlogcnt = _ref_replicate(tokens_per_mlog, num_physical // num_nodes)
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack_index, rank_in_pack = _ref_balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = inverse(pack_index * phy_per_gpu + rank_in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (
        pphy2mlog.view(num_layers, num_nodes, -1)
        + torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)
    ).flatten(-2)
    return mlog2log.gather(-1, pphy2mlog).tolist()


@pytest.mark.parametrize(
    ("logical", "physical", "ranks", "nodes", "groups"),
    [
        (16, 16, 4, 1, 1),
        (16, 24, 4, 1, 1),
        (16, 24, 4, 2, 4),
        (32, 40, 8, 2, 4),
        (12, 16, 4, 2, 3),
        (8, 12, 1, 1, 1),
    ],
)
def test_placements_equal_the_reference_implementation(
    logical: int, physical: int, ranks: int, nodes: int, groups: int
) -> None:
    """Random float loads (no ties, where tie-breaking could differ): the same physical-to-logical map as
    DeepSeek's torch reference, hierarchical and global."""
    import torch

    rng = random.Random(logical * 1000 + physical + nodes)
    load = [[rng.random() * (50 if rng.random() < 0.2 else 5) for _ in range(logical)] for _ in range(4)]
    ours = rebalance(load, physical, ranks, num_nodes=nodes, num_groups=groups)
    assert ours == _ref_rebalance(torch.tensor(load, dtype=torch.float64), physical, groups, nodes, ranks)
