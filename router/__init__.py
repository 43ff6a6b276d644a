"""The router service: public API (gRPC and OpenAI-compatible HTTP), worker scoring, PD orchestration.

``router.scoring`` holds the routing policy (scorers, pickers, the PD decider) as pure functions of a
request and the candidates' state; the servicer feeds it from ``mesh.registry`` and ``mesh.kv_index``.
The router must not import another service package; it talks to workers only through ``protos/``.
"""
