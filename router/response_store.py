"""Stored Responses API responses: what ``previous_response_id``, ``GET /v1/responses/{id}`` and
``DELETE /v1/responses/{id}`` read (OpenAI's ``store``, on by default).

A record is the Response object as the client got it, plus the conversation that produced it as chat
messages (without the request's instructions, which a follow-up does not inherit: OpenAI's rule). With
``--redis-url`` records live in Redis (``<prefix>:response:<id>``, JSON, expiring after
``--responses-ttl-s``), so any router of the mesh continues any response; without, in this process, the
most recent ``--responses-max-stored`` of them. Redis errors are the caller's to turn into statuses.

A background response's record changes while it runs (queued, in_progress, then completed, failed or
cancelled); ``replace_active`` writes such a change only while the stored record is still queued or in
progress, atomically (a Redis transaction on the key), so the owner's completion and a cancellation from
any router cannot overwrite one another.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import WatchError

ACTIVE = ("queued", "in_progress")  # a background response's statuses before it ends


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object
    messages: list[dict[str, Any]]  # the conversation before it, as chat messages (no instructions)
    stored_at: float = 0.0
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, as items


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...
    async def get(self, response_id: str) -> StoredResponse | None: ...
    async def delete(self, response_id: str) -> bool: ...
    async def replace_active(self, record: StoredResponse) -> bool: ...


def _active(record: StoredResponse | None) -> bool:
    return record is not None and record.response.get("status") in ACTIVE


class MemoryResponseStore:
    """The most recent ``max_stored`` records of this process, each for ``ttl_s`` seconds at most."""

    def __init__(self, max_stored: int, ttl_s: float) -> None:
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    async def put(self, record: StoredResponse) -> None:
        record.stored_at = time.monotonic()
        self._records[record.response["id"]] = record
        self._records.move_to_end(record.response["id"])
        while len(self._records) > self.max_stored:
            self._records.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is None or time.monotonic() - record.stored_at > self.ttl_s:
            return None
        return record

    async def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    async def replace_active(self, record: StoredResponse) -> bool:
        """Store ``record`` if the one stored under its id is queued or in progress; False if it is gone or
        has ended (no await in between: atomic on the event loop)."""
        if not _active(await self.get(record.response["id"])):
            return False
        await self.put(record)
        return True


class RedisResponseStore:
    """Records in Redis, one JSON value a response, expiring after ``ttl_s``: shared by every router."""

    def __init__(self, client: aioredis.Redis, ttl_s: float, prefix: str = "pdmesh") -> None:
        self.client = client
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    async def put(self, record: StoredResponse) -> None:
        record.stored_at = time.time()
        await self.client.set(self.key(record.response["id"]), json.dumps(asdict(record)), px=self.ttl_ms)

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self.key(response_id))
        return StoredResponse(**json.loads(raw)) if raw is not None else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self.client.delete(self.key(response_id)))

    async def replace_active(self, record: StoredResponse) -> bool:
        """Store ``record`` if the one stored under its id is queued or in progress; False if it is gone or
        has ended. WATCH / MULTI: a write by another router in between retries the check."""
        key = self.key(record.response["id"])
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if not _active(StoredResponse(**json.loads(raw)) if raw is not None else None):
                        return False
                    record.stored_at = time.time()
                    pipe.multi()
                    pipe.set(key, json.dumps(asdict(record)), px=self.ttl_ms)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue
