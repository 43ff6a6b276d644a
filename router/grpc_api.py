"""The public gRPC API: ``pdmesh.v1.Router`` (``Generate``, ``Embed``, ``ListModels``).

``Generate`` applies the same checks as the HTTP API (``router.served_model``) and streams one
``GenerateResponse`` per orchestrator chunk; errors are gRPC statuses (INVALID_ARGUMENT, NOT_FOUND,
UNAVAILABLE, DEADLINE_EXCEEDED...). A cancelled call cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine.pooling import top_label
from mesh.grpc_server import abort_with
from mesh.telemetry import extract_context
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.embeddings import check_input, need_classifier
from router.errors import InvalidRequestError, RouterError
from router.metrics import RouterMetrics
from router.orchestrator import EmbedCall, Generation, Orchestrator
from router.served_model import COMPLETIONS_DEFAULT_MAX_TOKENS, ServedModel, sampling_input_from_proto
from router.worker_pool import DECODE, PREFILL, WorkerPool

log = logging.getLogger(__name__)

ENDPOINT = "grpc_generate"


async def prompt_ids(
    model: ServedModel,
    request: router_pb2.GenerateRequest | router_pb2.EmbeddingRequest | router_pb2.ClassificationRequest,
) -> list[int]:
    """A request's ``prompt`` oneof as token ids: ``text`` tokenized, ``token_ids`` as given."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return await model.tokenize(request.text)
    if which == "token_ids":
        return list(request.token_ids.ids)
    raise InvalidRequestError(
        f"{type(request).__name__} needs a prompt: set text or token_ids", param="prompt"
    )


