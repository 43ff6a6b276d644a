"""Placement groups: the workers that share one expert placement, their load window and their versions.

A group is keyed by model fingerprint, pool (the workers' role, so prefill and decode fleets balance
separately) and shape (layers, logical and physical experts, expert-parallel ranks). It holds the current
``Placement`` (version 0: ``mesh.expert_placement.initial_placement``), a sliding window of load reports
converted to logical experts, and the watchers to tell of a new version.

Reports measured under an older version than the current one are dropped; a report under a newer one (a
controller that restarted without its state) makes the group adopt the worker's placement and version.
A published placement empties the window: what follows is measured under it.

This module computes and holds; it does no I/O (the servicer persists and serves).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

from eplb_svc.policy import minimise_moves, moved_slots, placement_balancedness, rebalance
from mesh.expert_placement import check_placement, initial_placement


@dataclass(frozen=True)
class GroupKey:
    model_fingerprint: str
    pool: str
    num_layers: int
    num_logical: int
    num_physical: int
    num_ranks: int

    @property
    def name(self) -> str:
        """Readable and unique: the metrics label and the Redis key's tail."""
        shape = f"{self.num_layers}x{self.num_logical}e{self.num_physical}p{self.num_ranks}r"
        return f"{self.model_fingerprint}/{self.pool or '-'}/{shape}"

    @property
    def digest(self) -> str:
        """A short hash of the name, for Redis keys (fingerprints may be long)."""
        return hashlib.sha1(self.name.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Placement:
    version: int
    physical_to_logical: list[list[int]]
    balancedness_before: float = 0.0
    balancedness_after: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What one rebalance of a group concluded. ``outcome``: published, too_few_tokens, no_gain, unchanged."""

    outcome: str
    tokens: float = 0.0
    balancedness_before: float = 1.0
    balancedness_after: float = 1.0
    moved_slots: int = 0
    placement: Placement | None = None


@dataclass
class _Report:
    at: float
    load: list[list[float]]  # [layers][logical]
    tokens: float  # sum over experts, averaged over layers


@dataclass
class PlacementGroup:
    key: GroupKey
    placement: Placement
    window: deque[_Report] = field(default_factory=deque)
    watchers: set[asyncio.Queue[Placement]] = field(default_factory=set)

    @classmethod
    def new(cls, key: GroupKey, placement: Placement | None = None) -> PlacementGroup:
        if placement is None:
            placement = Placement(0, initial_placement(key.num_layers, key.num_logical, key.num_physical))
        check_placement(placement.physical_to_logical, key.num_layers, key.num_logical, key.num_physical)
        return cls(key, placement)

    # ---- load ------------------------------------------------------------------------------------
    def add_report(
        self,
        version: int,
        counts: list[int],
        physical_to_logical: list[list[int]] | None,
        now: float | None = None,
    ) -> tuple[bool, Placement | None]:
        """Add one rank's counts (row-major ``[layers, physical]``), measured under ``version`` (whose map
        the worker sent, or None). Returns (accepted, the placement adopted from the report or None)."""
        now = time.monotonic() if now is None else now
        current = self.placement
        adopted = None
        if version < current.version:
            return False, None
        if version > current.version:
            if physical_to_logical is None:
                return False, None  # a version this controller never knew, without its map: unusable
            adopted = Placement(version, physical_to_logical)
            self.set_placement(adopted)
        p2l = physical_to_logical if physical_to_logical is not None else self.placement.physical_to_logical
        k = self.key
        load = [[0.0] * k.num_logical for _ in range(k.num_layers)]
        for layer in range(k.num_layers):
            row, lmap, base = load[layer], p2l[layer], layer * k.num_physical
            for slot in range(k.num_physical):
                row[lmap[slot]] += counts[base + slot]
        tokens = sum(counts) / k.num_layers
        self.window.append(_Report(now, load, tokens))
        return True, adopted

    def prune(self, window_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self.window and self.window[0].at < now - window_s:
            self.window.popleft()

    def window_load(self) -> tuple[list[list[float]], float]:
        """The window's summed load ``[layers][logical]`` and its tokens (per layer)."""
        k = self.key
        total = [[0.0] * k.num_logical for _ in range(k.num_layers)]
        tokens = 0.0
        for report in self.window:
            tokens += report.tokens
            for row, add in zip(total, report.load, strict=True):
                for e, x in enumerate(add):
                    row[e] += x
        return total, tokens

    # ---- placements ------------------------------------------------------------------------------
    def set_placement(self, placement: Placement) -> None:
        """Make ``placement`` current: the window empties (it was measured under the old one) and every
        watcher hears of it."""
        self.placement = placement
        self.window.clear()
        for q in self.watchers:
            q.put_nowait(placement)

    def propose(
        self,
        load: list[list[float]],
        tokens: float,
        min_tokens: float,
        min_improvement: float,
        num_nodes: int = 1,
        num_groups: int = 1,
    ) -> Decision:
        """Weigh a window's load (``window_load``, taken on the event loop; this may run on a thread): a
        new placement following the current one, or why not. Publishes nothing."""
        base = self.placement
        current = base.physical_to_logical
        k = self.key
        before = placement_balancedness(load, current, k.num_ranks)
        if tokens < min_tokens or tokens <= 0:
            return Decision("too_few_tokens", tokens, before, before)
        new = rebalance(load, k.num_physical, k.num_ranks, num_nodes, num_groups)
        new = minimise_moves(current, new, k.num_ranks)
        after = placement_balancedness(load, new, k.num_ranks)
        if new == current:
            return Decision("unchanged", tokens, before, after)
        if after - before <= min_improvement:
            return Decision("no_gain", tokens, before, after)
        placement = Placement(base.version + 1, new, before, after)
        return Decision("published", tokens, before, after, moved_slots(current, new), placement)
