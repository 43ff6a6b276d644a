"""Expert placements: which logical expert each physical expert slot of a MoE layer holds.

The one definition the engine (which runs a placement), the workers (which report load under one) and
the EPLB controller (which computes new ones) share. A placement is ``physical_to_logical``:
``[num_layers][num_physical]`` ints; physical slot ``s`` lives on expert-parallel rank
``s // (num_physical // num_ranks)``. Version 0 is ``initial_placement``; every logical expert has at
least one physical replica in every placement. Plain lists: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoELayout:
    """What a placement must fit: the MoE layers, their logical and physical experts, the expert-parallel
    ranks over which the physical slots are split evenly, and which rank this is."""

    num_layers: int
    num_logical: int
    num_physical: int
    num_ranks: int = 1
    rank: int = 0


class PlacementError(ValueError):
    """A placement that cannot run (wrong shape, an expert id out of range, a logical expert left out)."""


def initial_placement(num_layers: int, num_logical: int, num_physical: int) -> list[list[int]]:
    """Version 0: slot ``s`` holds logical expert ``s % num_logical`` (the first ``num_logical`` slots hold
    every expert once, the redundant slots after them replicate experts 0, 1, ...), as vLLM starts."""
    if num_physical < num_logical:
        raise PlacementError(f"{num_physical} physical experts cannot hold {num_logical} logical experts")
    return [[s % num_logical for s in range(num_physical)] for _ in range(num_layers)]


def check_placement(
    physical_to_logical: list[list[int]], num_layers: int, num_logical: int, num_physical: int
) -> None:
    """Raise ``PlacementError`` naming what is wrong unless the placement fits the model and every layer
    holds every logical expert at least once."""
    if len(physical_to_logical) != num_layers:
        raise PlacementError(f"placement has {len(physical_to_logical)} layers, the model has {num_layers}")
    for layer, row in enumerate(physical_to_logical):
        if len(row) != num_physical:
            raise PlacementError(
                f"layer {layer} of the placement has {len(row)} physical experts, the model has {num_physical}"
            )
        bad = [e for e in row if not 0 <= e < num_logical]
        if bad:
            raise PlacementError(f"layer {layer}: logical expert ids {bad[:4]} outside [0, {num_logical})")
        missing = sorted(set(range(num_logical)) - set(row))
        if missing:
            raise PlacementError(f"layer {layer} leaves logical experts {missing[:8]} without a replica")


def rank_of_slot(slot: int, num_physical: int, num_ranks: int) -> int:
    """The expert-parallel rank that holds physical slot ``slot``."""
    return slot // (num_physical // num_ranks)


def balancedness(rank_loads: list[float]) -> float:
    """Mean over max of per-rank loads (1.0: perfectly even; vLLM's log line). 1.0 for no load."""
    top = max(rank_loads, default=0.0)
    return 1.0 if top <= 0 else sum(rank_loads) / len(rank_loads) / top
