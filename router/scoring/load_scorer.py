"""Load scorer: prefer the worker with less work queued and running, and more free KV cache.

    tokens(w) = queued_tokens(w) + running_tokens(w)
    T_ref     = max(token_floor, max over candidates of tokens)
    score(w)  = 1 - (token_weight * tokens(w) / T_ref + kv_weight * kv_usage(w)) / (token_weight + kv_weight)

Normalising by the busiest candidate compares workers with each other under load; the floor (default
8192 tokens, one long prompt) keeps a few hundred tokens of difference between idle workers from looking
like a large one. kv_usage is clamped to [0, 1]. Defaults weigh tokens and KV usage equally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scoring.scorer import RoutingRequest, WorkerState, clamp01


@dataclass(frozen=True)
class LoadScorer:
    token_weight: float = 0.5
    kv_weight: float = 0.5
    token_floor: int = 8192
    name: str = "load"

    def __post_init__(self) -> None:
        if self.token_weight < 0 or self.kv_weight < 0 or self.token_weight + self.kv_weight <= 0:
            raise ValueError("LoadScorer weights must be >= 0 with a positive sum")
        if self.token_floor <= 0:
            raise ValueError(f"token_floor must be positive, got {self.token_floor}")

    def score(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> dict[str, float]:
        if not candidates:
            return {}
        t_ref = max(self.token_floor, max(c.stats.load_tokens for c in candidates))
        wsum = self.token_weight + self.kv_weight
        return {
            c.worker_id: clamp01(
                1.0
                - (
                    self.token_weight * c.stats.load_tokens / t_ref
                    + self.kv_weight * clamp01(c.stats.kv_usage)
                )
                / wsum
            )
            for c in candidates
        }
