"""The picker interface: one decision per request, with the reason it was made.

Also owns who may be picked at all (``eligible``): a draining worker, or one whose block size or model
fingerprint differs from the request's, is never a candidate, whatever the scores say.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.scoring.scorer import RoutingRequest, WorkerState

# Decision reasons, for a router counting decisions by reason. A weighted decision's reason is also the
# name of the scorer that set the winner apart the most ("prefix", "load", "kv_headroom", ...).
ONLY_CANDIDATE = "only_candidate"
AFFINITY = "affinity"
HOTSPOT_GUARD = "hotspot_guard"
TIE = "tie"
ROUND_ROBIN = "round_robin"
RANDOM = "random"


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: str
    scores: dict[str, float] = field(default_factory=dict)  # combined score per candidate, where scored
    scorer_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer name -> per candidate


class NoEligibleWorkerError(LookupError):
    """No candidate may take the request; the message says why each was excluded."""


class Picker(Protocol):
    def pick(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision: ...


def exclusion_reason(request: RoutingRequest, candidate: WorkerState) -> str | None:
    """Why ``candidate`` may not take ``request``, or None when it may."""
    info = candidate.info
    if info.draining:
        return "draining"
    if info.block_size != request.block_size:
        return f"block_size {info.block_size} != {request.block_size}"
    if info.model_fingerprint != request.model_fingerprint:
        return f"model {info.model_fingerprint!r} != {request.model_fingerprint!r}"
    return None


def eligible(request: RoutingRequest, candidates: Sequence[WorkerState]) -> list[WorkerState]:
    """The candidates that may take the request; raises ``NoEligibleWorkerError`` when there are none."""
    out: list[WorkerState] = []
    excluded: list[str] = []
    for c in candidates:
        why = exclusion_reason(request, c)
        if why is None:
            out.append(c)
        else:
            excluded.append(f"{c.worker_id}: {why}")
    if not out:
        detail = "; ".join(excluded) if excluded else "no workers registered"
        raise NoEligibleWorkerError(
            f"no worker can take this request ({detail}); start a worker for model "
            f"{request.model_fingerprint!r} with block size {request.block_size}, or undrain one"
        )
    return out


def best_of(scores: dict[str, float], rng: random.Random, tolerance: float = 1e-9) -> str:
    """The id with the highest score; ties (within ``tolerance``) broken by ``rng``."""
    top = max(scores.values())
    tied = sorted(w for w, s in scores.items() if s >= top - tolerance)
    return tied[0] if len(tied) == 1 else rng.choice(tied)
