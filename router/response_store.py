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

A background response also has an event log: its Responses streaming events in ``sequence_number``
order, appended by the router that runs it, which ``GET /v1/responses/{id}?stream=true`` replays and
follows. It lives as long as its record and goes with it (delete, eviction, expiry): in Redis a stream
``<prefix>:response-events:<id>`` (entry id ``0-<sequence_number + 1>``, same TTL, appended only while
the record exists, read with blocking ``XREAD``); in this process a list and an ``asyncio.Event`` that
wakes its readers.
"""

from __future__ import annotations

import asyncio
import contextlib
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


@dataclass
class LoggedEvent:
    sequence: int  # its sequence_number
    type: str
    data: str  # the event, JSON


def _logged(events: list[dict[str, Any]]) -> list[LoggedEvent]:
    return [
        LoggedEvent(event["sequence_number"], event["type"], json.dumps(event, separators=(",", ":")))
        for event in events
    ]


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...
    async def get(self, response_id: str) -> StoredResponse | None: ...
    async def delete(self, response_id: str) -> bool: ...
    async def replace_active(self, record: StoredResponse) -> bool: ...
    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None: ...
    async def read_events(self, response_id: str, after: int, block_s: float) -> list[LoggedEvent]: ...


@dataclass
class _EventLog:
    events: list[LoggedEvent] = field(default_factory=list)  # events[i].sequence == i
    grew: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on each append


def _active(record: StoredResponse | None) -> bool:
    return record is not None and record.response.get("status") in ACTIVE


class MemoryResponseStore:
    """The most recent ``max_stored`` records of this process, each for ``ttl_s`` seconds at most."""

    def __init__(self, max_stored: int, ttl_s: float) -> None:
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._logs: dict[str, _EventLog] = {}  # only of records held in _records

    async def put(self, record: StoredResponse) -> None:
        record.stored_at = time.monotonic()
        self._records[record.response["id"]] = record
        self._records.move_to_end(record.response["id"])
        while len(self._records) > self.max_stored:
            evicted, _ = self._records.popitem(last=False)
            self._logs.pop(evicted, None)

    async def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None and time.monotonic() - record.stored_at > self.ttl_s:
            await self.delete(response_id)  # expired: its log goes with it
            return None
        return record

    async def delete(self, response_id: str) -> bool:
        self._logs.pop(response_id, None)
        return self._records.pop(response_id, None) is not None

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Append to the record's log; nothing when the record is gone."""
        if await self.get(response_id) is None:
            return
        log = self._logs.setdefault(response_id, _EventLog())
        log.events += _logged(events)
        log.grew.set()
        log.grew = asyncio.Event()

    async def read_events(self, response_id: str, after: int, block_s: float) -> list[LoggedEvent]:
        """The logged events after sequence number ``after``; when none, waits up to ``block_s`` for some."""
        if await self.get(response_id) is None:
            return []
        log = self._logs.setdefault(response_id, _EventLog())
        if len(log.events) <= after + 1 and block_s > 0:
            with contextlib.suppress(TimeoutError):  # not wait_for: it can swallow a cancellation (3.11)
                async with asyncio.timeout(block_s):
                    await log.grew.wait()
        return log.events[after + 1 :]

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

    def events_key(self, response_id: str) -> str:
        return f"{self.prefix}:response-events:{response_id}"

    async def put(self, record: StoredResponse) -> None:
        record.stored_at = time.time()
        await self.client.set(self.key(record.response["id"]), json.dumps(asdict(record)), px=self.ttl_ms)

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self.key(response_id))
        return StoredResponse(**json.loads(raw)) if raw is not None else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self.client.delete(self.key(response_id), self.events_key(response_id)))

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """XADD each event (entry id ``0-<sequence_number + 1>``) and renew the log's TTL, in one script
        that does nothing when the record is gone (a log is never left without its record)."""
        args: list[Any] = [self.ttl_ms]
        for event in _logged(events):
            args += [f"0-{event.sequence + 1}", event.type, event.data]
        await self.client.eval(_APPEND_EVENTS, 2, self.key(response_id), self.events_key(response_id), *args)

    async def read_events(self, response_id: str, after: int, block_s: float) -> list[LoggedEvent]:
        """The logged events after sequence number ``after``; when none, waits up to ``block_s`` for some
        (a blocking XREAD: keep ``block_s`` under the client's socket timeout)."""
        block = int(block_s * 1000) or None  # BLOCK 0 would wait forever
        reply = await self.client.xread({self.events_key(response_id): f"0-{after + 1}"}, block=block)
        entries = reply[0][1] if reply else []
        return [
            LoggedEvent(int(entry_id.split(b"-")[1]) - 1, fields[b"type"].decode(), fields[b"data"].decode())
            for entry_id, fields in entries
        ]

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


_APPEND_EVENTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 3 do
  redis.call('XADD', KEYS[2], ARGV[i], 'type', ARGV[i + 1], 'data', ARGV[i + 2])
end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
