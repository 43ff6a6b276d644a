"""Prefix scorer: how much of the prompt a worker already holds, weighted by the tier it holds it in.

    score(w) = sum over tiers t of tier_weight[t] * blocks of w's cached prefix in tier t / prompt blocks

``prompt blocks`` counts the prompt's full blocks (the ones that are hashed); a prompt with none scores 0
everywhere. Blocks a KV offload store holds beyond a worker's own prefix count for it in the store's tiers
(``RoutingRequest.match_of``). Default tier weights: gpu 1.0, cpu 0.8, disk 0.25 (a cpu block costs a host-to-device copy, a
disk block a read as well). Reading the KV index is the router's job; this scorer only reads
``request.prefix_matches``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mesh.kv_events import Tier
from router.scoring.scorer import RoutingRequest, WorkerState, clamp01

DEFAULT_TIER_WEIGHTS: Mapping[Tier, float] = {Tier.GPU: 1.0, Tier.CPU: 0.8, Tier.DISK: 0.25}


@dataclass(frozen=True)
class PrefixScorer:
    tier_weights: Mapping[Tier, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    name: str = "prefix"

    def score(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> dict[str, float]:
        total = request.num_blocks
        out: dict[str, float] = {}
        for c in candidates:
            match = request.match_of(c.worker_id)
            if total == 0 or match is None:
                out[c.worker_id] = 0.0
                continue
            weighted = sum(self.tier_weights.get(t, 0.0) * n for t, n in match.blocks_by_tier.items())
            out[c.worker_id] = clamp01(weighted / total)
        return out
