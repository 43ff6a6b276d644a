"""What the prefill and decode services share: settings, the Worker servicer's common RPCs, KV-event
fan-out, metrics, proto conversions and the process wiring (gRPC server, metrics port, signals, drain).

The engine is used through the duck-typed ``AsyncEngine`` interface (``call``, ``generate``, ``abort``,
``engine``); this module does not import ``engine`` so that dependencies keep pointing one way.
Role-specific RPCs (Prefill, Decode) live in ``prefill_svc`` and ``decode_svc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from mesh.background import BackgroundTasks
from mesh.config import check_choices, setting
from mesh.eplb_client import start_eplb_client
from mesh.grpc_server import StatusError, format_address, set_serving, start_server, status_for
from mesh.kv_event_proto import events_to_proto
from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, Tier
from mesh.kv_transfer_proto import metadata_to_proto
from mesh.structured_outputs_proto import structured_outputs_from_proto
from mesh.telemetry import ServiceMetrics, server_span, setup_tracing, start_metrics_server
from mesh.vllm_metrics import VllmMetrics
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

# The engine's kinds of forward pass (its stats' ``<kind>_passes`` fields; engine.model_runner.PASS_KINDS).
FORWARD_PASS_KINDS = ("decode_graph", "prefill_graph", "eager")

# The trailing metadata entry of an UNAVAILABLE that refused a request before any of it ran (its value: a
# pdmesh.v1.Refusal name). The router reads it to know that a Decode's KV handle is still intact and can
# go to another decode worker.
REFUSAL_KEY = "pdmesh-refusal"

log = logging.getLogger(__name__)


class RefusedError(StatusError):
    """A request refused before any of it ran: UNAVAILABLE, with the refusal in trailing metadata."""

    def __init__(self, refusal: worker_pb2.Refusal.ValueType, message: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, message, ((REFUSAL_KEY, worker_pb2.Refusal.Name(refusal)),)
        )
        self.refusal = refusal


def refusal_of(exc: grpc.aio.AioRpcError) -> worker_pb2.Refusal.ValueType | None:
    """The refusal a worker's UNAVAILABLE carries, or None when it carries none (the call may have begun
    its work). A name this build does not know (a newer worker's) is still a refusal: REFUSAL_UNSPECIFIED."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == REFUSAL_KEY:
            name = value.decode() if isinstance(value, bytes) else value
            known = worker_pb2.Refusal.DESCRIPTOR.values_by_name.get(name)
            return known.number if known is not None else worker_pb2.REFUSAL_UNSPECIFIED
    return None


FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


@dataclass
class WorkerSettings:
    host: str = setting("127.0.0.1", "Address the gRPC server binds to.")
    port: int = setting(0, "gRPC port (0 picks a free one; the chosen port is printed).")
    advertise_host: str | None = setting(
        None, "Host other services use to reach this worker (default: --host)."
    )
    metrics_port: int = setting(
        0, "Port of the Prometheus /metrics endpoint (0 picks a free one, -1 disables)."
    )
    vllm_metrics: bool = setting(
        True,
        "Also expose vLLM's metric names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
        "vllm:time_to_first_token_seconds...), labelled model_name, for dashboards, llm-d's inference "
        "scheduler and autoscalers written for vLLM (docs/api.md, Metrics).",
    )
    worker_id: str | None = setting(None, "Unique worker id (default: role-host-port).")
    redis_url: str | None = setting(
        None, "Redis URL for the service registry and KV index (none: standalone)."
    )
    registry_ttl_s: float = setting(5.0, "Registration TTL in seconds; heartbeats renew it every TTL/3.")
    kv_transfer: str = setting("nixl", "KV transfer backend.", choices=("nixl", "local"))
    kv_xfer_mode: str = setting(
        "prepped",
        "NIXL transfer mode: prepped (one prepared descriptor per block, merged by NIXL; fastest measured) or "
        "coalesced (one descriptor per run of adjacent blocks).",
        choices=("prepped", "coalesced"),
    )
    nixl_progress_thread: str = setting(
        "auto",
        "NIXL progress thread (spins one core): auto = on for GPU KV pools, off for host-memory pools.",
        choices=("auto", "on", "off"),
    )
    kv_lease_s: float = setting(
        60.0, "How long a prefill worker holds KV blocks for a decode worker to pull."
    )
    kv_transfer_timeout_s: float = setting(30.0, "Longest a decode worker waits for one KV pull.")
    kvstore_address: str | None = setting(
        None,
        "host:port of the KV offload store (python -m kvstore_svc): finished requests' KV blocks are offered "
        "to it, and prompts load the prefix blocks it holds instead of computing them (docs/kv_offload.md); "
        "default: the store registered in --redis-url's registry, if any.",
    )
    kvstore_min_blocks: int = setting(
        2,
        "Load from the KV offload store only when it holds at least this many more prefix blocks than the "
        "local prefix cache.",
    )
    kvstore_timeout_s: float = setting(
        1.0,
        "Deadline of each Lookup, Fetch and handshake call to the KV offload store; a slower store is "
        "skipped and the prompt computed.",
    )
    kvstore_retry_s: float = setting(
        5.0, "After a failed call to the KV offload store, how long the worker leaves it alone."
    )
    kvstore_max_puts: int = setting(2, "Most offers (Put calls) to the KV offload store in flight at once.")
    kvstore_max_queued: int = setting(
        64,
        "Most offers waiting for a Put slot; finished requests' blocks beyond are not offloaded (counted).",
    )
    kvstore_max_held_blocks: int | None = setting(
        None, "Most KV blocks held for the store to read at once (default: a quarter of the pool)."
    )
    kvstore_offload_at: str = setting(
        "prefill",
        "When a request's blocks are offered to the KV offload store: prefill (its prompt's blocks as soon as the "
        "prompt is computed, the rest when it finishes, as vLLM's offloading connector stores blocks once "
        "computed) or finish (all when it finishes). A prefill worker's disaggregated requests are offered when "
        "their KV lease ends either way; a decode worker's imported prompts only when they finish.",
        choices=("prefill", "finish"),
    )
    kvstore_staging: str = setting(
        "auto",
        "Move the KV offload store's blocks through page-locked host blocks of the worker (device <-> host "
        "copies, host <-> store over NIXL): auto = for GPU KV pools, where NIXL has no fast direct path "
        "between device memory and another process's host memory (docs/kv_offload.md).",
        choices=("auto", "on", "off"),
    )
    kvstore_staging_blocks: int = setting(
        0,
        "Host blocks of the staging pool (default: the held-blocks limit, at most 1 GiB); offers wait for free "
        "ones, loads take what is free.",
    )
    drain_timeout_s: float = setting(
        300.0, "On drain (SIGTERM or Drain RPC), longest wait for in-flight requests."
    )
    eplb_address: str | None = setting(
        None,
        "host:port of the EPLB controller (python -m eplb_svc) a MoE worker with --enable-eplb reports expert "
        "load to and takes placements from; default: the one registered in --redis-url's registry.",
    )
    eplb_report_interval_s: float = setting(
        5.0, "With --enable-eplb: how often the worker sends its expert load to the EPLB controller."
    )
    eplb_pool: str | None = setting(
        None,
        "With --enable-eplb: the placement group's pool (workers of one pool, model and expert layout share "
        "a placement); default: the role, so prefill and decode fleets balance separately.",
    )
    otlp_endpoint: str | None = setting(None, "OTLP/gRPC endpoint for traces (off when unset).")
    trace_file: str | None = setting(
        None, "Append finished spans as JSON lines to this file (tests, debugging)."
    )
    log_level: str = setting("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        check_choices(self)


def sampling_kwargs(p: common_pb2.SamplingParams) -> dict[str, Any]:
    """Engine ``SamplingParams`` keyword arguments from the proto (unset optional fields keep defaults)."""
    kw: dict[str, Any] = {
        "top_k": p.top_k,
        "min_p": p.min_p,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "logprobs",
        "skip_special_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "prompt_logprobs",
    ):
        if p.HasField(name):
            kw[name] = getattr(p, name)
    if p.logit_bias:
        kw["logit_bias"] = dict(p.logit_bias)
    if p.include_stop_str_in_output:
        kw["include_stop_str_in_output"] = True
    if p.min_tokens:
        kw["min_tokens"] = p.min_tokens
    if p.allowed_token_ids:
        kw["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_outputs_from_proto(p.structured_outputs)
    if p.priority:
        kw["priority"] = p.priority
    if p.bad_words:
        kw["bad_words"] = list(p.bad_words)
    if "seed" in kw and kw["seed"] >= 2**63:
        kw["seed"] -= 2**64
    return kw


def logprobs_to_proto(lp: Any) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def prompt_logprobs_to_proto(prompt_logprobs: list[Any] | None) -> list[common_pb2.Logprobs]:
    """An engine output's prompt logprobs as the protos carry them: from the second prompt token on (the
    first has none)."""
    return [logprobs_to_proto(lp) for lp in (prompt_logprobs or [])[1:]]


@dataclass
class ProtoLogprobs:
    """Engine-side view of a ``Logprobs`` proto (same fields as the engine's TokenLogprobs)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0


def logprobs_from_proto(p: common_pb2.Logprobs) -> ProtoLogprobs:
    return ProtoLogprobs(p.token_id, p.logprob, [(t.token_id, t.logprob) for t in p.top_logprobs], p.rank)


class EventFanout:
    """KV-event sink for the engine thread: fans events out to StreamKVEvents subscribers on the event
    loop, keeps the set of cached hashes for snapshots, and forwards to an optional extra sink (the
    Redis KV index writer)."""

    def __init__(self, worker_id: str, model_fingerprint: str = "") -> None:
        self.worker_id = worker_id
        self.model_fingerprint = model_fingerprint
        self.loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._cached: dict[int, None] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self.forward: Callable[[list[KVEvent]], None] | None = None

    def publish(self, events: list[KVEvent]) -> None:
        with self._lock:
            for e in events:
                if isinstance(e, BlocksStored):
                    self._cached.update(dict.fromkeys(e.block_hashes))
                elif isinstance(e, BlocksRemoved):
                    for h in e.block_hashes:
                        self._cached.pop(h, None)
                elif isinstance(e, AllBlocksCleared):
                    self._cached.clear()
        if self.loop is not None and self._subscribers:
            self.loop.call_soon_threadsafe(self._dispatch, list(events))
        if self.forward is not None:
            self.forward(list(events))

    def _batch(self, events: list[KVEvent]) -> common_pb2.KVEventBatch:
        self._seq += 1
        return common_pb2.KVEventBatch(
            worker_id=self.worker_id,
            model_fingerprint=self.model_fingerprint,
            seq=self._seq,
            events=events_to_proto(events),
        )

    def _dispatch(self, events: list[KVEvent]) -> None:
        batch = self._batch(events)
        for q in self._subscribers:
            q.put_nowait(batch)

    def snapshot(self) -> list[KVEvent]:
        with self._lock:
            hashes = tuple(self._cached)
        return (
            [AllBlocksCleared(Tier.GPU), BlocksStored(hashes, Tier.GPU)]
            if hashes
            else [AllBlocksCleared(Tier.GPU)]
        )

    async def subscribe(self, include_snapshot: bool) -> AsyncIterator[common_pb2.KVEventBatch]:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        try:
            if include_snapshot:
                yield self._batch(self.snapshot())
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)


# How often a worker checks that its engine thread still runs.
ENGINE_WATCH_S = 0.5


# The labels of cache_config_info: the keys of engine.LLMEngine.cache_info (mesh does not import engine; a
# test checks that they agree).
CACHE_INFO_LABELS = (
    "block_size", "cache_dtype", "num_blocks", "kv_scales", "prefix_caching", "gpu_memory_utilization",
)  # fmt: skip
# vLLM's names of the same (vllm:cache_config_info; kv_scales is pdmesh's own: calculate_kv_scales is the
# nearest vLLM field, and no reader of vLLM's metric looks at it).
VLLM_CACHE_INFO_LABELS = (
    "block_size",
    "cache_dtype",
    "num_gpu_blocks",
    "calculate_kv_scales",
    "enable_prefix_caching",
    "gpu_memory_utilization",
)


class WorkerMetrics:
    """The metrics both worker roles expose, named ``pdmesh_<role>_<what>_<unit>``."""

    def __init__(self, role: str, model_name: str | None = None, max_loras: int | None = None) -> None:
        m = ServiceMetrics(role)
        self.registry = m.registry
        # vLLM's names for the same figures (mesh.vllm_metrics), labelled with the model's name;
        # ``max_loras`` where the worker serves LoRA adapters (vllm:lora_requests_info).
        self.vllm = (
            VllmMetrics(self.registry, model_name, VLLM_CACHE_INFO_LABELS, max_loras) if model_name else None
        )
        self.requests = m.counter("requests", "total", "Requests by outcome.", ["outcome"])
        self.ttft = m.histogram("time_to_first_token", "seconds", "Time from arrival to first token.")
        self.tpot = m.histogram(
            "time_per_output_token",
            "seconds",
            "Time between output tokens.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        )
        self.queue_time = m.histogram("queue_time", "seconds", "Time from arrival to first scheduling.")
        self.waiting = m.gauge("queue_length", "requests", "Requests waiting to be scheduled.")
        self.running = m.gauge("running", "requests", "Requests in the running batch.")
        self.kv_used = m.gauge("kv_blocks_used", "blocks", "KV blocks in use (referenced or held).")
        self.kv_free = m.gauge("kv_blocks_free", "blocks", "KV blocks free or evictable.")
        self.kv_held = m.gauge(
            "kv_held", "requests", "Prefill results holding KV blocks for a decode worker."
        )
        self.cache_config = m.gauge(
            "cache_config",
            "info",
            "The KV cache's configuration in the labels; the value is 1 (as vLLM's cache_config_info).",
            CACHE_INFO_LABELS,
        )
        self.prompt_tokens = m.counter("prompt_tokens", "tokens", "Prompt tokens served.")
        self.cached_tokens = m.counter(
            "prompt_tokens_cached", "tokens", "Prompt tokens served from the cache.", ["tier"]
        )
        self.generated_tokens = m.counter("generation_tokens", "tokens", "Tokens generated.")
        self.kv_bytes = m.counter("kv_transfer", "bytes", "KV bytes pulled from prefill workers.")
        self.kv_transfer_time = m.histogram("kv_transfer_time", "seconds", "Duration of one KV pull.")
        self.kv_leases_expired = m.counter("kv_leases_expired", "total", "Held KV released by lease expiry.")
        self.lookahead_steps = m.counter(
            "lookahead_steps",
            "total",
            "Steps launched before the previous step's tokens were read (asynchronous scheduling).",
        )
        self.lookahead_drains = m.counter(
            "lookahead_drains",
            "total",
            "Steps in flight read out first because the next step could not overlap them (a prompt "
            "that would be chunked or evict, a KV import that would evict, logprobs, held KV, an abort).",
        )
        self.lookahead_late_waits = m.counter(
            "lookahead_late_waits",
            "total",
            "Waits for a step in flight to reach its last decode-graph piece before the next step was "
            "launched, so that requests arriving meanwhile join it (lookahead_late_launch).",
        )
        self.lookahead_joins = m.counter(
            "lookahead_joins",
            "total",
            "Waiting requests (imports, new prompts) a lookahead step took in without reading out the "
            "step in flight.",
        )
        self.idle_passes = m.counter(
            "expert_parallel_idle_passes",
            "total",
            "Forward passes of padding only, run to join the other expert-parallel ranks' step.",
        )
        self.group_sync = m.counter(
            "expert_parallel_sync",
            "seconds",
            "Host time spent agreeing with the other expert-parallel ranks on each step.",
        )
        self.forward_passes = m.counter(
            "forward_passes",
            "total",
            "Forward passes by how they ran: decode_graph (a captured decode CUDA graph), prefill_graph "
            "(the piecewise prefill graphs, attention eager between them), eager (every kernel launched "
            "from the host: CPU, torch ops, or a step larger than the graphs hold).",
            ["kind"],
        )
        self.structured_requests = m.counter(
            "structured_output_requests",
            "total",
            "Requests held to a structured output, by kind: json, json_object, regex, choice, grammar.",
            ["kind"],
        )
        self.grammar_compile_time = m.histogram(
            "grammar_compile_time",
            "seconds",
            "Time to have a request's structured-output constraint compiled (microseconds when cached).",
            buckets=(0.0001, 0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
        )
        self.spec_draft_tokens = m.counter(
            "spec_decode_draft_tokens", "tokens", "Draft tokens computed (speculative decoding)."
        )
        self.spec_accepted_tokens = m.counter(
            "spec_decode_accepted_tokens", "tokens", "Draft tokens the sampling kept (speculative decoding)."
        )
        self.spec_drafts = m.counter(
            "spec_decode_drafts",
            "total",
            "Drafts verified, one a drafting request a step (speculative decoding).",
        )
        self.spec_accepted_per_pos = m.counter(
            "spec_decode_accepted_tokens_per_pos",
            "tokens",
            "Drafts whose token at this position (0: the first) the sampling kept (speculative decoding).",
            ["position"],
        )
        self._per_pos_last: list[int] = []
        # Counters that follow a running total of the engine's stats: (counter, stats field).
        vllm = self.vllm
        self._totals = [
            (self.prompt_tokens, "prompt_tokens_total"),
            (self.cached_tokens.labels(tier="gpu"), "cached_prompt_tokens_total"),
            (self.generated_tokens, "generated_tokens_total"),
            (self.spec_draft_tokens, "spec_draft_tokens"),
            (self.spec_accepted_tokens, "spec_accepted_tokens"),
            (self.spec_drafts, "spec_drafts"),
            *(
                [
                    (vllm.prompt_tokens, "prompt_tokens_total"),
                    (vllm.prefix_queries, "prompt_tokens_total"),
                    (vllm.prefix_hits, "cached_prompt_tokens_total"),
                    (vllm.generation_tokens, "generated_tokens_total"),
                    (vllm.preemptions, "num_preemptions"),
                    (vllm.spec_draft_tokens, "spec_draft_tokens"),
                    (vllm.spec_accepted_tokens, "spec_accepted_tokens"),
                    (vllm.spec_drafts, "spec_drafts"),
                ]
                if vllm is not None
                else []
            ),
            (self.lookahead_steps, "lookahead_steps"),
            (self.lookahead_drains, "lookahead_drains"),
            (self.lookahead_late_waits, "lookahead_late_waits"),
            (self.lookahead_joins, "lookahead_joins"),
            (self.idle_passes, "idle_passes"),
            (self.group_sync, "group_sync_seconds"),
            *((self.forward_passes.labels(kind=k), f"{k}_passes") for k in FORWARD_PASS_KINDS),
        ]
        self._last = [0] * len(self._totals)

    def set_cache_info(self, info: dict[str, str]) -> None:
        """The engine's KV cache configuration (``LLMEngine.cache_info``), once at start."""
        self.cache_config.labels(**{name: info[name] for name in CACHE_INFO_LABELS}).set(1)
        if self.vllm is not None:
            self.vllm.cache_config.labels(
                **{
                    vllm: info[ours]
                    for vllm, ours in zip(VLLM_CACHE_INFO_LABELS, CACHE_INFO_LABELS, strict=True)
                }
            ).set(1)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        if self.vllm is not None:
            self.vllm.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)
        if self.vllm is not None:
            self.vllm.itl.observe(seconds)

    def queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)
        if self.vllm is not None:
            self.vllm.queue_time.observe(seconds)

    def finished(
        self, outcome: str, reason: str | None, e2e_s: float | None, tokens: tuple[int, int] | None = None
    ) -> None:
        """A request that ended: ``outcome`` is pdmesh's label, ``reason`` the engine's finish reason (a
        prefill hand-off is vLLM's "length": a vLLM prefill instance runs max_tokens=1), ``tokens`` its
        prompt and generated token counts."""
        self.requests.labels(outcome=outcome).inc()
        if self.vllm is not None:
            self.vllm.finished(reason)
            if e2e_s is not None:
                self.vllm.e2e.observe(e2e_s)
            if tokens is not None:
                self.vllm.request_prompt_tokens.observe(tokens[0])
                self.vllm.request_generation_tokens.observe(tokens[1])

    def phases(self, out: Any, end_ns: int, prefilled_here: bool) -> None:
        """vLLM's per-request phase times from an ended request's engine output: prefill (first scheduled
        to first token, where this worker computed the prompt), decode (first token to ``end_ns``) and
        inference (first scheduled to ``end_ns``)."""
        if self.vllm is None or not out.first_scheduled_ns:
            return
        if prefilled_here and out.first_token_ns:
            self.vllm.prefill_time.observe(max(0, out.first_token_ns - out.first_scheduled_ns) / 1e9)
        if out.first_token_ns and end_ns > out.first_token_ns:
            self.vllm.decode_time.observe((end_ns - out.first_token_ns) / 1e9)
        self.vllm.inference_time.observe(max(0, end_ns - out.first_scheduled_ns) / 1e9)

    def lora_requests_from(self, engine: Any) -> None:
        """vllm:lora_requests_info: the adapters running requests hold slots of (the engine's few LoRA
        slots, not its running requests, are read) and those of waiting requests (called on the engine
        thread after each step, where LoRA is served)."""
        if self.vllm is not None and self.vllm.lora_info is not None:
            self.vllm.lora_requests(
                [slot.name for slot in engine.lora.slots if slot.refs and slot.name],
                [s.lora_name for s in engine.scheduler.waiting if s.lora_name],
            )

    def update_from(self, stats: Any) -> None:
        """Refresh gauges and counters from engine stats (called on the engine thread after each step)."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_free.set(stats.num_kv_blocks_free)
        self.kv_used.set(stats.num_kv_blocks_total - stats.num_kv_blocks_free)
        self.kv_held.set(stats.num_held)
        if self.vllm is not None:
            used = stats.num_kv_blocks_total - stats.num_kv_blocks_free
            self.vllm.update(stats.num_running, stats.num_waiting, used, stats.num_kv_blocks_total)
        for i, (counter, name) in enumerate(self._totals):
            total = getattr(stats, name)
            counter.inc(total - self._last[i])
            self._last[i] = total
        per_pos = stats.spec_accepted_per_pos
        if len(self._per_pos_last) < len(per_pos):
            self._per_pos_last += [0] * (len(per_pos) - len(self._per_pos_last))
        for pos, total in enumerate(per_pos):
            if total != self._per_pos_last[pos]:
                self.spec_accepted_per_pos.labels(position=str(pos)).inc(total - self._per_pos_last[pos])
                if self.vllm is not None:
                    self.vllm.spec_accepted_per_pos(pos).inc(total - self._per_pos_last[pos])
                self._per_pos_last[pos] = total


class WorkerServicerBase(worker_pb2_grpc.WorkerServicer):
    """The Worker RPCs both roles answer the same way: Abort, GetStats, Drain, StreamKVEvents,
    GetTransferMetadata. Subclasses add Prefill or Decode."""

    role: int = common_pb2.WORKER_ROLE_UNSPECIFIED
    # The worker's use of the KV offload store (mesh.kv_offload_client.KVOffloadClient), when it has one.
    kv_offload: Any = None

    def __init__(
        self,
        async_engine: Any,
        transfer: Any,
        settings: WorkerSettings,
        worker_id: str,
        address: str,
        events: EventFanout,
        metrics: WorkerMetrics,
    ) -> None:
        self.aengine = async_engine
        self.engine = async_engine.engine
        self.transfer = transfer
        self.settings = settings
        self.worker_id = worker_id
        self.address = address
        self.events = events
        self.metrics = metrics
        self.draining = False
        self.in_flight: set[str] = set()
        self.server: grpc.aio.Server | None = None
        self.stop_requested = asyncio.Event()  # set by the Drain RPC: drain, deregister, exit
        # Tasks nobody awaits (the role's background work, the health flip on drain): kept referenced
        # until they end, their failures logged, cancelled and awaited by ``close``.
        self.tasks = BackgroundTasks(type(self).__name__)
        self._lora_lock = asyncio.Lock()  # one adapter change at a time

    # ---- shared RPCs ---------------------------------------------------------------------------
    async def Abort(
        self,
        request: worker_pb2.AbortRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.AbortResponse:
        found = await self.aengine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetStats(
        self,
        request: worker_pb2.StatsRequest,
        context: grpc.aio.ServicerContext,
    ) -> common_pb2.WorkerStats:
        s = await self.aengine.call(self.engine.stats)
        adapters = await self.aengine.lora_adapters() if self.lora_enabled else {}
        return common_pb2.WorkerStats(
            role=self.role,
            worker_id=self.worker_id,
            model_fingerprint=self.engine.model_fingerprint,
            block_size=self.engine.config.block_size,
            num_kv_blocks_total=s.num_kv_blocks_total,
            num_kv_blocks_free=s.num_kv_blocks_free,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            running_tokens=s.running_tokens,
            queued_tokens=s.queued_tokens,
            kv_usage=1.0 - s.num_kv_blocks_free / max(1, s.num_kv_blocks_total),
            draining=self.draining,
            layout_fingerprint=self.engine.layout.fingerprint,
            max_model_len=self.engine.max_model_len,
            lora_adapters=_adapters_to_proto(adapters),
        )

    async def Drain(
        self,
        request: worker_pb2.DrainRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.DrainResponse:
        self.start_drain()
        if request.wait:
            await self.wait_idle(self.settings.drain_timeout_s)
        in_flight = len(self.in_flight)
        self.stop_requested.set()  # the process finishes what it has, deregisters and exits
        return worker_pb2.DrainResponse(num_in_flight=in_flight)

    async def ResetPrefixCache(
        self,
        request: worker_pb2.ResetPrefixCacheRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.ResetPrefixCacheResponse:
        evicted = await self.aengine.call(self.engine.reset_prefix_cache)
        log.info("prefix cache reset: %d blocks evicted", evicted)
        return worker_pb2.ResetPrefixCacheResponse(num_evicted_blocks=evicted)

    async def Embed(
        self,
        request: worker_pb2.EmbedRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.EmbedResponse:
        """One prompt's embedding, or a classifier's probabilities (``engine.pooling``): computed as a
        prefill is, holding no KV."""
        rid = request.request_id
        with self.request_scope("Embed", rid, context) as span:
            try:
                self.check_admission()
                pooling = self.engine.pooling.resolve(  # the model's defaults (immutable: read here)
                    PoolingParams(
                        pooling_type=request.pooling_type or None,
                        normalize=request.normalize if request.HasField("normalize") else None,
                        dimensions=request.dimensions or None,
                        task=request.task or "embed",
                        activation=request.activation if request.HasField("activation") else None,
                    )
                )
                out = None
                async for item in self.generate(  # loads what the KV offload store holds first
                    rid,
                    list(request.prompt_token_ids),
                    SamplingParams(priority=request.priority),
                    cache_salt=request.cache_salt or None,
                    lora_name=request.lora_name or None,
                    pooling=pooling,
                ):
                    out = item
                if out is None or out.embedding is None:
                    raise RuntimeError(f"the engine's stream for {rid} ended without an embedding")
            except Exception as exc:  # every failure leaves as a gRPC status
                await self.fail(context, span, exc)
            # Counted as the role counts a request that ends (vLLM counts pooling requests alike): its queue
            # time, its prefill (the prompt) and inference, its end-to-end latency, no generated token.
            self.metrics.queued(max(0, out.first_scheduled_ns - out.arrival_time_ns) / 1e9)
            self.metrics.phases(out, out.first_token_ns, prefilled_here=True)
            self.metrics.finished(
                "finished" if self.role == common_pb2.WORKER_ROLE_PREFILL else out.finish_reason,
                out.finish_reason,
                max(0, time.time_ns() - out.arrival_time_ns) / 1e9,
                (out.num_prompt_tokens, 0),
            )
            return worker_pb2.EmbedResponse(
                request_id=rid,
                embedding=out.embedding,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
            )

    # ---- LoRA adapters (vLLM's load_lora_adapter / unload_lora_adapter, one worker's part) -------------
    @property
    def lora_enabled(self) -> bool:
        return bool(getattr(self.engine.config, "enable_lora", False))

    async def LoadLoRAAdapter(
        self,
        request: worker_pb2.LoadLoRAAdapterRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.LoRAAdaptersResponse:
        name, path = request.lora_name, request.lora_path
        async with self._lora_lock:
            try:
                self._check_lora_rpc(name)
                if not path:
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "lora_path is required")
                await self.aengine.add_lora(name, path)
            except Exception as exc:
                await self._lora_failed(context, "load", name, exc)
            log.info("LoRA adapter %r loaded from %s", name, path)
            return worker_pb2.LoRAAdaptersResponse(
                lora_adapters=_adapters_to_proto(await self.aengine.lora_adapters())
            )

    async def UnloadLoRAAdapter(
        self,
        request: worker_pb2.UnloadLoRAAdapterRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.LoRAAdaptersResponse:
        name = request.lora_name
        async with self._lora_lock:  # no load between the check and the removal
            try:
                self._check_lora_rpc(name)
                served = await self.aengine.list_loras()
                if name not in served:
                    raise StatusError(
                        grpc.StatusCode.NOT_FOUND,
                        f"worker {self.worker_id} serves no LoRA adapter named {name!r} (it serves: "
                        f"{', '.join(served) or 'none'})",
                    )
                await self.aengine.remove_lora(name)
            except Exception as exc:
                await self._lora_failed(context, "unload", name, exc)
            log.info("LoRA adapter %r unloaded", name)
            return worker_pb2.LoRAAdaptersResponse(
                lora_adapters=_adapters_to_proto(await self.aengine.lora_adapters())
            )

    def _check_lora_rpc(self, name: str) -> None:
        if not self.lora_enabled:
            raise StatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {self.worker_id} serves no LoRA adapters: start it with --enable-lora",
            )
        if not name:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required")

    async def _lora_failed(
        self, context: grpc.aio.ServicerContext, what: str, name: str, exc: Exception
    ) -> None:
        """End a LoRA RPC with its status (``status_for``: the engine's LoRAError and InvalidRequestError
        name INVALID_ARGUMENT), with the engine's message."""
        code, message = status_for(exc)
        log.warning("LoRA adapter %r not %sed: %s: %s", name, what, code.name, message)
        await context.abort(code, message)

    async def StreamKVEvents(
        self,
        request: worker_pb2.KVEventsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[common_pb2.KVEventBatch]:
        async for batch in self.events.subscribe(request.include_snapshot):
            yield batch

    async def GetTransferMetadata(
        self, request: common_pb2.TransferMetadataRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TransferMetadata:
        agents = [self.transfer]
        if self.kv_offload is not None and self.kv_offload.staging is not None:
            agents.append(self.kv_offload.staging.agent)
        named = (
            [a for a in agents if a.agent_name == request.agent_name] if request.agent_name else agents[:1]
        )
        if not named:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this worker has no transfer agent {request.agent_name!r} (it has "
                f"{', '.join(a.agent_name for a in agents)}); it may have restarted",
            )
        meta = named[0].metadata()
        if request.layout_fingerprint and request.layout_fingerprint != meta.layout_fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout fingerprint mismatch: this worker has {meta.layout_fingerprint}, "
                f"the requester has {request.layout_fingerprint}; both must serve the same "
                "model, dtype, block size and KV shape",
            )
        return metadata_to_proto(meta)

    async def sampling_params(self, p: common_pb2.SamplingParams) -> SamplingParams:
        """The engine's parameters for a request. A structured-output constraint is compiled here, on a
        thread of its own, so that the engine thread (which then finds it compiled) never waits on it."""
        params = SamplingParams(**sampling_kwargs(p))
        spec = params.structured_outputs
        if spec is not None:
            started = time.monotonic()
            await asyncio.to_thread(self.engine.grammars.compile, spec)
            self.metrics.grammar_compile_time.observe(time.monotonic() - started)
            self.metrics.structured_requests.labels(kind=spec.kind).inc()
        return params

    def transfer_progress(self) -> None:
        """Drive the transfer agent while a peer READs this worker's pool (the KV offload store reading offered
        blocks): NIXL without a progress thread completes such a READ only as often as its target polls. The
        decode role expects no notifications; the prefill role's lease keeper polls them itself."""
        self.transfer.get_notifications()

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncEngine.generate``; with a KV offload store, the prompt's prefix blocks the store holds are
        loaded first (``mesh.kv_offload_client``)."""
        if self.kv_offload is not None:
            return self.kv_offload.generate(*args, **kwargs)
        return self.aengine.generate(*args, **kwargs)

    # ---- drain and admission -------------------------------------------------------------------
    def check_admission(self) -> None:
        if self.draining:
            raise RefusedError(worker_pb2.REFUSAL_DRAINING, f"worker {self.worker_id} is draining")
        if not self.aengine.alive:
            raise RefusedError(
                worker_pb2.REFUSAL_ENGINE_DOWN, f"worker {self.worker_id}: engine is not running"
            )

    def start_drain(self) -> None:
        if not self.draining:
            log.info("worker %s draining: no new requests", self.worker_id)
            self.draining = True
            if self.server is not None:
                self.tasks.spawn(set_serving(self.server, False), "health-not-serving")

    async def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = await self.aengine.call(self.engine.stats)
            if (
                not self.in_flight
                and stats.num_running == 0
                and stats.num_waiting == 0
                and stats.num_held == 0
            ):
                return
            await asyncio.sleep(0.05)

    @contextlib.contextmanager
    def request_scope(self, rpc: str, request_id: str, context: grpc.aio.ServicerContext):
        """The server span of one request's RPC (child of the caller's), and its in-flight tracking."""
        attributes = {"pdmesh.request_id": request_id, "pdmesh.worker_id": self.worker_id}
        with server_span(f"Worker/{rpc}", context.invocation_metadata(), attributes) as span:
            self.in_flight.add(request_id)
            try:
                yield span
            finally:
                self.in_flight.discard(request_id)

    async def fail(self, context: grpc.aio.ServicerContext, span: Any, exc: Exception) -> None:
        """End the RPC with the status the error maps to (raises), counted and recorded on the span."""
        self.metrics.finished("error", None, None)
        code, message = status_for(exc)
        span.set_attribute("pdmesh.error", message)
        await context.abort(code, message, exc.trailing_metadata if isinstance(exc, StatusError) else ())

    async def background(self) -> None:
        """Role-specific background work (lease expiry, notifications); runs until cancelled."""
        await asyncio.Event().wait()

    async def close(self) -> None:
        """Cancel and await the servicer's tasks (``background`` and any health flip still pending)."""
        await self.tasks.close()


def _adapters_to_proto(adapters: dict[str, str]) -> list[common_pb2.LoRAAdapter]:
    return [common_pb2.LoRAAdapter(name=name, path=path) for name, path in sorted(adapters.items())]


def default_worker_id(role: str, host: str, port: int) -> str:
    return f"{role}-{host}-{port}-{uuid.uuid4().hex[:6]}"


async def serve_worker(
    role: str,
    servicer_cls: type[WorkerServicerBase],
    settings: WorkerSettings,
    make_engine: Callable[[EventFanout], Any],
    ready_line: bool = True,
) -> None:
    """Build and run one worker process until SIGTERM/SIGINT (then drain) or until drained."""
    logging.basicConfig(
        level=settings.log_level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )
    setup_tracing(f"pdmesh-{role}", settings.otlp_endpoint, jsonl_path=settings.trace_file)
    events = EventFanout(worker_id="pending")
    events.loop = asyncio.get_running_loop()
    aengine = make_engine(events)
    engine = aengine.engine
    events.model_fingerprint = engine.model_fingerprint
    lora = bool(getattr(engine.config, "enable_lora", False))
    metrics = WorkerMetrics(
        role,
        model_name=engine.config.model if settings.vllm_metrics else None,
        max_loras=engine.config.max_loras if lora else None,
    )
    metrics.set_cache_info(engine.cache_info())
    if lora:

        def on_step(eng: Any) -> None:
            metrics.update_from(eng.stats())
            metrics.lora_requests_from(eng)

        aengine.on_step = on_step
        metrics.lora_requests_from(engine)  # the series is there from the start, with no adapter in use
    else:
        aengine.on_step = lambda eng: metrics.update_from(eng.stats())
    from mesh.kv_transfer import create_transfer_agent

    agent_name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # NIXL's progress thread spins a whole core even when idle. On a small CPU host workers drive progress
    # themselves (the prefill lease keeper polls notifications, the decode side polls its reads); on a GPU
    # host one of many cores is cheap, and READs of device memory then need not wait for that polling.
    progress = settings.nixl_progress_thread == "on" or (
        settings.nixl_progress_thread == "auto" and engine.kv_pool.device.type == "cuda"
    )
    transfer = create_transfer_agent(
        settings.kv_transfer, agent_name, engine.kv_pool, engine.layout,
        progress_thread=progress, xfer_mode=settings.kv_xfer_mode,
    )  # fmt: skip
    servicer = servicer_cls(aengine, transfer, settings, "pending", "", events, metrics)
    server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)],
        ["pdmesh.v1.Worker"],
        host=settings.host,
        port=settings.port,
    )
    host = settings.advertise_host or settings.host
    worker_id = settings.worker_id or default_worker_id(role, host, port)
    servicer.worker_id = events.worker_id = worker_id
    servicer.address = format_address(host, port)
    servicer.server = server
    metrics_port = -1
    if settings.metrics_port >= 0:
        metrics_port = await start_metrics_server(metrics.registry, settings.host, settings.metrics_port)
    aengine.start()
    if settings.kvstore_address or settings.redis_url:
        from mesh.kv_offload_client import KVOffloadClient

        servicer.kv_offload = KVOffloadClient(
            aengine, transfer, settings, metrics.registry, role, progress=servicer.transfer_progress
        )
        await servicer.kv_offload.start(servicer.tasks, worker_id, servicer.address)
    registration = await _register(role, servicer, settings, metrics_port)
    stop = servicer.stop_requested
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servicer.tasks.spawn(servicer.background(), f"{role}-background")
    servicer.tasks.spawn(_watch_engine(aengine, server, registration, stop), f"{role}-engine-watch")
    eplb = await start_eplb_client(
        aengine, servicer.tasks.spawn, ServiceMetrics(role, metrics.registry), role=role, worker_id=worker_id,
        address=settings.eplb_address, redis_url=settings.redis_url, pool=settings.eplb_pool,
        report_interval_s=settings.eplb_report_interval_s,
    )  # fmt: skip
    if ready_line:
        print(
            f"pdmesh {role} ready: grpc={servicer.address} metrics={settings.host}:{metrics_port} "
            f"worker_id={worker_id} model={engine.model_fingerprint} kv_blocks={engine.block_pool.num_blocks}",
            flush=True,
        )
    await stop.wait()
    log.info("stopping: draining in-flight requests")
    servicer.start_drain()
    if registration is not None:
        await registration.mark_draining()
    await servicer.wait_idle(settings.drain_timeout_s)
    if registration is not None:
        await registration.stop()
    await servicer.close()
    if servicer.kv_offload is not None:
        await servicer.kv_offload.close()
    if eplb is not None:
        await eplb.close()
    await server.stop(grace=2.0)
    # Expert-parallel ranks stop together: the others may still be draining (for up to their drain timeout).
    aengine.stop(timeout=settings.drain_timeout_s + 10.0)
    transfer.close()
    if not aengine.alive:  # its thread has stopped: nothing steps the engine any more
        engine.close()