async def build_generation(
    model: ServedModel, request: router_pb2.GenerateRequest, metadata: object
) -> Generation:
    lora_name = model.check_model(request.model, request.lora_name) or ""
    ids = await prompt_ids(model, request)
    model.check_prompt(ids)
    s = sampling_input_from_proto(request.sampling_params)
    max_tokens = model.resolve_max_tokens(s.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
    sampling = model.sampling_params(s, max_tokens)
    return Generation(
        request_id=request.request_id or f"gen-{uuid.uuid4().hex}",
        prompt_token_ids=ids,
        sampling_params=sampling,
        endpoint=ENDPOINT,
        session_id=request.session_id or None,
        cache_salt=request.cache_salt,
        lora_name=lora_name,
        trace_context=extract_context(metadata),  # type: ignore[arg-type]
    )


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self, model: ServedModel, orchestrator: Orchestrator, pool: WorkerPool, metrics: RouterMetrics
    ) -> None:
        self.model = model
        self.orchestrator = orchestrator
        self.pool = pool
        self.metrics = metrics

    async def Generate(  # noqa: N802 (generated name)
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        status = "ok"
        try:
            try:
                gen = await build_generation(self.model, request, context.invocation_metadata())
                sp = gen.sampling_params
                text = (
                    self.model.text_stream(
                        list(sp.stop),
                        sp.skip_special_tokens,
                        sp.include_stop_str_in_output,
                        list(sp.stop_token_ids),
                        sp.ignore_eos,
                    )
                    if request.return_text
                    else None
                )
                async with contextlib.aclosing(self.orchestrator.generate(gen)) as chunks:
                    async for chunk in chunks:
                        out = router_pb2.GenerateResponse(
                            request_id=gen.request_id,
                            token_ids=chunk.token_ids,
                            logprobs=chunk.logprobs,
                            prompt_logprobs=chunk.prompt_logprobs,
                            finish_reason=chunk.finish_reason,
                            prefill_worker=chunk.prefill_worker,
                            decode_worker=chunk.decode_worker,
                        )
                        if text is not None:
                            stopped = chunk.finish_reason == common_pb2.FINISH_REASON_STOP
                            out.text = text.add(chunk.token_ids, stopped) + (
                                text.finish() if chunk.finished else ""
                            )
                        if chunk.usage is not None:
                            out.usage.CopyFrom(chunk.usage)
                        yield out
            except RouterError as exc:
                status = exc.metric_status
                await abort_with(context, exc.grpc_code, exc.message)
            except Exception as exc:  # a bug: answer INTERNAL with its name rather than UNKNOWN
                status = "error"
                log.exception("internal error serving Generate")
                await abort_with(
                    context, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
                )
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(endpoint=ENDPOINT, status=status).inc()

    async def Embed(  # noqa: N802 (generated name)
        self, request: router_pb2.EmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.EmbeddingResponse:
        """One prompt's embedding (``Orchestrator.embed``), checked as ``/v1/embeddings`` checks it."""

        async def run() -> router_pb2.EmbeddingResponse:
            lora_name = self.model.check_model(request.model, request.lora_name) or ""
            ids = await self._pooled_prompt(request)
            call = EmbedCall(
                request_id=request.request_id or f"embd-{uuid.uuid4().hex}",
                prompt_token_ids=ids,
                pooling_type=request.pooling_type,
                normalize=request.normalize if request.HasField("normalize") else None,
                dimensions=request.dimensions or None,
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_name=lora_name,
                trace_context=extract_context(context.invocation_metadata()),  # type: ignore[arg-type]
            )
            reply = await self.orchestrator.embed(call)
            return router_pb2.EmbeddingResponse(
                request_id=call.request_id,
                embedding=reply.embedding,
                usage=common_pb2.Usage(prompt_tokens=len(ids), cached_prompt_tokens=reply.num_cached_tokens),
            )

        return await self._pooling(context, "Embed", run)

    async def Classify(  # noqa: N802 (generated name)
        self, request: router_pb2.ClassificationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ClassificationResponse:
        """One prompt's class probabilities by a sequence classifier, checked as ``/classify`` checks it;
        with ``text_pair``, the pair as one prompt (a cross-encoder's relevance, as ``/score``)."""

        async def run() -> router_pb2.ClassificationResponse:
            lora_name = self.model.check_model(request.model, request.lora_name) or ""
            need_classifier(self.model, "Classify")
            if request.text_pair and request.WhichOneof("prompt") != "text":
                raise InvalidRequestError("text_pair needs a text prompt", param="text_pair")
            if request.text_pair:
                ids = await self.model.tokenize_pair(request.text, request.text_pair)
                check_input(self.model, ids)
            else:
                ids = await self._pooled_prompt(request)
            call = EmbedCall(
                request_id=request.request_id or f"classify-{uuid.uuid4().hex}",
                prompt_token_ids=ids,
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_name=lora_name,
                trace_context=extract_context(context.invocation_metadata()),  # type: ignore[arg-type]
                task="classify",
                activation=request.activation if request.HasField("activation") else None,
            )
            reply = await self.orchestrator.embed(call)
            probs = list(reply.embedding)
            return router_pb2.ClassificationResponse(
                request_id=call.request_id,
                probs=probs,
                label=top_label(self.model.config.labels, probs),
                usage=common_pb2.Usage(prompt_tokens=len(ids), cached_prompt_tokens=reply.num_cached_tokens),
            )

        return await self._pooling(context, "Classify", run)

    async def _pooled_prompt(
        self, request: router_pb2.EmbeddingRequest | router_pb2.ClassificationRequest
    ) -> list[int]:
        if request.WhichOneof("prompt") == "text" and not request.text:
            raise InvalidRequestError("the prompt is an empty string", param="text")
        ids = await prompt_ids(self.model, request)
        check_input(self.model, ids)
        return ids

    async def _pooling(self, context: grpc.aio.ServicerContext, method: str, run: Any) -> Any:
        """``run()``'s reply; its errors as gRPC statuses, counted under ``grpc_<method>``."""
        status = "ok"
        try:
            return await run()
        except RouterError as exc:
            status = exc.metric_status
            await abort_with(context, exc.grpc_code, exc.message)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "error"
            log.exception("internal error serving %s", method)
            await abort_with(
                context, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            )
        finally:
            self.metrics.requests.labels(endpoint=f"grpc_{method.lower()}", status=status).inc()

    async def ListModels(  # noqa: N802 (generated name)
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        """The base model under each of its names, then each LoRA adapter (parent: the base model), as
        the HTTP API's /v1/models lists them."""

        def info(name: str, parent: str = "", root: str = "") -> router_pb2.ModelInfo:
            return router_pb2.ModelInfo(
                id=name,
                model_fingerprint=self.pool.model_fingerprint or "",
                max_model_len=self.model.max_model_len,
                block_size=self.pool.block_size,
                num_prefill_workers=len(self.pool.usable(PREFILL)),
                num_decode_workers=len(self.pool.usable(DECODE)),
                parent=parent,
                root=root,
            )

        infos = [info(name) for name in self.model.names]
        infos += [info(name, self.model.name, path) for name, path in self.model.lora_adapters().items()]
        return router_pb2.ListModelsResponse(models=infos)
