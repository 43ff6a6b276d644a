"""Without Redis, the router's KV index lives in its own memory, fed by every worker's KV events.

One ``StreamKVEvents(include_snapshot=True)`` subscription per worker in the pool feeds an
``InProcessKVIndex``: the snapshot (``AllBlocksCleared`` then ``BlocksStored`` of what the worker holds)
replaces whatever the index knew of that worker, then its events follow in order. A subscription that
breaks is opened again (0.2 s, then up to 2 s apart), snapshot first, so nothing missed in between
stays wrong; each break is logged once and counted in ``pdmesh_router_kv_event_stream_errors_total``. A
worker that answers UNIMPLEMENTED has no events to give and is left alone. When a worker leaves the pool,
or comes back under another worker id at the same address, the index forgets the old id. ``close`` cancels
and awaits every task the feed started (subscriptions and forgetting alike).

This module moves events from the workers into the index; it does not look anything up.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from mesh.background import BackgroundTasks
from mesh.kv_event_proto import events_from_proto
from mesh.kv_index import InProcessKVIndex
from protos.pdmesh.v1 import common_pb2, worker_pb2
from router.metrics import RouterMetrics
from router.worker_pool import WorkerEndpoint, WorkerPool

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.2
RETRY_MAX_S = 2.0


class KVEventFeed:
    def __init__(self, index: InProcessKVIndex, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.index = index
        self.pool = pool
        self.metrics = metrics
        self._background = BackgroundTasks("KV event feed")  # subscriptions and index.remove_worker calls
        self._tasks: dict[WorkerEndpoint, asyncio.Task[None]] = {}  # subscription per endpoint
        self._ids: dict[WorkerEndpoint, str] = {}  # the worker id its events came under
        self._broken: set[WorkerEndpoint] = set()  # subscriptions that broke and are not back yet
        pool.on_added.append(self.watch)
        pool.on_removed.append(self.unwatch)

    def start(self) -> None:
        for w in self.pool.workers:
            self.watch(w)

    async def close(self) -> None:
        self._tasks.clear()
        await self._background.close()

    def watch(self, w: WorkerEndpoint) -> None:
        if w not in self._tasks:
            self._tasks[w] = self._background.spawn(self._follow(w), f"kv-events-{w.address}")

    def unwatch(self, w: WorkerEndpoint) -> None:
        task = self._tasks.pop(w, None)
        if task is not None:
            task.cancel()
        self._broken.discard(w)
        worker_id = self._ids.pop(w, None)
        if worker_id is not None:
            self._background.spawn(self.index.remove_worker(worker_id), f"kv-forget-{worker_id}")

    async def _follow(self, w: WorkerEndpoint) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                call = w.stub.StreamKVEvents(worker_pb2.KVEventsRequest(include_snapshot=True))
                async for batch in call:
                    await self._apply(w, batch)
                    delay = RETRY_MIN_S
                why = "the stream ended"
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "%s worker %s serves no KV events; routing to it ignores its cache", w.role, w.address
                    )
                    return
                why = f"{exc.code().name}: {exc.details()}"
            except ValueError as exc:  # a malformed event: start over from a snapshot
                why = f"bad event: {exc}"
            except grpc.aio.UsageError:
                return  # the worker left the pool and its channel is closed
            self.metrics.kv_event_stream_errors.inc()
            if w not in self._broken:
                self._broken.add(w)
                log.warning(
                    "KV events of %s worker %s stopped (%s); resubscribing with a snapshot",
                    w.role,
                    w.address,
                    why,
                )
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    async def _apply(self, w: WorkerEndpoint, batch: common_pb2.KVEventBatch) -> None:
        worker_id = batch.worker_id or w.name
        previous = self._ids.get(w)
        if previous is not None and previous != worker_id:
            await self.index.remove_worker(previous)  # the worker restarted under a new id
        self._ids[w] = worker_id
        self.index.apply_sync(worker_id, events_from_proto(list(batch.events)))
        if w in self._broken:
            self._broken.discard(w)
            log.info("KV events of %s worker %s flow again", w.role, w.address)
