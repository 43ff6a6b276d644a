"""API keys on the router's public APIs (vLLM's ``--api-key``): with keys set, a request must carry
``Authorization: Bearer <key>`` with one of them.

HTTP: every path under ``/v1`` (the OpenAI API) is checked, as vLLM does, and ``/invocations``,
``/classify``, ``/pooling``, ``/score``, ``/rerank`` and ``/v2/rerank`` (they run the model as ``/v1`` does; vLLM leaves them open) and
``/reset_prefix_cache`` (it changes every worker); ``/health``, ``/ping``, ``/metrics``, ``/version``, ``/tokenize`` and
``/detokenize`` stay open for probes and scrapers. A refused request is a
401 in OpenAI's error shape. gRPC: every method of ``pdmesh.v1.Router`` is checked (``authorization``
metadata); health checking and reflection stay open. A refused call ends UNAUTHENTICATED.

Keys are compared as SHA-256 digests in constant time, so neither the time taken nor a log line tells
how much of a key was right. Nothing here knows the requests themselves.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from aiohttp import web

ROUTER_METHODS = "/pdmesh.v1.Router/"  # the gRPC methods that need a key
# HTTP paths outside /v1 that need a key: they run the model, or change every worker.
GUARDED_PATHS = (
    "/invocations",
    "/classify",
    "/pooling",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/reset_prefix_cache",
)
REFUSED = "a valid API key is required: send 'Authorization: Bearer <key>'"


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(f"Bearer {k.strip()}".encode()).digest() for k in keys if k.strip()]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value carries one of the keys (always, with none set)."""
        if not self._digests:
            return True
        digest = hashlib.sha256((authorization or "").strip().encode()).digest()
        found = False
        for key in self._digests:  # every key compared: the time does not say which matched
            found |= hmac.compare_digest(digest, key)
        return found


def http_middleware(keys: ApiKeys) -> Callable[..., Awaitable[web.StreamResponse]]:
    """An aiohttp middleware that refuses ``/v1`` requests without a key (CORS preflights pass)."""

    @web.middleware
    async def check_api_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = request.path
        guarded = path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS
        if guarded and request.method != "OPTIONS" and not keys.allows(request.headers.get("Authorization")):
            return web.json_response(
                {
                    "error": {
                        "message": REFUSED,
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },  # fmt: skip
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check_api_key


class GrpcApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses ``pdmesh.v1.Router`` calls whose ``authorization`` metadata carries no key."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(ROUTER_METHODS):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._keys.allows(metadata.get("authorization")):
            return handler
        return _refusing(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(_refuse, **codec)