async def _watch_engine(
    aengine: Any, server: grpc.aio.Server, registration: Any, stop: asyncio.Event
) -> None:
    """Once the engine thread has died (a failed step of an expert-parallel group: another rank died or
    hung), take the worker out of rotation: health NOT_SERVING (orchestrators restart it, routers stop
    choosing it) and draining in the registry. Requests are refused already (``check_admission``)."""
    while not stop.is_set():
        if not aengine.alive:
            log.error("the engine thread is not running: health NOT_SERVING, draining in the registry")
            await set_serving(server, False)
            if registration is not None:
                await registration.mark_draining()
            return
        await asyncio.sleep(ENGINE_WATCH_S)


async def _register(
    role: str, servicer: WorkerServicerBase, settings: WorkerSettings, metrics_port: int
) -> Any:
    """Register in the service registry when a Redis URL is given (the router then discovers us)."""
    if not settings.redis_url:
        return None
    from mesh.worker_registration import WorkerRegistration

    reg = WorkerRegistration(role, servicer, settings, metrics_port)
    await reg.start()
    return reg


def worker_main(
    role: str,
    servicer_cls: type[WorkerServicerBase],
    engine_config_cls: type,
    make_engine: Callable[[Any, EventFanout], Any],
    argv: list[str] | None = None,
) -> None:
    """``python -m <role>_svc``: parse the engine's and the worker's settings (flags, then ``PDMESH_*``),
    then serve until drained. The engine classes come from the caller, so mesh never imports engine."""
    import argparse
    import sys

    from mesh.config import add_arguments, from_sources

    parser = argparse.ArgumentParser(prog=f"python -m {role}_svc", description=f"pdmesh {role} worker.")
    add_arguments(parser, engine_config_cls, "engine")
    add_arguments(parser, WorkerSettings, "worker")
    args = parser.parse_args(argv)
    engine_cfg = from_sources(engine_config_cls, args)
    settings = from_sources(WorkerSettings, args)
    try:
        asyncio.run(serve_worker(role, servicer_cls, settings, lambda sink: make_engine(engine_cfg, sink)))
    except KeyboardInterrupt:
        sys.exit(130)
