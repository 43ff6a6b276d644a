"""``python -m prefill_svc``: one prefill worker process (flags: ``--help``; each has a ``PDMESH_*`` twin)."""

from __future__ import annotations

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from mesh.worker_service import worker_main
from prefill_svc.servicer import PrefillServicer


def main(argv: list[str] | None = None) -> None:
    worker_main(
        "prefill", PrefillServicer, EngineConfig, lambda cfg, sink: AsyncEngine(cfg, event_sink=sink), argv
    )


if __name__ == "__main__":
    main()
