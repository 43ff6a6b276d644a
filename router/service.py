"""Wiring of one router process: worker pool, chooser, orchestrator, the gRPC and HTTP servers.

``RouterService(config).start()`` brings everything up (tests use it in-process; ``python -m router``
runs it until a signal); ``stop()`` turns health NOT_SERVING, stops taking requests and closes the
worker channels. Policy and request handling live in the modules it wires, not here.
"""

from __future__ import annotations

import logging

import grpc
from aiohttp import web

from mesh.grpc_server import service_name, set_serving, start_server
from mesh.telemetry import Tracing, setup_tracing
from protos.pdmesh.v1 import router_pb2, router_pb2_grpc
from router.chooser import RoundRobinChooser, WorkerChooser
from router.config import RouterConfig
from router.grpc_api import RouterServicer
from router.http_api import HttpApi
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.served_model import ServedModel
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)

ROUTER_SERVICE = service_name(router_pb2, "Router")


def make_chooser(config: RouterConfig) -> WorkerChooser:
    if config.routing == "round_robin":
        return RoundRobinChooser()
    raise ValueError(f"unknown routing {config.routing!r}")


class RouterService:
    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics | None = None, chooser: WorkerChooser | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.pool = WorkerPool(
            config.prefill_workers,
            config.decode_workers,
            config.block_size,
            config.control_timeout_s,
            config.stats_interval_s,
        )
        self.model = ServedModel(
            config.model,
            self.pool,
            config.served_model_name,
            config.max_model_len,
            config.default_max_tokens_cap,
        )
        self.orchestrator = Orchestrator(
            self.pool,
            chooser or make_chooser(config),
            self.metrics,
            config.request_timeout_s,
            config.control_timeout_s,
            config.max_decode_attempts,
        )
        self.tracing: Tracing | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.tracing = setup_tracing(
            "pdmesh-router", otlp_endpoint=self.config.otlp_endpoint, jsonl_path=self.config.trace_file
        )
        await self.pool.start()
        servicer = RouterServicer(self.model, self.orchestrator, self.pool, self.metrics)
        self.grpc_server, self.grpc_port = await start_server(
            [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
            [ROUTER_SERVICE],
            self.config.host,
            self.config.port,
        )
        api = HttpApi(self.model, self.orchestrator, self.pool, self.metrics)
        self._runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.http_port)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise OSError(
                exc.errno,
                f"cannot serve HTTP on {self.config.host}:{self.config.http_port}: "
                f"{exc.strerror}; is another process using the port?",
            ) from exc
        self.http_port = self._runner.addresses[0][1]
        log.info(
            "router serving model %s: gRPC %s:%d, HTTP %s:%d, %d prefill and %d decode workers",
            self.model.name,
            self.config.host,
            self.grpc_port,
            self.config.host,
            self.http_port,
            len(self.config.prefill_workers),
            len(self.config.decode_workers),
        )

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.grpc_server is not None:
            await set_serving(self.grpc_server, False)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace_s)
            self.grpc_server = None
        await self.orchestrator.drain_background()
        await self.pool.close()
        if self.tracing is not None:
            self.tracing.shutdown()
