"""Weighted picker: combine scorers with weights, guard against hot spots, keep sessions where they were.

    total(w) = sum over scorers s of weight_s * clamp(score_s(w), 0, 1)

The highest total wins; ties within 1e-9 are broken by a seedable rng. Around that, in this order:

1. Session affinity: a request with a ``session_id`` goes to the worker that served the session last,
   if it is still eligible and not over the hot-spot margin (reason ``affinity``).
2. Hot-spot guard: when the winner holds a cached prefix of the prompt but its load
   (queued + running tokens) exceeds the least-loaded eligible worker's by more than
   ``hotspot_margin_tokens``, the cache hit does not win: the load-only choice (the fallback scorer,
   ``LoadScorer`` by default) is taken instead (reason ``hotspot_guard``). Without it, cache affinity
   piles requests sharing a prefix onto one worker.
3. Otherwise the reason is the name of the scorer whose weighted score sets the winner furthest above
   the lowest-scoring candidate (``prefix`` when the cache decided, ``load`` when load did), or ``tie``
   when no scorer tells the candidates apart.

Defaults follow llm-d: prefix 3, load 2.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scoring.load_scorer import LoadScorer
from router.scoring.picker import AFFINITY, HOTSPOT_GUARD, ONLY_CANDIDATE, TIE, Decision, best_of, eligible
from router.scoring.prefix_scorer import PrefixScorer
from router.scoring.scorer import RoutingRequest, Scorer, WorkerState, clamp01
from router.scoring.session_affinity import SessionAffinity

# The router's defaults (its flags, the picker factory and the chooser take them from here).
DEFAULT_HOTSPOT_MARGIN_TOKENS = 16384
DEFAULT_PREFIX_WEIGHT = 3.0
DEFAULT_LOAD_WEIGHT = 2.0
DEFAULT_KV_HEADROOM_WEIGHT = 2.0


def default_prefill_scorers() -> list[tuple[Scorer, float]]:
    return [(PrefixScorer(), DEFAULT_PREFIX_WEIGHT), (LoadScorer(), DEFAULT_LOAD_WEIGHT)]


class WeightedPicker:
    def __init__(
        self,
        scorers: Sequence[tuple[Scorer, float]] | None = None,
        *,
        hotspot_margin_tokens: int | None = DEFAULT_HOTSPOT_MARGIN_TOKENS,
        fallback_scorer: Scorer | None = None,
        affinity: SessionAffinity | None = None,
        seed: int | None = None,
    ):
        """``hotspot_margin_tokens=None`` turns the guard off; ``affinity=None`` turns affinity off."""
        self.scorers = list(scorers) if scorers is not None else default_prefill_scorers()
        if not self.scorers:
            raise ValueError("WeightedPicker needs at least one scorer")
        for scorer, weight in self.scorers:
            if weight < 0:
                raise ValueError(f"weight of scorer {scorer.name!r} must be >= 0, got {weight}")
        self.hotspot_margin_tokens = hotspot_margin_tokens
        self.fallback_scorer = fallback_scorer if fallback_scorer is not None else LoadScorer()
        self.affinity = affinity
        self.rng = random.Random(seed)

    def pick(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        pool = eligible(request, candidates)
        decision = self._decide(request, pool)
        if request.session_id is not None and self.affinity is not None:
            self.affinity.record(request.session_id, decision.worker_id)
        return decision

    def _decide(self, request: RoutingRequest, pool: list[WorkerState]) -> Decision:
        if len(pool) == 1:
            return Decision(pool[0].worker_id, ONLY_CANDIDATE)
        per_scorer: dict[str, dict[str, float]] = {}
        totals = dict.fromkeys((c.worker_id for c in pool), 0.0)
        weighted: list[tuple[str, float, dict[str, float]]] = []
        for scorer, weight in self.scorers:
            scores = scorer.score(request, pool)
            per_scorer[scorer.name] = scores
            weighted.append((scorer.name, weight, scores))
            for wid in totals:
                totals[wid] += weight * clamp01(scores.get(wid, 0.0))

        load = {c.worker_id: c.stats.load_tokens for c in pool}
        min_load = min(load.values())

        def over_margin(wid: str) -> bool:
            return (
                self.hotspot_margin_tokens is not None and load[wid] - min_load > self.hotspot_margin_tokens
            )

        if request.session_id is not None and self.affinity is not None:
            last = self.affinity.get(request.session_id)
            if last in totals and not over_margin(last):
                return Decision(last, AFFINITY, totals, per_scorer)

        winner = best_of(totals, self.rng)
        if request.cached_blocks(winner) > 0 and over_margin(winner):
            load_only = self.fallback_scorer.score(request, pool)
            fallback = best_of({w: load_only.get(w, 0.0) for w in totals}, self.rng)
            per_scorer.setdefault(self.fallback_scorer.name, load_only)
            return Decision(fallback, HOTSPOT_GUARD, totals, per_scorer)

        # The scorer that set the winner furthest above the lowest candidate made the decision.
        reason, lead = TIE, 0.0
        for name, weight, scores in weighted:
            spread = weight * (
                clamp01(scores.get(winner, 0.0)) - min(clamp01(scores.get(w, 0.0)) for w in totals)
            )
            if spread > lead + 1e-12:
                reason, lead = name, spread
        return Decision(winner, reason, totals, per_scorer)
