"""``python -m decode_svc``: one decode worker process (flags: ``--help``; each has a ``PDMESH_*`` twin)."""

from __future__ import annotations

from decode_svc.servicer import DecodeServicer
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from mesh.worker_service import worker_main


def main(argv: list[str] | None = None) -> None:
    worker_main(
        "decode", DecodeServicer, EngineConfig, lambda cfg, sink: AsyncEngine(cfg, event_sink=sink), argv
    )


if __name__ == "__main__":
    main()
