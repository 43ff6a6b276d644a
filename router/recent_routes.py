"""Prefixes this router has just sent to a worker, before the worker's KV events put them in the index.

A worker announces a prompt's blocks once it has computed them, so for a prefill's duration (and the
events' trip) the index does not know them yet. Two requests sharing a new prefix that arrive together
would then both see it nowhere and could land on two workers, each computing it and each caching it:
half the hits, twice the cache. The router remembers where it sent each chain and counts those blocks as
cached on that worker, at the gpu tier, where they make a longer match than the index's (SGLang's gateway
updates its tree when it routes, for the same reason).

Only for that gap: a route is ``settle``d when its prefill ends, and then forgotten ``settle_lag_s``
later, once the worker's events have had time to reach the index; the index then speaks alone, evictions
included (a worker whose cache churns fast must not look as if it kept what it was sent). A route never
settled (a lost call) is forgotten after ``ttl_s``.

Layout: ``dict[hash, dict[worker id, expiry]]`` and a queue of routes for cleanup. A lookup walks the
chain once per worker holding its first block (usually one or two), stopping at that worker's first
missing block, so it costs O(blocks x matching workers). Memory: one entry per (block, worker) of the prefills in flight.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mesh.kv_events import Tier
from mesh.kv_index import PrefixMatch


@dataclass(order=True)
class Route:
    """One chain sent to one worker; ``expiry`` is when its entries are dropped."""

    expiry: float
    worker_id: str = field(compare=False)
    block_hashes: Sequence[int] = field(compare=False)
    settled: bool = field(default=False, compare=False)


class RecentRoutes:
    def __init__(
        self, ttl_s: float = 30.0, settle_lag_s: float = 0.5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0 or settle_lag_s < 0:
            raise ValueError("ttl_s must be positive and settle_lag_s >= 0")
        self.ttl_s = ttl_s
        self.settle_lag_s = settle_lag_s
        self.clock = clock
        self._holders: dict[int, dict[str, float]] = {}
        self._queue: list[Route] = []  # heap by expiry

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> Route | None:
        if not block_hashes:
            return None
        route = Route(self.clock() + self.ttl_s, worker_id, block_hashes)
        self._set(route)
        return route

    def settle(self, route: Route) -> None:
        """The route's prefill ended: keep it only until the worker's events can have arrived."""
        if route.settled:
            return
        route.settled = True
        soon = min(route.expiry, self.clock() + self.settle_lag_s)
        for h in route.block_hashes:
            holders = self._holders.get(h)
            if holders is not None and holders.get(route.worker_id) == route.expiry:  # not renewed since
                holders[route.worker_id] = soon
        # The heap entry at the old expiry stays (entries are never edited in place); this one comes first.
        heapq.heappush(self._queue, Route(soon, route.worker_id, route.block_hashes, settled=True))

    def _set(self, route: Route) -> None:
        for h in route.block_hashes:
            holders = self._holders.setdefault(h, {})
            holders[route.worker_id] = max(holders.get(route.worker_id, 0.0), route.expiry)
        heapq.heappush(self._queue, route)

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the chain each worker was recently sent (only workers holding block 0)."""
        now = self.clock()
        self._expire(now)
        if not block_hashes:
            return {}
        first = self._holders.get(block_hashes[0])
        if not first:
            return {}
        counts: dict[str, int] = {}
        for w, expiry in first.items():  # usually one or two workers: count each one's leading run
            if expiry <= now:
                continue
            n = 1
            for h in block_hashes[1:]:
                if self._holders.get(h, {}).get(w, 0.0) <= now:
                    break
                n += 1
            counts[w] = n
        return counts

    def forget_worker(self, worker_id: str) -> None:
        for h, holders in list(self._holders.items()):
            if holders.pop(worker_id, None) is not None and not holders:
                del self._holders[h]  # _expire would never drop it: it finds no expiry of this worker there

    def __len__(self) -> int:
        return sum(len(v) for v in self._holders.values())

    def _expire(self, now: float) -> None:
        while self._queue and self._queue[0].expiry <= now:
            route = heapq.heappop(self._queue)
            for h in route.block_hashes:
                holders = self._holders.get(h)
                if holders is not None and holders.get(route.worker_id, now + 1) <= now:
                    del holders[route.worker_id]
                    if not holders:
                        del self._holders[h]


def merge(index: Mapping[str, PrefixMatch], recent: Mapping[str, int]) -> dict[str, PrefixMatch]:
    """The index's matches, lengthened where this router recently sent a longer prefix (extra blocks at
    the gpu tier, where a worker's prefix cache keeps them)."""
    out = dict(index)
    for worker_id, blocks in recent.items():
        known = out.get(worker_id)
        if known is None:
            out[worker_id] = PrefixMatch.from_counts(blocks, 0, 0)
        elif blocks > known.blocks:
            tiers = dict(known.blocks_by_tier)
            tiers[Tier.GPU] = tiers.get(Tier.GPU, 0) + blocks - known.blocks
            out[worker_id] = PrefixMatch(blocks, tiers)
    return out
