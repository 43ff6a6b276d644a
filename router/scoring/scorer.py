"""The scoring interface: what a scorer sees (a request and candidate workers' state) and returns.

A scorer is one small unit: a ``name`` and ``score(request, candidates) -> {worker_id: score in [0, 1]}``,
higher is better, its formula in its docstring and in docs/routing.md. Scorers are pure: no I/O, no
state between calls, no knowledge of other scorers or of how the picker combines them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mesh.kv_index import PrefixMatch
from mesh.registry import WorkerInfo


@dataclass(frozen=True)
class RoutingRequest:
    """One request as routing sees it.

    ``block_hashes`` are the prompt's full blocks (``mesh.block_hash``); ``prefix_matches`` is the KV
    index's answer for them: worker id -> longest cached prefix, by tier. ``offload_match`` is the longest
    prefix a KV offload store holds (``kvstore_svc``): any worker can load it, so ``match_of`` credits it to
    every worker beyond the worker's own prefix, in the store's tiers.
    """

    prompt_len_tokens: int
    block_hashes: Sequence[int]
    block_size: int
    model_fingerprint: str
    session_id: str | None = None
    prefix_matches: Mapping[str, PrefixMatch] = field(default_factory=dict)
    offload_match: PrefixMatch | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.prompt_len_tokens < 0:
            raise ValueError(f"prompt_len_tokens must be >= 0, got {self.prompt_len_tokens}")

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def cached_blocks(self, worker_id: str) -> int:
        match = self.match_of(worker_id)
        return match.blocks if match is not None else 0

    def match_of(self, worker_id: str) -> PrefixMatch | None:
        """The worker's cached prefix; where a KV offload store holds a longer one, the blocks beyond the
        worker's own count too, split over the store's tiers in its proportions."""
        own = self.prefix_matches.get(worker_id)
        store = self.offload_match
        if store is None or store.blocks <= (own.blocks if own is not None else 0):
            return own
        have = own.blocks if own is not None else 0
        extra = store.blocks - have
        tiers = dict(own.blocks_by_tier) if own is not None else {}
        left = extra
        for tier, n in sorted(store.blocks_by_tier.items(), key=lambda kv: -kv[1]):
            share = min(left, -(-extra * n // store.blocks))
            if share:
                tiers[tier] = tiers.get(tier, 0) + share
                left -= share
        return PrefixMatch(store.blocks, tiers)


@dataclass(frozen=True)
class WorkerStats:
    """A worker's load, as it last reported it (the fields of ``pdmesh.v1.WorkerStats``)."""

    queued_tokens: int = 0  # prompt tokens of waiting requests still to be computed
    running_tokens: int = 0  # tokens held by running requests (prompt + generated so far)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # share of the KV pool in use, 0..1
    num_kv_blocks_free: int = 0
    num_kv_blocks_total: int = 0

    @property
    def load_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


@dataclass(frozen=True)
class WorkerState:
    info: WorkerInfo
    stats: WorkerStats = field(default_factory=WorkerStats)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class Scorer(Protocol):
    name: str

    def score(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """A score in [0, 1] per candidate worker id; higher is better."""
        ...


def clamp01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x
