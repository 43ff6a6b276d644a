"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models, health, metrics.

Each generation handler parses (``router.openai_protocol``), checks (``router.served_model``), runs the
request through the orchestrator and renders its chunks as one JSON reply or as server-sent events. A
streaming reply starts only once the first token is there, so errors found before it (bad request, no
worker) still get a proper status code and the OpenAI error shape; errors after it become one SSE error
event, then the stream closes. A client that disconnects cancels the handler (``handler_cancellation``),
which cancels the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from mesh.telemetry import extract_context, metrics_handler
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.openai_protocol import (
    FINISH_REASONS,
    CompletionLogprobs,
    ParsedRequest,
    chat_logprobs,
    parse_chat,
    parse_completion,
    parse_json_body,
    usage_json,
)
from router.orchestrator import Chunk, Generation, Orchestrator
from router.served_model import COMPLETIONS_DEFAULT_MAX_TOKENS, ServedModel
from router.text_stream import TextStream
from router.worker_pool import DECODE, WorkerPool

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def error_response(exc: RouterError) -> web.Response:
    return web.json_response(exc.to_openai(), status=exc.http_status)


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def build_generation(
    model: ServedModel, parsed: ParsedRequest, request_id: str, headers: Any
) -> Generation:
    """Model check, chat rendering, tokenization (off the event loop), length and sampling checks: a
    request workers accept."""
    model.check_model(parsed.model)
    if parsed.prompt_token_ids is not None:
        ids = parsed.prompt_token_ids
    elif parsed.kind == "chat_completions":
        ids = await model.tokenize_chat(
            parsed.messages, parsed.add_generation_prompt, parsed.add_special_tokens
        )
    else:
        ids = await model.tokenize(parsed.prompt_text or "", parsed.add_special_tokens)
    param = "messages" if parsed.kind == "chat_completions" else "prompt"
    model.check_prompt(ids, param=param)
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if parsed.kind == "completions" else None
    max_tokens = model.resolve_max_tokens(parsed.sampling.max_tokens, len(ids), default)
    sampling = model.sampling_params(parsed.sampling, max_tokens)
    carrier = [(k.lower(), v) for k, v in headers.items()]
    return Generation(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=sampling,
        endpoint=parsed.kind,
        session_id=parsed.session_id,
        cache_salt=parsed.cache_salt,
        trace_context=extract_context(carrier),
    )


