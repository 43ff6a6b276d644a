"""The KV offload store process: layout from the model's config, the block pool and its NIXL agent, the gRPC
server, /metrics, and, with a Redis URL, its registration (role ``kvstore``) and KV events in the index.

``python -m kvstore_svc`` runs ``main``; ``serve`` runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid

from redis.exceptions import RedisError

from engine.kv_offload import layout_for_model
from kvstore_svc.block_store import BlockStore
from kvstore_svc.config import KVStoreSettings
from kvstore_svc.servicer import KVStoreMetrics, KVStoreServicer
from mesh.block_hash import salted_fingerprint
from mesh.grpc_server import format_address, set_serving, start_server, wait_for_stop_signal
from mesh.kv_events import AllBlocksCleared, Tier
from mesh.kv_transfer import create_transfer_agent
from mesh.telemetry import start_metrics_server
from protos.pdmesh.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)


def _sizes(settings: KVStoreSettings, block_nbytes: int) -> tuple[int, int]:
    host = settings.host_blocks or max(1, int(settings.host_memory_gb * (1 << 30)) // block_nbytes)
    disk = 0
    if settings.disk_path:
        disk = (
            settings.disk_blocks
            if settings.disk_blocks is not None
            else int(settings.disk_gb * (1 << 30)) // block_nbytes
        )
    return host, disk


async def serve(settings: KVStoreSettings) -> None:
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s kvstore %(levelname)s %(name)s: %(message)s"
    )
    layout = layout_for_model(
        settings.model,
        settings.dtype,
        settings.kv_cache_dtype,
        settings.block_size,
        settings.quantization,
        settings.load_format,
        settings.speculative_config,
    )
    model_fingerprint = salted_fingerprint(layout.model_fingerprint, settings.cache_salt)
    host_blocks, disk_blocks = _sizes(settings, layout.block_nbytes)
    store = BlockStore(layout, host_blocks, settings.disk_path, disk_blocks)
    agent_name = f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    transfer = create_transfer_agent(
        settings.kv_transfer,
        agent_name,
        store.pool,
        layout,
        progress_thread=False,
        xfer_mode=settings.kv_xfer_mode,
    )
    metrics = KVStoreMetrics()
    servicer = KVStoreServicer(
        store,
        transfer,
        "pending",
        "",
        model_fingerprint,
        settings.lease_s,
        settings.transfer_timeout_s,
        metrics,
    )
    server, port = await start_server(
        [(kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer)],
        ["pdmesh.v1.KVStore"],
        host=settings.host,
        port=settings.port,
    )
    host = settings.advertise_host or settings.host
    servicer.store_id = settings.store_id or f"kvstore-{host}-{port}-{uuid.uuid4().hex[:6]}"
    servicer.address = format_address(host, port)
    metrics_port = -1
    if settings.metrics_port >= 0:
        metrics_port = await start_metrics_server(metrics.registry, settings.host, settings.metrics_port)
    writer = None
    heartbeater = None
    if settings.redis_url:
        from mesh.kv_index import RedisKVIndex
        from mesh.kv_index_writer import KVIndexWriter
        from mesh.registry import Heartbeater, RedisRegistry, WorkerInfo

        index = RedisKVIndex(settings.redis_url, model_fingerprint)
        writer = KVIndexWriter(index, servicer.store_id, store.snapshot_events)
        store.publish = writer.put
        # Whatever an earlier process of this store id left in the index is stale.
        writer.start([AllBlocksCleared(Tier.CPU), AllBlocksCleared(Tier.DISK)])
        info = WorkerInfo(
            worker_id=servicer.store_id,
            role="kvstore",
            address=servicer.address,
            model_fingerprint=model_fingerprint,
            block_size=layout.block_size,
            num_kv_blocks=host_blocks + disk_blocks,
            metrics_address=f"{host}:{metrics_port}" if metrics_port > 0 else None,
            extra={
                "layout_fingerprint": layout.fingerprint,
                "host_blocks": host_blocks,
                "disk_blocks": disk_blocks,
            },
        )
        # Registered again after a lapse (a Redis restart, a partition): the routers may have swept the
        # store's entries as a dead worker's, so its whole content is written again.
        heartbeater = Heartbeater(
            RedisRegistry(settings.redis_url), info, ttl_s=settings.registry_ttl_s,
            on_reregistered=lambda: writer.put(store.snapshot_events()),
        )  # fmt: skip
        await heartbeater.start()
    servicer.tasks.spawn(servicer.background(), "kvstore-lease-keeper")
    print(
        f"pdmesh kvstore ready: grpc={servicer.address} metrics={settings.host}:{metrics_port} "
        f"store_id={servicer.store_id} model={model_fingerprint} host_blocks={host_blocks} disk_blocks={disk_blocks}",
        flush=True,
    )
    await wait_for_stop_signal()
    log.info("stopping")
    await set_serving(server, False)
    if heartbeater is not None:
        with contextlib.suppress(RedisError, OSError):
            await heartbeater.stop(deregister=True)
    if writer is not None:
        await writer.stop()
        with contextlib.suppress(RedisError, OSError):
            await writer.index.remove_worker(servicer.store_id)
        with contextlib.suppress(RedisError, OSError):
            await writer.index.aclose()
    await servicer.tasks.close()
    await server.stop(grace=2.0)
    transfer.close()
    store.close()


def main(argv: list[str] | None = None) -> None:
    import sys

    from mesh.config import parse_service_settings

    settings = parse_service_settings(
        KVStoreSettings, "kvstore", "python -m kvstore_svc", "pdmesh KV offload store.", argv
    )
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        sys.exit(130)
