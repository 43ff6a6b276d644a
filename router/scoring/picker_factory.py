"""Builds the pickers a router uses from its routing settings: one place that knows the defaults.

``routing`` is ``prefix`` (scored), ``round_robin`` or ``random``. Prefill workers are scored by cached
prefix (3) and load (2) with session affinity and the hot-spot guard; decode workers by KV headroom (2)
and load (2). The weights and the guard's margin travel as one ``RoutingWeights``, from the router's
settings (``RouterConfig.routing_weights``) through ``ScoredChooser`` to here.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.scoring.baseline_pickers import RandomPicker, RoundRobinPicker
from router.scoring.kv_headroom_scorer import KVHeadroomScorer
from router.scoring.load_scorer import LoadScorer
from router.scoring.picker import Picker
from router.scoring.prefix_scorer import PrefixScorer
from router.scoring.session_affinity import SessionAffinity
from router.scoring.weighted_picker import (
    DEFAULT_HOTSPOT_MARGIN_TOKENS,
    DEFAULT_KV_HEADROOM_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
    WeightedPicker,
)

ROUTING_MODES = ("prefix", "round_robin", "random")


@dataclass(frozen=True)
class RoutingWeights:
    """The scored pickers' weights (prefill: prefix + load; decode: KV headroom + load) and the prefill
    hot-spot guard's margin in tokens (None: no guard)."""

    prefix: float = DEFAULT_PREFIX_WEIGHT
    load: float = DEFAULT_LOAD_WEIGHT
    kv_headroom: float = DEFAULT_KV_HEADROOM_WEIGHT
    hotspot_margin_tokens: int | None = DEFAULT_HOTSPOT_MARGIN_TOKENS

    def __post_init__(self) -> None:
        if min(self.prefix, self.load, self.kv_headroom) < 0:
            raise ValueError(f"routing weights must be >= 0, got {self}")
        if self.hotspot_margin_tokens is not None and self.hotspot_margin_tokens < 0:
            raise ValueError(f"hotspot_margin_tokens must be >= 0 or None (no guard), got {self}")


def make_picker(
    routing: str,
    role: str,
    *,
    seed: int | None = None,
    weights: RoutingWeights = RoutingWeights(),
    affinity_capacity: int = 100_000,
) -> Picker:
    """The picker for workers of ``role`` ("prefill" or "decode") under ``routing``."""
    if routing == "round_robin":
        return RoundRobinPicker()
    if routing == "random":
        return RandomPicker(seed)
    if routing != "prefix":
        raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTING_MODES)}")
    if role == "prefill":
        return WeightedPicker(
            [(PrefixScorer(), weights.prefix), (LoadScorer(), weights.load)],
            hotspot_margin_tokens=weights.hotspot_margin_tokens,
            affinity=SessionAffinity(affinity_capacity),
            seed=seed,
        )
    if role == "decode":
        return WeightedPicker(
            [(KVHeadroomScorer(), weights.kv_headroom), (LoadScorer(), weights.load)],
            hotspot_margin_tokens=None,
            seed=seed,
        )
    raise ValueError(f"unknown worker role {role!r} for routing; expected 'prefill' or 'decode'")
