"""``python -m router``: run one router process until SIGINT/SIGTERM.

Flags come from ``router.config.RouterConfig`` (each with a ``PDMESH_*`` twin). Prints one line,
``pdmesh router ready: grpc=HOST:PORT metrics=HOST:PORT http=HOST:PORT``, once both servers accept
requests (the same shape as the workers' line; ``metrics`` is the HTTP server, which serves ``/metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

from mesh.config import parse_service_settings
from mesh.grpc_server import format_address, wait_for_stop_signal
from router.config import RouterConfig
from router.service import RouterService

log = logging.getLogger("router")


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    return parse_service_settings(
        RouterConfig, "router", "python -m router",
        "pdmesh router: OpenAI-compatible HTTP and pdmesh.v1.Router gRPC in front of prefill "
        "and decode workers.",
        argv,
    )  # fmt: skip


async def serve(config: RouterConfig) -> None:
    service = RouterService(config)
    await service.start()
    print(
        f"pdmesh router ready: grpc={format_address(config.host, service.grpc_port)} "
        f"metrics={format_address(config.host, service.http_port)} "
        f"http={format_address(config.host, service.http_port)} model={service.model.name}",
        flush=True,
    )
    try:
        await wait_for_stop_signal()
    finally:
        log.info("router shutting down")
        await service.stop()


def run_event_loop(main_coro: Coroutine[Any, Any, None]) -> None:
    """uvloop where it is installed (as vLLM's and SGLang's API servers do): every routing decision
    awaits a Redis round trip, and uvloop's socket path costs less per await than asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
    else:
        uvloop.run(main_coro)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        run_event_loop(serve(config))
    except OSError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
