"""The EPLB controller process's wiring: gRPC server (health, reflection), /metrics, the registry entry
(role ``eplb``) and the rebalance loop. ``EPLBService`` runs in any event loop (``__main__`` and tests)."""

from __future__ import annotations

import asyncio
import logging
import uuid

from redis.exceptions import RedisError

from eplb_svc.config import EPLBSettings
from eplb_svc.placement_store import PlacementStore
from eplb_svc.servicer import EPLBMetrics, EPLBServicer
from mesh.background import BackgroundTasks
from mesh.eplb_client import EPLB_REGISTRY_MODEL, EPLB_ROLE
from mesh.grpc_server import format_address, service_name, set_serving, start_server
from mesh.registry import Heartbeater, RedisRegistry, WorkerInfo
from mesh.telemetry import start_metrics_server, stop_metrics_server
from protos.pdmesh.v1 import eplb_pb2, eplb_pb2_grpc

log = logging.getLogger(__name__)


class EPLBService:
    def __init__(self, settings: EPLBSettings) -> None:
        self.settings = settings
        self.metrics = EPLBMetrics()
        store = None
        if settings.redis_url:
            store = PlacementStore(settings.redis_url, settings.redis_key_prefix)
        self.servicer = EPLBServicer(settings, self.metrics, store)
        self.tasks = BackgroundTasks("eplb")
        self.server = None
        self.port = 0
        self.metrics_port = -1
        self.address = ""
        self.controller_id = ""
        self._registry: RedisRegistry | None = None
        self._heartbeater: Heartbeater | None = None

    async def start(self) -> None:
        s = self.settings
        await self.servicer.restore()
        self.server, self.port = await start_server(
            [(eplb_pb2_grpc.add_EPLBServicer_to_server, self.servicer)],
            [service_name(eplb_pb2, "EPLB")],
            host=s.host,
            port=s.port,
        )
        host = s.advertise_host or s.host
        self.address = format_address(host, self.port)
        self.controller_id = s.controller_id or f"eplb-{host}-{self.port}-{uuid.uuid4().hex[:6]}"
        if s.metrics_port >= 0:
            self.metrics_port = await start_metrics_server(self.metrics.registry, s.host, s.metrics_port)
        if s.redis_url:
            self._registry = RedisRegistry(s.redis_url)
            info = WorkerInfo(
                worker_id=self.controller_id,
                role=EPLB_ROLE,
                address=self.address,
                model_fingerprint=EPLB_REGISTRY_MODEL,
                block_size=0,
                num_kv_blocks=0,
                metrics_address=format_address(host, self.metrics_port) if self.metrics_port > 0 else None,
            )
            self._heartbeater = Heartbeater(self._registry, info, ttl_s=s.registry_ttl_s)
            await self._heartbeater.start()
        self.tasks.spawn(self._rebalance_loop(), "eplb-rebalance")

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.rebalance_interval_s)
            await self.servicer.rebalance_once()

    async def stop(self) -> None:
        if self.server is not None:
            await set_serving(self.server, False)
        await self.tasks.close()
        if self._heartbeater is not None:
            try:
                await self._heartbeater.stop(deregister=True)
            except (RedisError, OSError) as exc:  # Redis down: the entry expires by its TTL
                log.warning("could not deregister %s: %s", self.controller_id, exc)
        if self._registry is not None:
            await self._registry.aclose()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.metrics_port > 0:
            await stop_metrics_server(self.metrics_port)
        if self.servicer.store is not None:
            await self.servicer.store.aclose()
