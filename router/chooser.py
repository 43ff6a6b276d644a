"""The seam between orchestration and routing policy: which workers serve a request.

The orchestrator asks a ``WorkerChooser`` three things, in this order: which decode worker takes the
request, whether that decode worker should prefill it itself (skipping the prefill hop), and which
prefill worker takes it otherwise. It asks again, with the failed workers left out of the candidates,
when it retries, and tells it when the prompt has been computed (``prefill_done``: from then on the
workers' KV events describe it). Methods are async so a chooser may consult Redis. ``ScoredChooser``
(``router.scored_chooser``) implements every ``--routing`` mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.worker_pool import WorkerEndpoint

# Decision reasons (the router counts decisions by role and reason). Scored decisions add the reasons of
# router.scoring (prefix, load, kv_headroom, affinity, hotspot_guard, tie, only_candidate,
# short_uncached, no_prefill_worker, ...).
DISAGGREGATED = "disaggregated"  # round_robin / random: always through a prefill worker when there is one
PREFILL_FAILED = "prefill_failed"  # every prefill worker failed: the decode worker prefills


@dataclass
class RouteRequest:
    """A request as routing sees it. ``routing`` is the chooser's memo for this request (its block hashes
    and the KV index's answer), computed on first use so that retries and the second role reuse it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    session_id: str | None = None
    cache_salt: str = ""
    lora_name: str = ""  # its LoRA adapter: the workers root its block hashes there too
    routing: Any = None


@dataclass(frozen=True)
class Choice:
    worker: WorkerEndpoint
    reason: str


@dataclass(frozen=True)
class LocalPrefillDecision:
    prefill_on_decode: bool
    reason: str


class WorkerChooser(Protocol):
    async def choose(self, role: str, request: RouteRequest, candidates: Sequence[WorkerEndpoint]) -> Choice:
        """One of ``candidates`` (never empty) for ``role`` ("prefill" or "decode")."""
        ...

    async def local_prefill(
        self,
        request: RouteRequest,
        prefill_candidates: Sequence[WorkerEndpoint],
        decode_worker: WorkerEndpoint | None = None,
    ) -> LocalPrefillDecision:
        """Whether ``decode_worker`` (the one chosen) should prefill ``request`` itself."""
        ...

    def prefill_done(self, request: RouteRequest) -> None:
        """The request's prompt has been computed (or its prefill failed): its KV events are on their way."""
        ...
