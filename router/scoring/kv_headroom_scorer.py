"""KV headroom scorer (decode): prefer the worker with the most KV blocks left once this request is in.

    need(w)  = ceil((prompt_len_tokens + reserve_output_tokens) / block_size)
    score(w) = max(0, free_blocks(w) - need(w)) / total_blocks(w)

A worker that cannot hold the request without preempting scores 0. ``total_blocks`` is the reported pool
size, or the registered ``num_kv_blocks`` when the worker has not reported one; 0 blocks scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scoring.scorer import RoutingRequest, WorkerState, clamp01


@dataclass(frozen=True)
class KVHeadroomScorer:
    reserve_output_tokens: int = 0
    name: str = "kv_headroom"

    def score(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> dict[str, float]:
        need = -(-(request.prompt_len_tokens + self.reserve_output_tokens) // request.block_size)
        out: dict[str, float] = {}
        for c in candidates:
            total = c.stats.num_kv_blocks_total or c.info.num_kv_blocks
            out[c.worker_id] = (
                clamp01(max(0, c.stats.num_kv_blocks_free - need) / total) if total > 0 else 0.0
            )
        return out
