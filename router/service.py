"""Wiring of one router process: worker pool, discovery, KV index, chooser, orchestrator, the servers.

``RouterService(config).start()`` brings everything up (tests use it in-process; ``python -m router``
runs it until a signal); ``stop()`` turns health NOT_SERVING, stops taking requests and closes the
worker channels. With ``--redis-url`` the pool follows the registry (``router.discovery``) and prefixes
are looked up in the Redis KV index; without, the pool is the flag workers and the index lives in this
process, fed by their ``StreamKVEvents`` (``router.kv_event_feed``). Policy and request handling live in
the modules it wires, not here.
"""

from __future__ import annotations

import logging

import grpc
import redis.asyncio as aioredis
from aiohttp import web

from mesh.grpc_server import service_name, set_serving, start_server
from mesh.kv_index import InProcessKVIndex
from mesh.registry import RedisRegistry
from mesh.telemetry import Tracing, setup_tracing
from protos.pdmesh.v1 import router_pb2, router_pb2_grpc
from router.auth import ApiKeys, GrpcApiKeyInterceptor
from router.chooser import WorkerChooser
from router.config import RouterConfig
from router.cors import CorsPolicy
from router.discovery import RegistryDiscovery
from router.grpc_api import RouterServicer
from router.http_api import HttpApi
from router.kv_event_feed import KVEventFeed
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.prefix_index import PrefixIndex
from router.response_store import MemoryResponseStore, RedisResponseStore, ResponseStore
from router.scored_chooser import ScoredChooser
from router.served_model import ServedModel
from router.worker_pool import DECODE, PREFILL, WorkerPool

log = logging.getLogger(__name__)

ROUTER_SERVICE = service_name(router_pb2, "Router")


def make_chooser(
    config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics, index: PrefixIndex | None
) -> WorkerChooser:
    return ScoredChooser(
        config.routing,
        pool,
        metrics,
        index,
        weights=config.routing_weights(),
        pd_threshold_tokens=config.pd_threshold_tokens,
        seed=config.routing_seed,
    )


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
        for role in (PREFILL, DECODE):
            for usable in (True, False):
                self.metrics.pool_workers.labels(role=role, usable=str(usable).lower()).set_function(
                    lambda role=role, usable=usable: sum(
                        1 for w in self.pool.by_role(role) if w.usable == usable
                    )
                )
        # Redis: one client (short timeouts: a dead Redis must not hold requests) for registry and index.
        self.redis: aioredis.Redis | None = None
        self.discovery: RegistryDiscovery | None = None
        self.feed: KVEventFeed | None = None
        self.index: PrefixIndex | None = None
        if config.redis_url:
            self.redis = aioredis.from_url(
                config.redis_url,
                socket_connect_timeout=max(config.index_timeout_s, 0.5),
                socket_timeout=max(config.index_timeout_s * 4, 1.0),
            )
        if config.routing == "prefix":
            if self.redis is not None:
                self.index = PrefixIndex(
                    self.metrics, redis_client=self.redis, timeout_s=config.index_timeout_s
                )
            else:
                in_process = InProcessKVIndex()
                self.feed = KVEventFeed(in_process, self.pool, self.metrics)
                self.index = PrefixIndex(self.metrics, in_process=in_process)
        if self.redis is not None:
            # Discovery also sweeps the KV index of workers that are gone.
            self.discovery = RegistryDiscovery(
                RedisRegistry(self.redis),
                self.pool,
                self.metrics,
                config.model,
                config.discovery_interval_s,
                config.registry_grace_s,
                index=self.index,
            )
        self.model = ServedModel(
            config.model,
            self.pool,
            config.served_model_name,
            config.max_model_len,
            config.default_max_tokens_cap,
            config.tool_call_parser if config.enable_auto_tool_choice else "none",
            config.reasoning_parser,
            config.chat_template,
            config.generation_config,
        )
        self.orchestrator = Orchestrator(
            self.pool,
            chooser or make_chooser(config, self.pool, self.metrics, self.index),
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
        if self.feed is not None:
            self.feed.start()
        await self.pool.start()
        if self.discovery is not None:
            await self.discovery.start()
        servicer = RouterServicer(self.model, self.orchestrator, self.pool, self.metrics)
        keys = ApiKeys(self.config.api_key)
        self.grpc_server, self.grpc_port = await start_server(
            [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
            [ROUTER_SERVICE],
            self.config.host,
            self.config.port,
            interceptors=[GrpcApiKeyInterceptor(keys)] if keys else None,
        )
        cors = CorsPolicy(
            tuple(self.config.allowed_origins),
            tuple(m.upper() for m in self.config.allowed_methods),
            tuple(self.config.allowed_headers),
            self.config.allow_credentials,
        )
        store: ResponseStore | None = None
        if self.config.store_responses:
            store = (
                RedisResponseStore(self.redis, self.config.responses_ttl_s)
                if self.redis is not None
                else MemoryResponseStore(self.config.responses_max_stored, self.config.responses_ttl_s)
            )
        api = HttpApi(
            self.model, self.orchestrator, self.pool, self.metrics, keys, cors, store,
            runtime_lora_updating=self.config.runtime_lora_updating(),
        )  # fmt: skip
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
            "router serving model %s: gRPC %s:%d, HTTP %s:%d, %d prefill and %d decode workers, routing %s, %s, %s",
            self.model.name,
            self.config.host,
            self.grpc_port,
            self.config.host,
            self.http_port,
            len(self.pool.by_role(PREFILL)),
            len(self.pool.by_role(DECODE)),
            self.config.routing,
            "registry and KV index in Redis"
            if self.redis is not None
            else "flag workers, in-process KV index",
            "API keys required" if keys else "no API keys",
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
        if self.discovery is not None:
            await self.discovery.close()
        if self.feed is not None:
            await self.feed.close()
        if self.index is not None:
            await self.index.close()
        await self.pool.close()
        self.model.close()
        if self.redis is not None:
            await self.redis.aclose()
        if self.tracing is not None:
            self.tracing.shutdown()
