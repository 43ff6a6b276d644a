"""``python -m prefill_svc``: one prefill worker process."""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from mesh.config import add_arguments, from_sources
from mesh.worker_service import WorkerSettings, serve_worker
from prefill_svc.servicer import PrefillServicer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    add_arguments(parser, EngineConfig, "engine")
    add_arguments(parser, WorkerSettings, "worker")
    args = parser.parse_args(argv)
    engine_cfg = from_sources(EngineConfig, args)
    settings = from_sources(WorkerSettings, args)
    try:
        asyncio.run(
            serve_worker(
                "prefill", PrefillServicer, settings, lambda sink: AsyncEngine(engine_cfg, event_sink=sink)
            )
        )
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
