"""PD decider: send a request through a prefill worker, or let the decode worker prefill it locally.

    uncached_tokens = prompt_len_tokens - min(prompt_len_tokens, block_size * max over eligible prefill
                      workers w of cached prefix blocks(w))
    prefill on the decode worker  iff  uncached_tokens < threshold_tokens  (or no prefill worker is eligible)

A short uncached part costs less to compute where decoding happens than a KV transfer and an extra hop;
the threshold (default 256 tokens) sets where that stops being true. A threshold of 0 always
disaggregates when a prefill worker is eligible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scoring.picker import exclusion_reason
from router.scoring.scorer import RoutingRequest, WorkerState

SHORT_UNCACHED = "short_uncached"
LONG_UNCACHED = "long_uncached"
NO_PREFILL_WORKER = "no_prefill_worker"


@dataclass(frozen=True)
class PDDecision:
    prefill_on_decode: bool
    uncached_tokens: int
    reason: str  # short_uncached | long_uncached | no_prefill_worker


class PDDecider:
    def __init__(self, threshold_tokens: int = 256):
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {threshold_tokens}")
        self.threshold_tokens = threshold_tokens

    def decide(self, request: RoutingRequest, prefill_candidates: Sequence[WorkerState]) -> PDDecision:
        prefill = [c for c in prefill_candidates if exclusion_reason(request, c) is None]
        if not prefill:
            return PDDecision(True, request.prompt_len_tokens, NO_PREFILL_WORKER)
        best_blocks = max(request.cached_blocks(c.worker_id) for c in prefill)
        cached = min(request.prompt_len_tokens, best_blocks * request.block_size)
        uncached = request.prompt_len_tokens - cached
        if uncached < self.threshold_tokens:
            return PDDecision(True, uncached, SHORT_UNCACHED)
        return PDDecision(False, uncached, LONG_UNCACHED)
