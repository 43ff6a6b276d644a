"""vLLM-named twins of a worker's metrics, on the same ``/metrics``: what vLLM's Grafana dashboards,
llm-d's inference scheduler (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and autoscalers
keyed on vLLM's names read, so that they read a pdmesh worker as they read a vLLM server.

Each is fed from the same events as its ``pdmesh_<role>_*`` twin (``mesh.worker_service.WorkerMetrics``),
labelled as vLLM labels them (``model_name``, ``engine``). Only metrics whose meaning is the same are
twinned; the rest stay pdmesh's own. Nothing here reads the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets, so that a dashboard's quantiles mean the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason label values


# vLLM's labels of vllm:lora_requests_info, in its order (max_loras, and the adapters of the running and the
# waiting requests, comma separated); the gauge's value is the time of the last update, as vLLM sets it.
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


class VllmMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        cache_labels: Sequence[str],
        max_loras: int | None = None,
    ) -> None:
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          [*names, "position"], registry=registry)  # fmt: skip
        self.spec_accepted_per_pos = lambda pos: per_pos.labels(**labels, position=str(pos))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)  # fmt: skip
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)  # fmt: skip
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)  # fmt: skip
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)  # fmt: skip
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)  # fmt: skip
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=registry)  # fmt: skip
        self.success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS
        }
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  list(cache_labels), registry=registry)  # fmt: skip
        # Only where LoRA is served (max_loras given), as vLLM registers it only with a LoRA config.
        self.max_lora = str(max_loras) if max_loras is not None else None
        self.lora_info = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                list(LORA_INFO_LABELS),
                registry=registry,
            )  # fmt: skip
            if max_loras is not None
            else None
        )
        self._lora_adapters: tuple[str, str] | None = None
        self._lora_set_at = 0.0

    def update(self, running: int, waiting: int, blocks_used: int, blocks_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(blocks_used / blocks_total if blocks_total else 0.0)

    def lora_requests(self, running: Sequence[str], waiting: Sequence[str]) -> None:
        """The adapters of the running and the waiting requests now (each named once, sorted). The series of
        the current adapters is set to the time (vLLM's ``set_to_current_time``), so a reader takes the
        newest one; it is set again when the adapters change, else at most once a second."""
        if self.lora_info is None:
            return
        key = (",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        now = time.time()
        if key == self._lora_adapters and now - self._lora_set_at < 1.0:
            return
        self._lora_adapters, self._lora_set_at = key, now
        self.lora_info.labels(
            running_lora_adapters=key[0], waiting_lora_adapters=key[1], max_lora=self.max_lora
        ).set(now)

    def finished(self, reason: str | None) -> None:
        """A request that ended with the engine's finish reason (stop, length, abort; others are not
        vLLM's successes)."""
        if reason in self.success:
            self.success[reason].inc()
