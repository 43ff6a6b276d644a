"""What the HTTP front ends answer with, shared by ``router.http_api`` and ``router.responses_http``: the
OpenAI error reply, one server-sent event and the headers of a stream of them, and the error a stream that
already began ends with. No routes and no request handling here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from router.errors import RouterError

log = logging.getLogger("router.http_api")  # the logger these lines were always written under

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def error_response(exc: RouterError) -> web.Response:
    return web.json_response(exc.to_openai(), status=exc.http_status)


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; the Responses API names each (``event: response.output_text.delta``)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def failed_mid_stream(exc: Exception, request_id: str, outcome: dict[str, str]) -> RouterError:
    """The error a stream that already began ends with (logged, and counted in ``outcome``)."""
    if isinstance(exc, RouterError):
        log.warning("request %s failed mid-stream: %s", request_id, exc.message)
        error = exc
    else:
        log.exception("request %s failed mid-stream", request_id)
        error = RouterError(f"internal error: {type(exc).__name__}")
    outcome["status"] = error.metric_status
    return error
