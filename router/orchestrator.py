"""Prefill/decode orchestration of one request: choose workers, Prefill, then Decode with the KV handle.

``Orchestrator.generate`` takes a tokenized, validated request and yields ``Chunk``s of new token ids,
the last one with a finish reason and usage. The first token goes out as soon as Prefill answers. It owns
the failure rules:

- a prefill worker that fails is replaced by the next best one; when all fail, the decode worker prefills;
- a decode worker that fails before any of its tokens reached the client is replaced: with the same KV
  handle when it failed before it could have read the KV (it refused the request, was unreachable or
  draining), otherwise by a local prefill on the next decode worker whose first token must equal the one
  the client already has (greedy and seeded sampling reproduce it; the prefill worker may have freed the
  blocks once the first reader's notification arrived, so the handle is not reused). After any of its
  tokens reached the client, a failure is a clean error;
- when Decode fails after Prefill succeeded, ``ReleaseKV`` frees the prefill worker's blocks at once;
- a client that goes away (the consumer stops iterating or is cancelled) cancels the worker calls, and
  ``Abort`` (plus ``ReleaseKV`` when the decode never started) goes to the workers in the background.

It knows nothing of HTTP or of the public gRPC API: text, stop strings and response shapes belong to the
front ends. Worker choice goes through ``router.chooser``: decode worker first, then whether it prefills
itself, then the prefill worker; the whole decision is timed (``pdmesh_router_routing_decision_seconds``).
It counts, per worker endpoint, the calls and prompt tokens in flight (load between stats polls).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from mesh.background import BackgroundTasks
from mesh.telemetry import get_tracer, inject_metadata
from mesh.worker_service import refusal_of
from protos.pdmesh.v1 import common_pb2, worker_pb2
from router.chooser import PREFILL_FAILED, RouteRequest, WorkerChooser
from router.errors import (
    NoWorkerAvailableError,
    RouterError,
    UpstreamError,
    UpstreamTimeoutError,
    from_worker_status,
)
from router.metrics import RouterMetrics
from router.worker_pool import DECODE, PREFILL, WorkerEndpoint, WorkerPool

log = logging.getLogger(__name__)

FINISH_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
FINISH_ERROR = common_pb2.FINISH_REASON_ERROR

# Decode failures that happen before the worker could have read a KV handle's blocks: the handle may be
# given to the next decode worker. UNAVAILABLE qualifies only when the worker refused the request (its
# status carries a pdmesh.v1.Refusal, ``mesh.worker_service.refusal_of``) or was never reached.
KV_UNTOUCHED = frozenset(
    {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
)
# gRPC core's words for a call it never sent because no connection to the worker could be made: the client
# library exposes that case as text only (no worker answered, so no worker could add metadata).
UNREACHED_MARKERS = ("failed to connect", "connection refused")

# Worker statuses after which another worker of the same role may succeed.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,  # KV layout mismatch between this pair of workers
        grpc.StatusCode.UNIMPLEMENTED,  # e.g. a decode worker listed as a prefill worker
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)


def _kv_untouched(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Decode certainly ended before the worker could read the KV handle's blocks."""
    if exc.code() in KV_UNTOUCHED:
        return True
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    if refusal_of(exc) is not None:
        return True
    details = (exc.details() or "").lower()
    return any(m in details for m in UNREACHED_MARKERS)


