"""The seam between orchestration and routing policy: which workers serve a request.

The orchestrator asks a ``WorkerChooser`` two things: whether the decode worker should prefill the
request itself (skipping the prefill hop), and which of the given candidates of a role takes it. It asks
again, with the failed workers left out of the candidates, when it retries. ``RoundRobinChooser`` is the
baseline; a scored chooser (``router.scoring`` over the registry and KV index) plugs in here without any
change to the orchestration. Methods are async so a chooser may consult Redis.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.worker_pool import WorkerEndpoint

# Decision reasons (the router counts decisions by role and reason).
ONLY_CANDIDATE = "only_candidate"
ROUND_ROBIN = "round_robin"
NO_PREFILL_WORKER = "no_prefill_worker"
DISAGGREGATED = "disaggregated"
PREFILL_FAILED = "prefill_failed"  # every prefill worker failed: the decode worker prefills


@dataclass(frozen=True)
class RouteRequest:
    """A request as routing sees it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    session_id: str | None = None
    cache_salt: str = ""


@dataclass(frozen=True)
class Choice:
    worker: WorkerEndpoint
    reason: str


@dataclass(frozen=True)
class LocalPrefillDecision:
    prefill_on_decode: bool
    reason: str


class WorkerChooser(Protocol):
    async def local_prefill(
        self, request: RouteRequest, prefill_candidates: Sequence[WorkerEndpoint]
    ) -> LocalPrefillDecision:
        """Whether the decode worker should prefill ``request`` itself."""
        ...

    async def choose(self, role: str, request: RouteRequest, candidates: Sequence[WorkerEndpoint]) -> Choice:
        """One of ``candidates`` (never empty) for ``role`` ("prefill" or "decode")."""
        ...


class RoundRobinChooser:
    """Cycles over the candidates of each role in address order; always disaggregates when it can."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    async def local_prefill(
        self, request: RouteRequest, prefill_candidates: Sequence[WorkerEndpoint]
    ) -> LocalPrefillDecision:
        if not prefill_candidates:
            return LocalPrefillDecision(True, NO_PREFILL_WORKER)
        return LocalPrefillDecision(False, DISAGGREGATED)

    async def choose(self, role: str, request: RouteRequest, candidates: Sequence[WorkerEndpoint]) -> Choice:
        if not candidates:
            raise ValueError(f"no {role} candidates to choose from")
        pool = sorted(candidates, key=lambda w: w.address)
        if len(pool) == 1:
            return Choice(pool[0], ONLY_CANDIDATE)
        counter = self._counters.setdefault(role, itertools.count())
        return Choice(pool[next(counter) % len(pool)], ROUND_ROBIN)
