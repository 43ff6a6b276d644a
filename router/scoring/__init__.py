"""Routing policy: scorers, pickers and the PD decider, each one small unit behind one interface.

A ``Scorer`` maps (request, candidate workers) to a score in [0, 1] per worker; a ``Picker`` turns
scores into one ``Decision`` with a reason; ``PDDecider`` says whether a request needs a prefill hop.
Everything here is pure and synchronous: no I/O, no registry or index access (the router reads those and
passes the results in ``RoutingRequest`` and ``WorkerState``). Formulas: docs/routing.md.
"""

from router.scoring.baseline_pickers import RandomPicker, RoundRobinPicker
from router.scoring.kv_headroom_scorer import KVHeadroomScorer
from router.scoring.load_scorer import LoadScorer
from router.scoring.pd_decider import PDDecider, PDDecision
from router.scoring.picker import Decision, NoEligibleWorkerError, Picker, eligible, exclusion_reason
from router.scoring.picker_factory import ROUTING_MODES, RoutingWeights, make_picker
from router.scoring.prefix_scorer import PrefixScorer
from router.scoring.scorer import RoutingRequest, Scorer, WorkerState, WorkerStats
from router.scoring.session_affinity import SessionAffinity
from router.scoring.weighted_picker import WeightedPicker

__all__ = [
    "ROUTING_MODES",
    "Decision",
    "KVHeadroomScorer",
    "LoadScorer",
    "NoEligibleWorkerError",
    "PDDecider",
    "PDDecision",
    "Picker",
    "PrefixScorer",
    "RandomPicker",
    "RoundRobinPicker",
    "RoutingRequest",
    "RoutingWeights",
    "Scorer",
    "SessionAffinity",
    "WeightedPicker",
    "WorkerState",
    "WorkerStats",
    "eligible",
    "exclusion_reason",
    "make_picker",
]
