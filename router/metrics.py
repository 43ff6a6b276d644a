"""The router's Prometheus metrics, made once on its registry (names ``pdmesh_router_<what>_<unit>``).

Front ends count requests by endpoint and status; the orchestrator times tokens, counts tokens, routing
decisions and worker errors; the chooser times decisions and says when it routed without the KV index;
discovery and the KV event feed say whether Redis and the workers' event streams answer. Nothing here
decides anything.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mesh.telemetry import ServiceMetrics

# Seconds; TTFT on a CPU mesh is tens of ms to seconds, on GPUs a few ms.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Seconds; a decision is ~0.1-2 ms (docs/routing.md), more when Redis is slow.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        m = ServiceMetrics("router", registry)
        self.registry = m.registry
        self.requests = m.counter(
            "requests", "total", "Requests by endpoint and how they ended.", ["endpoint", "status"]
        )
        self.in_flight = m.gauge("in_flight", "requests", "Requests being served now.")
        self.ttft = m.histogram(
            "ttft", "seconds", "Time from a request's arrival to its first token.", buckets=LATENCY_BUCKETS
        )
        self.tpot = m.histogram(
            "tpot",
            "seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=TPOT_BUCKETS,
        )
        self.e2e_latency = m.histogram(
            "request_latency",
            "seconds",
            "Time from a request's arrival to its last token.",
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = m.counter("prompt", "tokens", "Prompt tokens of requests sent to workers.")
        self.generated_tokens = m.counter("generated", "tokens", "Tokens generated and sent to clients.")
        self.prefix_hit_tokens = m.counter(
            "prefix_hit", "tokens", "Prompt tokens the workers served from a KV cache, by tier.", ["tier"]
        )
        self.decisions = m.counter(
            "decisions", "total", "Routing decisions by worker role and reason.", ["role", "reason"]
        )
        self.worker_errors = m.counter(
            "worker_errors",
            "total",
            "Failed worker calls by worker address, RPC and status code.",
            ["worker", "rpc", "code"],
        )
        self.retries = m.counter(
            "retries", "total", "Requests sent to another worker after one failed, by role.", ["role"]
        )
        self.decision_latency = m.histogram(
            "routing_decision",
            "seconds",
            "Time to route one request: hash its blocks, look them up in the KV index, pick the decode "
            "worker, decide PD, pick the prefill worker.",
            buckets=DECISION_BUCKETS,
        )
        self.index_lookup_latency = m.histogram(
            "index_lookup", "seconds", "Time of one KV index lookup.", buckets=DECISION_BUCKETS
        )
        self.index_up = m.gauge(
            "index", "up", "1 while the KV index answers, 0 while it is unreachable (routing by load alone)."
        )
        self.index_unavailable = m.counter(
            "index_unavailable",
            "total",
            "Routing decisions made by load alone because the KV index could not be reached.",
        )
        self.index_forget_errors = m.counter(
            "index_forget_errors",
            "total",
            "Departed workers whose KV index entries could not be removed (Redis unreachable).",
        )
        self.registry_up = m.gauge(
            "registry", "up", "1 while the registry answers, 0 while the last known worker list is in use."
        )
        self.registry_errors = m.counter(
            "registry_errors",
            "total",
            "Registry reads that failed (the last known worker list stays in use).",
        )
        self.kv_event_stream_errors = m.counter(
            "kv_event_stream_errors",
            "total",
            "StreamKVEvents subscriptions that broke or could not start (the router resubscribes).",
        )
        self.response_store_errors = m.counter(
            "response_store_errors",
            "total",
            "Finished Responses API responses that could not be stored (Redis unreachable): they cannot be "
            "retrieved or continued.",
        )
        self.pool_workers = m.gauge(
            "pool",
            "workers",
            "Workers in the pool, by role and whether they take requests now.",
            ["role", "usable"],
        )