@dataclass
class Generation:
    """One request, tokenized and validated, as the front ends hand it over."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: common_pb2.SamplingParams
    endpoint: str  # for metrics and spans: "completions", "chat_completions", "grpc_generate"
    session_id: str | None = None
    cache_salt: str = ""
    lora_name: str = ""  # the LoRA adapter it runs with (the model field named it); empty: the base model
    trace_context: otel_context.Context | None = None  # the caller's, when it sent one


@dataclass
class EmbedCall:
    """One prompt of an embeddings or classification request, tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    pooling_type: str = ""  # empty: the model's
    normalize: bool | None = None  # None: the model's
    dimensions: int | None = None
    priority: int = 0
    cache_salt: str = ""
    lora_name: str = ""
    trace_context: otel_context.Context | None = None
    task: str = "embed"  # or "classify": a sequence classifier's probabilities (engine.pooling)
    activation: bool | None = None  # classify: None or True the softmax / sigmoid, False the logits


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has ``finish_reason`` and ``usage``."""

    token_ids: list[int]
    logprobs: list[common_pb2.Logprobs] = field(default_factory=list)
    finish_reason: int = FINISH_UNSPECIFIED
    # On the first chunk, with SamplingParams.prompt_logprobs: the prompt's from its second token on.
    prompt_logprobs: list[common_pb2.Logprobs] = field(default_factory=list)
    usage: common_pb2.Usage | None = None
    prefill_worker: str = ""
    decode_worker: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != FINISH_UNSPECIFIED


@dataclass
class _State:
    """What a request has touched, so cleanup knows whom to tell."""

    prefill_worker: WorkerEndpoint | None = None  # called Prefill (may hold the request's KV)
    kv_held: bool = False  # Prefill answered with a KV handle that no decode has consumed yet
    decode_worker: WorkerEndpoint | None = None
    decode_started: bool = False
    decode_call: grpc.aio.UnaryStreamCall | None = None
    finished: bool = False
    num_generated: int = 0
    num_cached: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class Orchestrator:
    def __init__(
        self,
        pool: WorkerPool,
        chooser: WorkerChooser,
        metrics: RouterMetrics,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 5.0,
        max_decode_attempts: int = 3,
    ) -> None:
        self.pool = pool
        self.chooser = chooser
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_decode_attempts = max_decode_attempts
        self._background = BackgroundTasks("orchestrator")  # Abort / ReleaseKV calls after a request

    @property
    def tracer(self) -> trace.Tracer:
        # Looked up per use: setup_tracing may run after the orchestrator is built.
        return get_tracer("pdmesh.router")

    # ---- the request ---------------------------------------------------------------------------------
    async def generate(self, g: Generation) -> AsyncIterator[Chunk]:
        """Yield the request's tokens. Raises ``RouterError``s; close the iterator to cancel the request."""
        arrival = time.monotonic()
        deadline = arrival + self.request_timeout_s
        st = _State()
        span = self.tracer.start_span(
            "generate",
            context=g.trace_context,
            kind=trace.SpanKind.SERVER,
            attributes={
                "pdmesh.request_id": g.request_id,
                "pdmesh.endpoint": g.endpoint,
                "pdmesh.prompt_tokens": len(g.prompt_token_ids),
            },
        )
        ctx = trace.set_span_in_context(span, g.trace_context)
        self.metrics.in_flight.inc()
        rr: RouteRequest | None = None
        try:
            rr = RouteRequest(g.request_id, g.prompt_token_ids, g.session_id, g.cache_salt, g.lora_name)
            prefill_worker, decode_worker = await self._route(rr, ctx)
            first: worker_pb2.PrefillResponse | None = None
            if prefill_worker is not None:
                first = await self._prefill(g, rr, prefill_worker, st, deadline, ctx)
                self.chooser.prefill_done(rr)
            if first is not None:
                chunk = Chunk(
                    [first.first_token_id],
                    prompt_logprobs=list(first.prompt_logprobs),
                    prefill_worker=st.prefill_worker.name,  # type: ignore[union-attr]
                )
                if first.HasField("first_token_logprobs"):
                    chunk.logprobs.append(first.first_token_logprobs)
                st.num_cached = first.num_cached_tokens
                self._count_tokens(st, 1)
                if first.finish_reason != FINISH_UNSPECIFIED:
                    chunk.finish_reason = first.finish_reason
                    chunk.usage = self._usage(g, st)
                    st.finished = True
                    self._finish_metrics(g, st, arrival)
                    yield chunk
                    return
                yield chunk
            async for chunk in self._decode(g, rr, first, st, deadline, ctx, decode_worker):
                if chunk.finished:
                    st.finished = True
                    self._finish_metrics(g, st, arrival)
                yield chunk
                if chunk.finished:
                    return
            raise UpstreamError("the decode stream ended without a finish reason")
        except RouterError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            span.set_attribute("pdmesh.error", type(exc).__name__)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            span.set_attribute("pdmesh.cancelled", True)
            raise
        finally:
            self.metrics.in_flight.dec()
            if rr is not None:
                self.chooser.prefill_done(rr)
            if st.decode_call is not None and not st.decode_call.done():
                st.decode_call.cancel()
            if not st.finished:
                self._background.spawn(self._cleanup(g.request_id, st), f"cleanup-{g.request_id}")
            span.end()

    # ---- steps ---------------------------------------------------------------------------------------
    async def _route(
        self, rr: RouteRequest, ctx: otel_context.Context
    ) -> tuple[WorkerEndpoint | None, WorkerEndpoint]:
        """The prefill worker (None when the decode worker prefills locally) and the decode worker."""
        with self.tracer.start_as_current_span("route", context=ctx) as span:
            started = time.perf_counter()
            decode_candidates = self.pool.candidates(DECODE, lora_name=rr.lora_name)
            if not decode_candidates:
                raise NoWorkerAvailableError(self.pool.describe_unusable(DECODE))
            decode = await self.chooser.choose(DECODE, rr, decode_candidates)
            self.metrics.decisions.labels(role=DECODE, reason=decode.reason).inc()
            prefill_candidates = self.pool.candidates(PREFILL, lora_name=rr.lora_name)
            local = await self.chooser.local_prefill(rr, prefill_candidates, decode.worker)
            self.metrics.decisions.labels(role="pd", reason=local.reason).inc()
            prefill: WorkerEndpoint | None = None
            if not local.prefill_on_decode:
                choice = await self.chooser.choose(PREFILL, rr, prefill_candidates)
                self.metrics.decisions.labels(role=PREFILL, reason=choice.reason).inc()
                span.set_attribute("pdmesh.prefill_worker", choice.worker.address)
                span.set_attribute("pdmesh.prefill_reason", choice.reason)
                prefill = choice.worker
            self.metrics.decision_latency.observe(time.perf_counter() - started)
            span.set_attribute("pdmesh.pd_reason", local.reason)
            span.set_attribute("pdmesh.decode_worker", decode.worker.address)
            return prefill, decode.worker

    async def _prefill(
        self,
        g: Generation,
        rr: RouteRequest,
        worker: WorkerEndpoint,
        st: _State,
        deadline: float,
        ctx: otel_context.Context,
    ) -> worker_pb2.PrefillResponse | None:
        """Prefill on ``worker``, then on the others in turn; None when every one failed."""
        tried: list[WorkerEndpoint] = []
        request = worker_pb2.PrefillRequest(
            request_id=g.request_id,
            prompt_token_ids=g.prompt_token_ids,
            sampling_params=g.sampling_params,
            cache_salt=g.cache_salt,
            lora_name=g.lora_name,
        )
        current: WorkerEndpoint | None = worker
        while current is not None:
            with self.tracer.start_as_current_span(
                "prefill",
                context=ctx,
                kind=trace.SpanKind.CLIENT,
                attributes={"pdmesh.worker": current.address},
            ) as span:
                st.prefill_worker = current
                n_prompt = len(g.prompt_token_ids)
                calling = current
                calling.begin_call(n_prompt)
                try:
                    response = await calling.stub.Prefill(
                        request, timeout=self._remaining(deadline), metadata=inject_metadata()
                    )
                except grpc.aio.AioRpcError as exc:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code().name))
                    self._worker_error(calling, "Prefill", exc)
                    if exc.code() not in RETRYABLE:
                        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            st.prefill_worker = None  # it refused the request: it holds nothing
                        raise from_worker_status(exc.code(), exc.details() or "", calling.address) from None
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        self._spawn_release(calling, g.request_id, abort=True)
                    tried.append(calling)
                    st.prefill_worker = None
                    current = await self._next(PREFILL, rr, tried)
                    continue
                finally:
                    calling.end_call(n_prompt)
                st.kv_held = response.finish_reason == FINISH_UNSPECIFIED
                span.set_attribute("pdmesh.num_cached_tokens", response.num_cached_tokens)
                return response
        self.metrics.decisions.labels(role="pd", reason=PREFILL_FAILED).inc()
        log.warning("request %s: every prefill worker failed; the decode worker prefills it", g.request_id)
        return None

    async def _decode(
        self,
        g: Generation,
        rr: RouteRequest,
        first: worker_pb2.PrefillResponse | None,
        st: _State,
        deadline: float,
        ctx: otel_context.Context,
        routed: WorkerEndpoint | None = None,
    ) -> AsyncIterator[Chunk]:
        request = worker_pb2.DecodeRequest(
            request_id=g.request_id,
            prompt_token_ids=g.prompt_token_ids,
            sampling_params=g.sampling_params,
            cache_salt=g.cache_salt,
            lora_name=g.lora_name,
        )
        if first is not None:
            request.kv_handle.CopyFrom(first.kv_handle)
            request.first_token_id = first.first_token_id
            if first.HasField("first_token_logprobs"):
                request.first_token_logprobs.CopyFrom(first.first_token_logprobs)
            request.num_cached_tokens = first.num_cached_tokens
        prefill_name = st.prefill_worker.name if (first is not None and st.prefill_worker) else ""
        # The token the client already has, when a retry prefills locally after the handle may be gone.
        replay_first: int | None = None
        tried: list[WorkerEndpoint] = []
        failures: list[str] = []
        candidates = self.pool.candidates(DECODE, lora_name=g.lora_name)
        if not candidates:
            raise self._release_and(
                st, g.request_id, NoWorkerAvailableError(self.pool.describe_unusable(DECODE))
            )
        worker: WorkerEndpoint | None = routed
        if worker is None or worker not in candidates:  # routed before a long prefill; gone since
            choice = await self.chooser.choose(DECODE, rr, candidates)
            self.metrics.decisions.labels(role=DECODE, reason=choice.reason).inc()
            worker = choice.worker
        n_prompt = len(g.prompt_token_ids)
        while worker is not None:
            st.decode_worker = worker
            st.decode_started = True
            delivered = False
            span = self.tracer.start_span(
                "decode",
                context=ctx,
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "pdmesh.worker": worker.address,
                    "pdmesh.kv_handle": request.HasField("kv_handle"),
                },
            )
            calling = worker
            calling.begin_call(n_prompt)
            try:
                call = worker.stub.Decode(
                    request,
                    timeout=self._remaining(deadline),
                    metadata=inject_metadata(trace.set_span_in_context(span, ctx)),
                )
                st.decode_call = call
                async for response in call:
                    if response.finish_reason == FINISH_ERROR:
                        raise UpstreamError(
                            f"decode worker {worker.address} reported an error for the request"
                        )
                    st.num_cached = max(
                        st.num_cached,
                        response.num_cached_tokens,
                        response.usage.cached_prompt_tokens if response.HasField("usage") else 0,
                    )
                    token_ids = list(response.token_ids)
                    logprobs = list(response.logprobs)
                    if replay_first is not None and token_ids:
                        if token_ids[0] != replay_first:
                            raise UpstreamError(
                                f"decode worker {worker.address} prefilled the request again after a failure "
                                f"and sampled another first token ({token_ids[0]} != {replay_first}); only "
                                "greedy or seeded sampling can be replayed"
                            )
                        token_ids, logprobs = token_ids[1:], logprobs[1:]  # the client has it already
                        replay_first = None
                    if not token_ids and response.finish_reason == FINISH_UNSPECIFIED:
                        continue
                    chunk = Chunk(
                        token_ids,
                        logprobs,
                        response.finish_reason,
                        # Only while the client has nothing: a replayed prefill's are sent already.
                        prompt_logprobs=list(response.prompt_logprobs) if not st.num_generated else [],
                        prefill_worker=prefill_name,
                        decode_worker=worker.name,
                    )
                    if token_ids:
                        if not delivered and not request.HasField("kv_handle"):
                            self.chooser.prefill_done(rr)  # this worker computed the prompt
                        delivered = True
                        st.kv_held = False
                        self._count_tokens(st, len(token_ids))
                    if chunk.finished:
                        st.kv_held = False
                        chunk.usage = self._usage(g, st)
                        span.end()
                    yield chunk
                    if chunk.finished:
                        return
                raise UpstreamError(
                    f"decode worker {worker.address} ended the stream without a finish reason"
                )
            except grpc.aio.AioRpcError as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.code().name))
                span.end()
                st.decode_call = None
                self._worker_error(worker, "Decode", exc)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    self._spawn_release(worker, g.request_id, abort=True)
                st.decode_worker = None  # told already (or unreachable): cleanup need not tell it again
                failures.append(f"{worker.address}: {exc.code().name}: {exc.details()}")
                retry = (
                    not delivered and exc.code() in RETRYABLE and len(tried) + 1 < self.max_decode_attempts
                )
                tried.append(worker)
                worker = await self._next(DECODE, rr, tried) if retry else None
                if worker is not None:
                    if request.HasField("kv_handle") and not _kv_untouched(exc):
                        # The failed worker may have read the blocks, and the prefill worker frees them
                        # when a read completes: never hand the handle out again. Prefill locally instead.
                        replay_first = request.first_token_id
                        for name in ("kv_handle", "first_token_id", "first_token_logprobs"):
                            request.ClearField(name)
                        request.num_cached_tokens = 0
                        self._release_prefill_kv(st, g.request_id)
                        log.info(
                            "request %s: decode retry prefills locally (the KV handle may be spent)",
                            g.request_id,
                        )
                    continue
                if delivered:
                    error: RouterError = UpstreamError(
                        f"decode worker {tried[-1].address} failed after streaming had begun "
                        f"({exc.code().name}: {exc.details()})",
                        grpc_code=exc.code(),
                    )
                elif exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    error = NoWorkerAvailableError(
                        f"no decode worker could take the request ({'; '.join(failures)})"
                    )
                else:
                    error = from_worker_status(exc.code(), exc.details() or "", tried[-1].address)
                raise self._release_and(st, g.request_id, error) from None
            except UpstreamError as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
                span.end()
                raise self._release_and(st, g.request_id, exc) from None
            finally:
                calling.end_call(n_prompt)
                if span.is_recording():
                    span.end()

    # ---- embeddings ----------------------------------------------------------------------------------
    async def embed(self, e: EmbedCall) -> worker_pb2.EmbedResponse:
        """One prompt's embedding (or class probabilities), from a prefill worker (its work is a prefill's), or a decode worker where
        no prefill worker can take it. A worker that fails with a status another may not (RETRYABLE) is
        replaced by the next best, each worker tried once; any other status is the request's error."""
        rr = RouteRequest(e.request_id, e.prompt_token_ids, None, e.cache_salt, e.lora_name)
        deadline = time.monotonic() + self.request_timeout_s
        tried: list[WorkerEndpoint] = []
        failures: list[str] = []
        n_prompt = len(e.prompt_token_ids)
        request = worker_pb2.EmbedRequest(
            request_id=e.request_id,
            prompt_token_ids=e.prompt_token_ids,
            cache_salt=e.cache_salt,
            lora_name=e.lora_name,
            pooling_type=e.pooling_type,
            dimensions=e.dimensions or 0,
            priority=e.priority,
            task=e.task,
        )
        if e.normalize is not None:
            request.normalize = e.normalize
        if e.activation is not None:
            request.activation = e.activation
        with self.tracer.start_as_current_span(
            "embed",
            context=e.trace_context,
            kind=trace.SpanKind.SERVER,
            attributes={"pdmesh.request_id": e.request_id, "pdmesh.prompt_tokens": n_prompt},
        ) as span:
            while True:
                role = PREFILL if self.pool.candidates(PREFILL, tried, e.lora_name) else DECODE
                candidates = self.pool.candidates(role, tried, e.lora_name)
                if not candidates:
                    detail = "; ".join(failures) or self.pool.describe_unusable(DECODE)
                    raise NoWorkerAvailableError(f"no worker could compute the embedding ({detail})")
                worker = (await self.chooser.choose(role, rr, candidates)).worker
                tried.append(worker)
                span.set_attribute("pdmesh.worker", worker.address)
                worker.begin_call(n_prompt)
                try:
                    return await worker.stub.Embed(
                        request, timeout=self._remaining(deadline), metadata=inject_metadata()
                    )
                except grpc.aio.AioRpcError as exc:
                    self._worker_error(worker, "Embed", exc)
                    if exc.code() not in RETRYABLE:
                        raise from_worker_status(exc.code(), exc.details() or "", worker.address) from None
                    failures.append(f"{worker.address}: {exc.code().name}: {exc.details()}")
                finally:
                    worker.end_call(n_prompt)
                    self.chooser.prefill_done(rr)

    # ---- helpers -------------------------------------------------------------------------------------
    async def _next(self, role: str, rr: RouteRequest, tried: list[WorkerEndpoint]) -> WorkerEndpoint | None:
        candidates = self.pool.candidates(role, exclude=tried, lora_name=rr.lora_name)
        if not candidates:
            return None
        choice = await self.chooser.choose(role, rr, candidates)
        self.metrics.retries.labels(role=role).inc()
        self.metrics.decisions.labels(role=role, reason="retry").inc()
        log.info("request %s: retrying %s on %s", rr.request_id, role, choice.worker.address)
        return choice.worker

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UpstreamTimeoutError(
                f"the request ran past the router's timeout of {self.request_timeout_s:g}s"
            )
        return left

    def _worker_error(self, worker: WorkerEndpoint, rpc: str, exc: grpc.aio.AioRpcError) -> None:
        self.metrics.worker_errors.labels(worker=worker.address, rpc=rpc, code=exc.code().name).inc()
        log.warning(
            "%s on %s worker %s failed: %s: %s",
            rpc,
            worker.role,
            worker.address,
            exc.code().name,
            exc.details(),
        )
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.pool.mark_down(worker, f"{rpc}: UNAVAILABLE: {exc.details()}")

    def _release_and(self, st: _State, request_id: str, error: RouterError) -> RouterError:
        """Free the prefill worker's blocks now (the decode will never read them); return ``error``."""
        self._release_prefill_kv(st, request_id)
        return error

    def _release_prefill_kv(self, st: _State, request_id: str) -> None:
        if st.kv_held and st.prefill_worker is not None:
            self._spawn_release(st.prefill_worker, request_id, abort=False)
            st.kv_held = False
            st.prefill_worker = None

    def _count_tokens(self, st: _State, n: int) -> None:
        now = time.monotonic()
        if st.first_token_at is None:
            st.first_token_at = now
        st.last_token_at = now
        st.num_generated += n

    def _usage(self, g: Generation, st: _State) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(g.prompt_token_ids),
            completion_tokens=st.num_generated,
            cached_prompt_tokens=st.num_cached,
        )

    def _finish_metrics(self, g: Generation, st: _State, arrival: float) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(g.prompt_token_ids))
        m.generated_tokens.inc(st.num_generated)
        m.prefix_hit_tokens.labels(tier="gpu").inc(st.num_cached)
        if st.first_token_at is not None:
            m.ttft.observe(st.first_token_at - arrival)
            m.e2e_latency.observe((st.last_token_at or st.first_token_at) - arrival)
            if st.num_generated > 1 and st.last_token_at is not None:
                m.tpot.observe((st.last_token_at - st.first_token_at) / (st.num_generated - 1))

    # ---- cleanup -------------------------------------------------------------------------------------
    def _spawn_release(self, worker: WorkerEndpoint, request_id: str, abort: bool) -> None:
        what = "abort" if abort else "release-kv"
        self._background.spawn(self._release(worker, request_id, abort=abort), f"{what}-{request_id}")

    async def _cleanup(self, request_id: str, st: _State) -> None:
        """The request ended early (client gone, error): tell every worker it touched to let go."""
        calls = []
        if st.decode_worker is not None:
            calls.append(self._release(st.decode_worker, request_id, abort=True))
        if st.prefill_worker is not None:
            calls.append(
                self._release(
                    st.prefill_worker, request_id, abort=True, release_kv=st.kv_held or not st.decode_started
                )
            )
        await asyncio.gather(*calls)

    async def _release(
        self, worker: WorkerEndpoint, request_id: str, abort: bool, release_kv: bool | None = None
    ) -> None:
        """Best effort: Abort and/or ReleaseKV on ``worker``; failures are logged and counted only."""
        worker.begin_call(0)  # keeps a worker that just left the pool reachable for these calls
        try:
            await self._release_calls(
                worker, request_id, abort, not abort if release_kv is None else release_kv
            )
        except grpc.aio.UsageError:  # it left the pool and its channel closed: it has nothing of ours
            log.debug(
                "request %s: %s worker %s is gone; nothing to release",
                request_id,
                worker.role,
                worker.address,
            )
        finally:
            worker.end_call(0)

    async def _release_calls(
        self, worker: WorkerEndpoint, request_id: str, abort: bool, release_kv: bool
    ) -> None:
        if release_kv and worker.role == PREFILL:
            try:
                await worker.stub.ReleaseKV(
                    worker_pb2.ReleaseKVRequest(request_id=request_id),
                    timeout=self.control_timeout_s,
                    metadata=inject_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                self._worker_error(worker, "ReleaseKV", exc)
        if abort:
            try:
                await worker.stub.Abort(
                    worker_pb2.AbortRequest(request_id=request_id),
                    timeout=self.control_timeout_s,
                    metadata=inject_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                self._worker_error(worker, "Abort", exc)

    async def drain_background(self, timeout: float = 5.0) -> None:
        """Give pending cleanup calls up to ``timeout`` seconds, then cancel the rest (shutdown, tests)."""
        await self._background.close(grace_s=timeout)
