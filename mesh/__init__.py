"""Shared runtime for every pdmesh service: config, block hashing, registry, KV index, telemetry, gRPC helpers, CLI.

It must not import any service package (router, prefill_svc, decode_svc, eplb_svc, kvstore_svc).
"""
