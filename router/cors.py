"""Cross-origin requests on the router's HTTP API (CORS), as vLLM's ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` and ``--allow-credentials`` configure them: a web page on
another origin may call the OpenAI API from a browser.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered here, before any route or
API key check; every other response to a request with an allowed ``Origin`` gets the
``Access-Control-Allow-*`` headers just before its headers go out (streams included). An origin that is
not allowed gets no CORS header (its browser then refuses the reply) and a preflight from it a 400.
Nothing here knows the API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsPolicy:
    origins: Sequence[str] = ("*",)
    methods: Sequence[str] = ("*",)
    headers: Sequence[str] = ("*",)
    credentials: bool = False

    def allow_origin(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``, or None if it is not allowed (with
        credentials a wildcard is answered with the origin itself, as browsers require)."""
        if "*" in self.origins:
            return origin if self.credentials else "*"
        return origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self._preflight_middleware())
        app.on_response_prepare.append(self._add_headers)

    def _preflight_middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def preflight(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            origin = request.headers.get("Origin")
            wanted = request.headers.get("Access-Control-Request-Method")
            if request.method != "OPTIONS" or origin is None or wanted is None:
                return await handler(request)
            allowed = self.allow_origin(origin)
            if allowed is None or ("*" not in self.methods and wanted.upper() not in self.methods):
                return web.Response(status=400, text="CORS preflight refused: origin or method not allowed")
            asked = request.headers.get("Access-Control-Request-Headers", "")
            headers = {
                "Access-Control-Allow-Origin": allowed,
                "Access-Control-Allow-Methods": ", ".join(
                    ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
                    if "*" in self.methods
                    else self.methods
                ),
                "Access-Control-Allow-Headers": asked if "*" in self.headers else ", ".join(self.headers),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            }
            if self.credentials:
                headers["Access-Control-Allow-Credentials"] = "true"
            if not headers["Access-Control-Allow-Headers"]:
                del headers["Access-Control-Allow-Headers"]
            return web.Response(status=200, headers=headers)

        return preflight

    async def _add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        allowed = self.allow_origin(origin)
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        if allowed != "*":
            response.headers["Vary"] = "Origin"
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
