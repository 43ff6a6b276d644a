"""``python -m eplb_svc``: run the EPLB controller until SIGINT/SIGTERM (flags: ``--help``; each has a
``PDMESH_*`` twin). Prints ``pdmesh eplb ready: grpc=HOST:PORT metrics=HOST:PORT`` once it serves."""

from __future__ import annotations

import asyncio
import logging
import sys

from eplb_svc.config import EPLBSettings
from eplb_svc.service import EPLBService
from mesh.config import parse_service_settings
from mesh.grpc_server import format_address, wait_for_stop_signal

log = logging.getLogger("eplb_svc")


def parse_settings(argv: list[str] | None = None) -> EPLBSettings:
    return parse_service_settings(
        EPLBSettings, "eplb", "python -m eplb_svc",
        "pdmesh EPLB controller: aggregates MoE workers' expert load and publishes balanced "
        "expert placements (pdmesh.v1.EPLB).",
        argv,
    )  # fmt: skip


async def serve(settings: EPLBSettings) -> None:
    service = EPLBService(settings)
    await service.start()
    print(
        f"pdmesh eplb ready: grpc={service.address} "
        f"metrics={format_address(settings.host, service.metrics_port)} id={service.controller_id}",
        flush=True,
    )
    try:
        await wait_for_stop_signal()
    finally:
        log.info("eplb controller stopping")
        await service.stop()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s eplb %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
