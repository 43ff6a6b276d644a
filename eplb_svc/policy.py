"""The rebalancing policy: DeepSeek's EPLB algorithm (as vLLM runs it) and the move-minimising slot order.

``rebalance`` turns a load ``[layers][logical]`` into a placement ``physical_to_logical
[layers][num_physical]`` (the shape ``mesh.expert_placement`` defines: slot ``s`` lives on rank
``s // (num_physical // num_ranks)``):

- hierarchical, when ``num_groups`` expert groups divide over ``num_nodes`` nodes (and the ranks do
  too): pack the groups onto nodes by greedy balanced packing, replicate inside each node, pack each
  node's physical experts onto its ranks;
- global otherwise (and with one node): the same with one group and one node.

Greedy balanced packing sorts items heaviest first and puts each into the lightest pack that still has
room (every pack takes the same number of items). Replication adds the redundant slots one at a time,
each to the expert with the highest load per replica. Ties go to the lowest index, so equal inputs give
equal outputs.

``keep_slots`` then reorders each rank's slots so that a logical expert that stays on a rank keeps the
slot it had there: which rank holds what is unchanged (so is the balance), and the workers copy weights
only into slots whose expert changed.

Plain Python (lists and floats): no torch, no service code. Costs, per layer with ``L`` logical and ``P``
physical experts over ``R`` ranks: replication ``O((P - L) * L)``, packing ``O(P log P + P * R)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh.expert_placement import PlacementError, rank_of_slot


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[tuple[int, int]]:
    """Each item's ``(pack, position in pack)``: heaviest first into the lightest pack with room; every
    pack holds ``len(weights) // num_packs`` items (ties: the lower index, the lower pack)."""
    n = len(weights)
    if num_packs <= 0 or n % num_packs:
        raise PlacementError(f"{n} items do not divide over {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    pack_weight = [0.0] * num_packs
    pack_items = [0] * num_packs
    out: list[tuple[int, int]] = [(-1, -1)] * n
    for item in order:
        pack = min(
            (p for p in range(num_packs) if pack_items[p] < per_pack), key=lambda p: (pack_weight[p], p)
        )
        out[item] = (pack, pack_items[pack])
        pack_weight[pack] += weights[item]
        pack_items[pack] += 1
    return out


def replicate_experts(weights: Sequence[float], num_physical: int) -> tuple[list[int], list[int]]:
    """Physical experts for ``len(weights)`` logical ones: slot ``i < len(weights)`` holds expert ``i``; each
    redundant slot replicates the expert with the highest load per replica so far. Returns the slots'
    logical experts and each logical expert's replica count."""
    num_logical = len(weights)
    if num_physical < num_logical:
        raise PlacementError(f"{num_physical} physical experts cannot hold {num_logical} logical experts")
    phys = list(range(num_logical))
    count = [1] * num_logical
    for _ in range(num_logical, num_physical):
        best = max(range(num_logical), key=lambda e: (weights[e] / count[e], -e))
        phys.append(best)
        count[best] += 1
    return phys, count


def _rebalance_layer(
    weights: Sequence[float], num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> list[int]:
    """One layer, hierarchically (``num_groups`` groups over ``num_nodes`` nodes, ``num_ranks`` ranks)."""
    num_logical = len(weights)
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_physical // num_ranks

    # 1. Expert groups onto nodes.
    group_load = [sum(weights[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    group_place = balanced_packing(group_load, num_nodes)
    # Node-major order of the logical experts: node n holds node_experts[n].
    node_experts: list[list[int]] = [[] for _ in range(num_nodes)]
    for g in sorted(range(num_groups), key=lambda g: group_place[g]):
        node_experts[group_place[g][0]].extend(range(g * group_size, (g + 1) * group_size))
    assert (
        all(len(e) == logical_per_node for e in node_experts)
        and groups_per_node * group_size == logical_per_node
    )

    out = [-1] * num_physical
    for node, experts in enumerate(node_experts):
        # 2. Replicas inside the node.
        local_load = [float(weights[e]) for e in experts]
        phys, count = replicate_experts(local_load, physical_per_node)
        # 3. The node's physical experts onto its ranks (each replica carries an equal share of its expert).
        share = [local_load[m] / count[m] for m in phys]
        place = balanced_packing(share, ranks_per_node)
        for p, (rank, pos) in enumerate(place):
            slot = (node * ranks_per_node + rank) * slots_per_rank + pos
            out[slot] = experts[phys[p]]
    return out


def rebalance(
    load: Sequence[Sequence[float]],
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> list[list[int]]:
    """DeepSeek's EPLB: ``physical_to_logical [layers][num_physical]`` for ``load [layers][logical]``.

    Hierarchical when ``num_groups`` divides over ``num_nodes`` (and so do the ranks and the logical
    experts into groups); otherwise global (one group, one node). ``PlacementError`` for shapes that cannot
    be placed (physical experts fewer than logical ones, or not dividing over the ranks)."""
    if num_ranks <= 0 or num_physical % num_ranks:
        raise PlacementError(f"{num_physical} physical experts do not divide over {num_ranks} ranks")
    if not load:
        return []
    num_logical = len(load[0])
    if num_physical < num_logical:
        raise PlacementError(f"{num_physical} physical experts cannot hold {num_logical} logical experts")
    hierarchical = (
        num_nodes > 1
        and num_groups > 0
        and num_groups % num_nodes == 0
        and num_logical % num_groups == 0
        and num_ranks % num_nodes == 0
        and num_physical % num_nodes == 0
    )
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    out = []
    for layer, row in enumerate(load):
        if len(row) != num_logical:
            raise PlacementError(f"load layer {layer} has {len(row)} experts, layer 0 has {num_logical}")
        out.append(_rebalance_layer([float(x) for x in row], num_physical, groups, nodes, num_ranks))
    return out


def keep_slots(old: Sequence[int], new: Sequence[int], num_ranks: int) -> list[int]:
    """``new`` (one layer) with each rank's slots reordered so that a logical expert the rank held before
    keeps its old slot there (as many of its replicas as stay); the others fill the rank's free slots in
    order. The multiset of experts on each rank, and so the balance, is ``new``'s."""
    n = len(new)
    if len(old) != n:
        raise PlacementError(f"old placement has {len(old)} slots, the new one {n}")
    per_rank = n // num_ranks
    out = [-1] * n
    for rank in range(num_ranks):
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        pending = list(new[lo:hi])
        leftover: list[int] = []
        old_slots: dict[int, list[int]] = {}
        for s in range(lo, hi):
            old_slots.setdefault(old[s], []).append(s)
        for expert in pending:
            slots = old_slots.get(expert)
            if slots:
                out[slots.pop(0)] = expert
            else:
                leftover.append(expert)
        free = [s for s in range(lo, hi) if out[s] == -1]
        for s, expert in zip(free, leftover, strict=True):
            out[s] = expert
    return out


def minimise_moves(
    old: Sequence[Sequence[int]], new: Sequence[Sequence[int]], num_ranks: int
) -> list[list[int]]:
    """``keep_slots`` for every layer."""
    if len(old) != len(new):
        raise PlacementError(f"old placement has {len(old)} layers, the new one {len(new)}")
    return [keep_slots(o, n, num_ranks) for o, n in zip(old, new, strict=True)]


def moved_slots(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> int:
    """Slots whose logical expert changes (each a weight copy on a worker)."""
    return sum(a != b for o, n in zip(old, new, strict=True) for a, b in zip(o, n, strict=True))


def rank_loads(load: Sequence[float], physical_to_logical: Sequence[int], num_ranks: int) -> list[float]:
    """One layer's load per rank under a placement: each logical expert's load splits evenly over its
    replicas (the routing spreads tokens over replicas by token index)."""
    replicas: dict[int, int] = {}
    for e in physical_to_logical:
        replicas[e] = replicas.get(e, 0) + 1
    n = len(physical_to_logical)
    out = [0.0] * num_ranks
    for slot, e in enumerate(physical_to_logical):
        out[rank_of_slot(slot, n, num_ranks)] += float(load[e]) / replicas[e]
    return out


def placement_balancedness(
    load: Sequence[Sequence[float]], physical_to_logical: Sequence[Sequence[int]], num_ranks: int
) -> float:
    """Balancedness over layers, as vLLM logs it: the sum over layers of the mean per-rank load over the sum
    of the max (for one layer, ``mesh.expert_placement.balancedness`` of its rank loads). 1.0: even."""
    mean_sum = max_sum = 0.0
    for row, p2l in zip(load, physical_to_logical, strict=True):
        loads = rank_loads(row, p2l, num_ranks)
        mean_sum += sum(loads) / num_ranks
        max_sum += max(loads)
    return 1.0 if max_sum <= 0 else mean_sum / max_sum
