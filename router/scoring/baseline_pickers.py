"""Baseline pickers for ``--routing round_robin|random``: no scores, only eligibility.

They exist to measure what scoring buys (benchmarks compare against them) and as a fallback policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scoring.picker import ONLY_CANDIDATE, RANDOM, ROUND_ROBIN, Decision, eligible
from router.scoring.scorer import RoutingRequest, WorkerState


class RoundRobinPicker:
    """Cycles over the eligible workers in worker-id order; a counter, not a position in a list, so that
    workers joining or leaving shift the cycle without restarting it."""

    def __init__(self) -> None:
        self._counter = 0

    def pick(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        pool = sorted(eligible(request, candidates), key=lambda c: c.worker_id)
        if len(pool) == 1:
            return Decision(pool[0].worker_id, ONLY_CANDIDATE)
        choice = pool[self._counter % len(pool)]
        self._counter += 1
        return Decision(choice.worker_id, ROUND_ROBIN)


class RandomPicker:
    """Uniformly random among the eligible workers (seedable)."""

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def pick(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        pool = sorted(eligible(request, candidates), key=lambda c: c.worker_id)
        if len(pool) == 1:
            return Decision(pool[0].worker_id, ONLY_CANDIDATE)
        return Decision(self.rng.choice(pool).worker_id, RANDOM)