class HttpApi:
    def __init__(
        self, model: ServedModel, orchestrator: Orchestrator, pool: WorkerPool, metrics: RouterMetrics
    ) -> None:
        self.model = model
        self.orchestrator = orchestrator
        self.pool = pool
        self.metrics = metrics
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", metrics_handler(self.metrics.registry))
        return app

    # ---- simple endpoints ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "pdmesh",
                        "root": self.model.name,
                        "parent": None,
                        "max_model_len": self.model.max_model_len,
                    }
                ],
            }
        )

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

    # ---- generation ----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        outcome = {"status": "ok"}  # _stream overwrites it when a request fails after streaming began
        try:
            body = parse_json_body(await request.read())
            parsed = (parse_completion if kind == "completions" else parse_chat)(body, request.headers)
            prefix = "cmpl" if kind == "completions" else "chatcmpl"
            request_id = parsed.request_id or f"{prefix}-{uuid.uuid4().hex}"
            gen = await build_generation(self.model, parsed, request_id, request.headers)
            writer = _Writer(self.model, parsed, request_id, kind)
            if parsed.stream:
                return await self._stream(request, gen, writer, outcome)
            return await self._complete(gen, writer)
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

    async def _complete(self, gen: Generation, writer: _Writer) -> web.Response:
        async with contextlib.aclosing(self.orchestrator.generate(gen)) as chunks:
            async for chunk in chunks:
                writer.add(chunk)
        return web.json_response(writer.full_response())

    async def _stream(
        self, request: web.Request, gen: Generation, writer: _Writer, outcome: dict[str, str]
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        async with contextlib.aclosing(self.orchestrator.generate(gen)) as chunks:
            try:
                async for chunk in chunks:
                    events = writer.add(chunk)
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
                error = (
                    exc
                    if isinstance(exc, RouterError)
                    else RouterError(f"internal error: {type(exc).__name__}")
                )
                if isinstance(exc, RouterError):
                    log.warning("request %s failed mid-stream: %s", gen.request_id, exc.message)
                else:
                    log.exception("request %s failed mid-stream", gen.request_id)
                outcome["status"] = error.metric_status
                await response.write(sse(error.to_openai()))
                await response.write_eof()
                return response
        assert response is not None  # the orchestrator always yields a finished chunk or raises
        if writer.parsed.include_usage:
            await response.write(sse(writer.usage_chunk()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Writer:
    """Turns a request's chunks into OpenAI JSON: stream events as they come, or one reply at the end."""

    def __init__(self, model: ServedModel, parsed: ParsedRequest, request_id: str, kind: str) -> None:
        self.model = model
        self.parsed = parsed
        self.request_id = request_id
        self.kind = kind
        self.created = int(time.time())
        sp = parsed.sampling
        self.text = TextStream(model.tokenizer, sp.stop, sp.skip_special_tokens)
        self.last_token_id: int | None = None  # for the stop reason of a stop token
        self.want_logprobs = sp.logprobs is not None
        self.completion_logprobs = CompletionLogprobs(model.tokenizer)
        self.logprob_parts: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.usage: dict[str, Any] | None = None
        self.stop_token_ids = set(sp.stop_token_ids)

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "completions" else "chat.completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object_name + (".chunk" if chunk else ""),
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """Take one chunk; return the stream events it makes (ignored when not streaming)."""
        if chunk.token_ids:
            self.last_token_id = chunk.token_ids[-1]
        delta = self.text.add(chunk.token_ids)
        logprobs: Any = None
        if self.want_logprobs and chunk.logprobs:
            logprobs = (
                self.completion_logprobs.part(chunk.logprobs)
                if self.kind == "completions"
                else chat_logprobs(self.model.tokenizer, chunk.logprobs)
            )
            self.logprob_parts.append(logprobs)
        if chunk.finished:
            delta += self.text.finish()
            self.finish_reason = FINISH_REASONS.get(chunk.finish_reason, "stop")
            self.stop_reason = self._stop_reason()
            if chunk.usage is not None:
                self.usage = usage_json(chunk.usage)
        if not delta and logprobs is None and not chunk.finished:
            return []
        return [self._envelope([self._choice(delta, logprobs, stream=True)], chunk=True)]

    def _stop_reason(self) -> str | int | None:
        if self.finish_reason != "stop":
            return None
        if self.text.stopped_on is not None:
            return self.text.stopped_on
        if self.last_token_id in self.stop_token_ids:
            return self.last_token_id
        return None

    def _choice(self, text: str, logprobs: Any, stream: bool) -> dict[str, Any]:
        finish = self.finish_reason
        if self.kind == "completions":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs}
        else:
            key = "delta" if stream else "message"
            body: dict[str, Any] = {"content": text} if stream else {"role": "assistant", "content": text}
            choice = {
                "index": 0,
                key: body,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
            }
        choice["finish_reason"] = finish
        choice["stop_reason"] = self.stop_reason if finish is not None else None
        return choice

    def opening(self) -> list[dict[str, Any]]:
        """Events sent before the first tokens' (chat: the assistant role)."""
        if self.kind == "completions":
            return []
        return [
            self._envelope(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                chunk=True,
            )
        ]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": self.usage}

    def full_response(self) -> dict[str, Any]:
        logprobs: Any = None
        if self.want_logprobs:
            if self.kind == "completions":
                logprobs = CompletionLogprobs.merge(self.logprob_parts)
            else:
                logprobs = [entry for part in self.logprob_parts for entry in part]
        return {
            **self._envelope([self._choice(self.text.text, logprobs, stream=False)], chunk=False),
            "usage": self.usage,
        }
