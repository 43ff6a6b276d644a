"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, the Responses API (its run and
stored responses in ``router.responses_http``; every route is added here), models, tokenize, detokenize,
health, metrics, and vLLM's and SageMaker's extra endpoints (``/version``, ``/reset_prefix_cache``,
``/ping``, ``/invocations``).

Each generation handler parses (``router.openai_protocol``), checks (``router.served_model``), runs the
request's choices through the orchestrator (``router.choices``) and renders their chunks as one JSON reply
or as server-sent events. A
streaming reply starts only once the first token is there, so errors found before it (bad request, no
worker) still get a proper status code and the OpenAI error shape; errors after it become one SSE error
event, then the stream closes. A client that disconnects cancels the handler (``handler_cancellation``),
which cancels the request on the workers; a background response (``router.background_responses``) runs
in a task of its own, which the handler (``router.responses_http``) only listens to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from mesh.telemetry import metrics_handler
from protos.pdmesh.v1 import worker_pb2
from router.auth import ApiKeys, http_middleware
from router.choices import ChoiceRequest, build_choices, merged_chunks
from router.cors import CorsPolicy
from router.embeddings import serve_classify, serve_embeddings, serve_pooling, serve_rerank, serve_score
from router.errors import InvalidRequestError, NotFoundError, RouterError
from router.http_replies import SSE_HEADERS, error_response, failed_mid_stream, sse
from router.lora_updates import LoRAUpdates
from router.metrics import RouterMetrics
from router.openai_protocol import (
    JsonFields,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from router.orchestrator import Orchestrator
from router.reply_writer import ReplyWriter
from router.response_store import ResponseStore
from router.responses_http import ResponsesHttp
from router.served_model import ServedModel
from router.text_stream import token_text
from router.worker_pool import DECODE, WorkerPool

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


class HttpApi:
    def __init__(
        self,
        model: ServedModel,
        orchestrator: Orchestrator,
        pool: WorkerPool,
        metrics: RouterMetrics,
        api_keys: ApiKeys | None = None,
        cors: CorsPolicy | None = None,
        response_store: ResponseStore | None = None,
        runtime_lora_updating: bool = False,
    ) -> None:
        self.model = model
        self.orchestrator = orchestrator
        self.pool = pool
        self.metrics = metrics
        self.api_keys = api_keys or ApiKeys(())
        self.cors = cors
        self.responses_http = ResponsesHttp(model, orchestrator, metrics, response_store)
        self.runtime_lora_updating = runtime_lora_updating  # /v1/load_lora_adapter and unload served
        self.lora_updates = LoRAUpdates(pool, model.names, pool.control_timeout_s)
        self.created = int(time.time())

    def app(self) -> web.Application:
        middlewares = [http_middleware(self.api_keys)] if self.api_keys else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        if self.cors is not None:
            self.cors.install(app)  # its preflights come before the key check
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/embeddings", self.embeddings)
        for path in ("/classify", "/v1/classify"):
            app.router.add_post(path, self.classify)
        app.router.add_post("/pooling", self.pooling)
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        stored = self.responses_http  # stored responses (router.responses_http)
        app.router.add_get("/v1/responses/{response_id}", stored.get_response)
        app.router.add_delete("/v1/responses/{response_id}", stored.delete_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", stored.response_input_items)
        app.router.add_post("/v1/responses/{response_id}/cancel", stored.cancel_response)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_card)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/ping", self.ping)
        app.router.add_post("/invocations", self.invocations)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/metrics", metrics_handler(self.metrics.registry))
        app.on_shutdown.append(self.responses_http.close)  # the runner's cleanup: before handlers are awaited
        return app

    # ---- simple endpoints ----------------------------------------------------------------------------
    def _card(self, name: str, root: str | None = None, parent: str | None = None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdmesh",
            "root": root or self.model.name,
            "parent": parent,
            "max_model_len": self.model.max_model_len,
        }

    def _cards(self) -> list[dict[str, Any]]:
        """The base model under each of its names, then each LoRA adapter the workers serve (vLLM's
        cards: root its directory, parent the base model)."""
        cards = [self._card(name) for name in self.model.names]
        adapters = self.model.lora_adapters()
        cards += [self._card(name, path, self.model.name) for name, path in adapters.items()]
        return cards

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._cards()})

    async def model_card(self, request: web.Request) -> web.Response:
        """OpenAI's model retrieval: a served model's or adapter's card, or a 404 for another name."""
        name = request.match_info["model"]
        try:
            self.model.check_model(name)
        except RouterError as exc:
            return error_response(exc)
        return web.json_response(next((c for c in self._cards() if c["id"] == name), self._card(name)))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/load_lora_adapter``: ``{"lora_name", "lora_path"}`` loaded on every worker."""
        try:
            f = self._lora_update_fields(await request.read())
            name = f.str("lora_name") or ""
            await self.lora_updates.load(name, f.str("lora_path") or "")
        except RouterError as exc:
            return error_response(exc)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/unload_lora_adapter``: ``{"lora_name"}`` unloaded from every worker."""
        try:
            f = self._lora_update_fields(await request.read())
            name = f.str("lora_name") or ""
            await self.lora_updates.unload(name)
        except RouterError as exc:
            return error_response(exc)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _lora_update_fields(self, raw: bytes) -> JsonFields:
        if not self.runtime_lora_updating:
            raise NotFoundError(
                "Loading and unloading LoRA adapters at run time is off: start the router with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"
            )
        return JsonFields(parse_json_body(raw))

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's ``/version``: this package's version."""
        return web.json_response({"version": importlib.metadata.version("pdmesh")})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a completions ``prompt`` (text) or chat ``messages`` (rendered with the
        chat template) to token ids, with the same options as generation."""
        try:
            body = parse_json_body(await request.read())
            f = JsonFields(body)
            self.model.check_model(f.str("model"))
            if "messages" in body:
                parsed = parse_chat(body, request.headers, self.model.tool_call_parser)
                ids = await self.model.tokenize_chat(
                    parsed.messages,
                    parsed.add_generation_prompt,
                    parsed.add_special_tokens,
                    parsed.template_kwargs,
                    parsed.continue_final_message,
                )
            else:
                prompt = f.str("prompt")
                if prompt is None:
                    raise InvalidRequestError("'prompt' (a string) or 'messages' is required", param="prompt")
                ids = await self.model.tokenize(prompt, f.bool("add_special_tokens", True))
            strs = (
                [token_text(self.model.tokenizer, t) for t in ids]
                if f.bool("return_token_strs", False)
                else None
            )
            return web.json_response(
                {
                    "count": len(ids),
                    "max_model_len": self.model.max_model_len,
                    "tokens": ids,
                    "token_strs": strs,
                }
            )
        except RouterError as exc:
            return error_response(exc)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: token ids to text (special tokens kept)."""
        try:
            body = parse_json_body(await request.read())
            f = JsonFields(body)
            self.model.check_model(f.str("model"))
            if body.get("tokens") is None:
                raise InvalidRequestError("'tokens' is required", param="tokens")
            ids = f.int_list("tokens")
            self.model.check_token_ids(ids, "token ids", "tokens")
            text = self.model.tokenizer.decode(ids, skip_special_tokens=False)
            return web.json_response({"prompt": text})
        except RouterError as exc:
            return error_response(exc)

    async def health(self, request: web.Request) -> web.Response:
        workers = {
            w.address: {
                "role": w.role,
                "health": w.health.value,
                "usable": w.usable,
                **({"error": w.last_error} if w.last_error else {}),
            }
            for w in self.pool.workers
        }
        if self.pool.usable(DECODE):
            return web.json_response({"status": "ok", "workers": workers})
        return web.json_response(
            {"status": "unavailable", "detail": self.pool.describe_unusable(DECODE), "workers": workers},
            status=503,
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``/reset_prefix_cache``, for the whole mesh: every worker evicts the cached prefix blocks
        no request holds (benchmarks that must start cold). 200 with each worker's evicted block count when
        all of them did it; 502 naming those that could not."""

        async def reset(worker: Any) -> tuple[str, int | str]:
            try:
                reply = await worker.stub.ResetPrefixCache(
                    worker_pb2.ResetPrefixCacheRequest(), timeout=self.pool.control_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                return worker.address, f"{exc.code().name}: {exc.details()}"
            return worker.address, reply.num_evicted_blocks

        results = dict(await asyncio.gather(*(reset(w) for w in self.pool.workers)))
        failed = {a: r for a, r in results.items() if isinstance(r, str)}
        evicted = {a: r for a, r in results.items() if not isinstance(r, str)}
        body: dict[str, Any] = {"evicted_blocks": evicted}
        if failed:
            body["errors"] = failed
        return web.json_response(body, status=502 if failed else 200)

    async def ping(self, request: web.Request) -> web.Response:
        """SageMaker's liveness probe (vLLM serves it too): ``/health``'s answer, GET or POST."""
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        return await self.health(request)

    # ---- generation ----------------------------------------------------------------------------------
    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's ``/invocations`` (vLLM serves it too): the body's shape names the API, ``messages``
        chat, ``prompt`` completions, ``input`` the Responses API."""
        try:
            body = parse_json_body(await request.read())  # aiohttp keeps the body for _generate's read
        except RouterError as exc:
            return error_response(exc)
        for field_name, kind in (
            ("messages", "chat_completions"),
            ("prompt", "completions"),
            ("input", "responses"),
        ):
            if field_name in body:
                return await self._generate(request, kind)
        return error_response(
            InvalidRequestError(
                "/invocations needs 'messages' (a chat completion), 'prompt' (a completion) or 'input' "
                "(a response)"
            )
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's ``/v1/embeddings`` (``router.embeddings``)."""
        return await self._pooling(request, "embeddings", serve_embeddings)

    async def pooling(self, request: web.Request) -> web.Response:
        """vLLM's ``/pooling``: each input's pooled output (``router.embeddings``)."""
        return await self._pooling(request, "pooling", serve_pooling)

    async def classify(self, request: web.Request) -> web.Response:
        """vLLM's ``/classify``: a sequence classifier's class probabilities (``router.embeddings``)."""
        return await self._pooling(request, "classify", serve_classify)

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's ``/score``: a cross-encoder's relevance, or the cosine similarity of embeddings
        (``router.embeddings``)."""
        return await self._pooling(request, "score", serve_score)

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's ``/rerank`` (Jina's and Cohere's API): documents by relevance to a query."""
        return await self._pooling(request, "rerank", serve_rerank)

    async def _pooling(self, request: web.Request, endpoint: str, serve: Any) -> web.Response:
        status = "ok"
        try:
            return await serve(request, self.model, self.orchestrator)
        except RouterError as exc:
            status = exc.metric_status
            return error_response(exc)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "error"
            log.exception("internal error serving %s", endpoint)
            return error_response(RouterError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=status).inc()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: the request run as a chat request (router.responses)."""
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        outcome = {"status": "ok"}  # _stream overwrites it when a request fails after streaming began
        try:
            body = parse_json_body(await request.read())
            responses = None
            if kind == "completions":
                parsed = parse_completion(body, request.headers)
            elif kind == "responses":
                responses = await self.responses_http.parse(body)
                parsed = parse_chat(responses.chat_body, request.headers, self.model.tool_call_parser)
            else:
                parsed = parse_chat(body, request.headers, self.model.tool_call_parser)
            spec = parsed.sampling.structured_outputs
            if kind != "completions" and spec is not None and self.model.think_tokens is not None:
                # With a reasoning parser the constraint holds the reply after its thinking (vLLM's rule).
                parsed.sampling.structured_outputs = dataclasses.replace(
                    spec, reasoning=self.model.think_tokens
                )
            prefix = {"completions": "cmpl-", "chat_completions": "chatcmpl-", "responses": "resp_"}[kind]
            request_id = parsed.request_id or f"{prefix}{uuid.uuid4().hex}"
            choices = await build_choices(self.model, parsed, request_id, request.headers)
            writer = ReplyWriter(self.model, parsed, request_id, "completions" if kind == "completions" else
                             "chat_completions", choices)  # fmt: skip
            if responses is not None:
                return await self.responses_http.respond(request, body, responses, choices, writer, outcome)
            if parsed.stream:
                return await self._stream(request, choices, writer, outcome)
            return await self._complete(choices, writer)
        except RouterError as exc:
            outcome["status"] = exc.metric_status
            return error_response(exc)
        except ConnectionResetError as exc:  # the client went away while we wrote to it
            outcome["status"] = "cancelled"
            log.info("client of a %s request went away: %s", kind, exc)
            return web.Response(status=499)
        except asyncio.CancelledError:  # the client disconnected (handler cancellation)
            outcome["status"] = "cancelled"
            raise
        except Exception as exc:
            outcome["status"] = "error"
            log.exception("internal error serving %s", kind)
            return error_response(RouterError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self.metrics.requests.labels(endpoint=kind, status=outcome["status"]).inc()

    async def _complete(self, choices: list[ChoiceRequest], writer: ReplyWriter) -> web.Response:
        async with contextlib.aclosing(merged_chunks(self.orchestrator, choices)) as chunks:
            async for index, chunk in chunks:
                writer.add(index, chunk)
        return web.json_response(writer.full_response())

    async def _stream(
        self,
        request: web.Request,
        choices: list[ChoiceRequest],
        writer: ReplyWriter,
        outcome: dict[str, str],
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        async with contextlib.aclosing(merged_chunks(self.orchestrator, choices)) as chunks:
            try:
                async for index, chunk in chunks:
                    events = writer.add(index, chunk)
                    if response is None:
                        response = web.StreamResponse(headers=SSE_HEADERS)
                        await response.prepare(request)
                        events = writer.opening() + events
                    for event in events:
                        await response.write(sse(event))
            except ConnectionResetError:
                raise  # the client is gone: nothing more can be written
            except Exception as exc:
                if response is None:
                    raise  # nothing streamed yet: _generate answers with a status code
                error = failed_mid_stream(exc, writer.request_id, outcome)
                await response.write(sse(error.to_openai()))
                await response.write_eof()
                return response
        assert response is not None  # the orchestrator always yields a finished chunk or raises
        if writer.parsed.include_usage:
            await response.write(sse(writer.usage_chunk()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
