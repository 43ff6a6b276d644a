"""PD decider: send a request through a prefill worker, or let the decode worker prefill it locally.

With the decode worker ``d`` already picked (the router's way):

    uncached_tokens = prompt_len_tokens - min(prompt_len_tokens, block_size * cached prefix blocks(d))

Without one (``decode_worker_id=None``), the estimate is the prefill side's:

    uncached_tokens = prompt_len_tokens - min(prompt_len_tokens, block_size * max over eligible prefill
                      workers w of cached prefix blocks(w))

and in both cases

    prefill on the decode worker  iff  uncached_tokens < threshold_tokens  (or no prefill worker is eligible)

A short uncached part costs less to compute where decoding happens than a KV transfer and an extra hop;
the threshold (default 256 tokens) sets where that stops being true. What the decode worker computes is
what *its* cache lacks, so the router passes the decode worker it picked: a prompt that prefill workers
hold but the decode worker does not is sent through a prefill worker. A threshold of 0 always
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

    def decide(
        self,
        request: RoutingRequest,
        prefill_candidates: Sequence[WorkerState],
        decode_worker_id: str | None = None,
    ) -> PDDecision:
        prefill = [c for c in prefill_candidates if exclusion_reason(request, c) is None]
        if decode_worker_id is not None:
            cached_blocks = request.cached_blocks(decode_worker_id)
        else:
            cached_blocks = max((request.cached_blocks(c.worker_id) for c in prefill), default=0)
        uncached = request.prompt_len_tokens - min(
            request.prompt_len_tokens, cached_blocks * request.block_size
        )
        if not prefill:
            return PDDecision(True, uncached, NO_PREFILL_WORKER)
        if uncached < self.threshold_tokens:
            return PDDecision(True, uncached, SHORT_UNCACHED)
        return PDDecision(False, uncached, LONG_UNCACHED)
