"""The EPLB controller: aggregates MoE workers' expert load, computes balanced expert placements with
redundant replicas (DeepSeek's EPLB), and publishes them to the workers (``pdmesh.v1.EPLB``).

Run it as ``python -m eplb_svc`` (or ``pdmesh serve eplb``). It imports mesh and protos, never engine or
another service package. Design, formulas and costs: ``docs/eplb.md``.
"""
