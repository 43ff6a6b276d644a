"""One owner's KV events into the Redis KV index: in order, by one task, resynchronised after failures.

A worker (``mesh.worker_registration``) and the KV offload store (``kvstore_svc``) each keep their own
entries in the index true through one ``KVIndexWriter``: batches are applied in the order they were put;
while Redis is unreachable the writer retries every 0.5 s and, once a write succeeds again, starts over from
a snapshot of what the owner holds (the batches it could not write are lost, the snapshot replaces them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from mesh.kv_events import KVEvent
from mesh.kv_index import RedisKVIndex

log = logging.getLogger(__name__)

RETRY_S = 0.5


class KVIndexWriter:
    def __init__(self, index: RedisKVIndex, owner_id: str, snapshot: Callable[[], list[KVEvent]]) -> None:
        """``snapshot``: every event that states what ``owner_id`` holds now (written after a failure)."""
        self.index = index
        self.owner_id = owner_id
        self.snapshot = snapshot
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def put(self, events: list[KVEvent]) -> None:
        """Queue a batch (on the writer's event loop; from another thread through ``call_soon_threadsafe``)."""
        self._queue.put_nowait(list(events))

    def start(self, first: list[KVEvent]) -> None:
        """Start writing, ``first`` before anything put (an owner clears what an earlier process of its id
        left)."""
        self.put(first)
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.owner_id}")

    async def stop(self) -> None:
        """Stop writing (batches still queued are dropped): before the owner's entries are removed, so that
        no batch applied after the removal puts them back."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        resync = False
        while True:
            events = await self._queue.get()
            while not self._queue.empty():
                events = events + self._queue.get_nowait()
            if resync:
                events = self.snapshot()
            try:
                await self.index.apply(self.owner_id, events)
                resync = False
            except (RedisError, OSError) as exc:
                if not resync:
                    log.warning("KV index write failed (%s); will resync from a snapshot", exc)
                resync = True
                await asyncio.sleep(RETRY_S)
                self._queue.put_nowait([])
