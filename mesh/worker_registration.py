"""A worker's presence in a shared mesh: registry entry renewed by heartbeats, drain announcement, and
its KV events written into the Redis KV index (one writer per worker, in order).

Used by ``mesh.worker_service`` when a Redis URL is given; without one a worker stands alone and the
router learns of it from flags and follows its KV events over ``StreamKVEvents``.

The worker keeps its own index entries true: it clears what an earlier process of its id left when it
starts, removes its entries when it stops, writes a snapshot of its cache after a failed write and after
registering again (a registration that lapsed lets routers sweep its entries as a dead worker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.exceptions import RedisError

from mesh.kv_events import AllBlocksCleared, Tier
from mesh.kv_index import RedisKVIndex
from mesh.kv_index_writer import KVIndexWriter
from mesh.registry import Heartbeater, RedisRegistry, WorkerInfo

log = logging.getLogger(__name__)


class WorkerRegistration:
    def __init__(self, role: str, servicer: Any, settings: Any, metrics_port: int) -> None:
        engine = servicer.engine
        self.registry = RedisRegistry(settings.redis_url)
        self.index = RedisKVIndex(settings.redis_url, engine.model_fingerprint)
        host = settings.advertise_host or settings.host
        self.info = WorkerInfo(
            worker_id=servicer.worker_id,
            role=role,
            address=servicer.address,
            model_fingerprint=engine.model_fingerprint,
            block_size=engine.config.block_size,
            num_kv_blocks=engine.block_pool.num_blocks,
            metrics_address=f"{host}:{metrics_port}" if metrics_port > 0 else None,
            extra={"layout_fingerprint": engine.layout.fingerprint, "max_model_len": engine.max_model_len},
        )
        self.heartbeater = Heartbeater(
            self.registry, self.info, ttl_s=settings.registry_ttl_s, on_reregistered=self._resync
        )
        self.events = servicer.events
        self.worker_id = servicer.worker_id
        self.writer = KVIndexWriter(self.index, self.worker_id, self.events.snapshot)
        self._loop = asyncio.get_running_loop()

    async def start(self) -> None:
        # Whatever an earlier process of this worker id left in the index is stale.
        self.writer.start([AllBlocksCleared(Tier.GPU)])
        self.events.forward = lambda events: self._loop.call_soon_threadsafe(self.writer.put, events)
        await self.heartbeater.start()
        log.info("registered %s as %s at %s", self.worker_id, self.info.role, self.info.address)

    def _resync(self) -> None:
        """Write the whole cache again: while this worker was unregistered (a Redis restart, a partition)
        the routers' sweeps may have removed its entries as a dead worker's (``router.discovery``)."""
        log.info("%s registered again: writing a snapshot of its cache to the KV index", self.worker_id)
        self.writer.put(self.events.snapshot())

    async def mark_draining(self) -> None:
        try:
            await self.heartbeater.set_draining(True)
        except (RedisError, OSError) as exc:
            log.warning("could not announce drain of %s: %s", self.worker_id, exc)

    async def stop(self) -> None:
        self.events.forward = None
        # The writer stops first: events still queued (or a batch in flight) applied after remove_worker
        # would put the departed worker's blocks back in the index, where nothing would ever remove them.
        await self.writer.stop()
        try:
            await self.heartbeater.stop(deregister=True)
            await self.index.remove_worker(self.worker_id)
        except (RedisError, OSError) as exc:
            log.warning(
                "could not deregister %s: %s (its registry entry expires by TTL; the routers that see it "
                "expire remove its KV index entries)",
                self.worker_id,
                exc,
            )
        for client in (self.index, self.registry):
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
