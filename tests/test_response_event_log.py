"""A background response's event log (router/response_store.py), in this process and in Redis: events
read after a sequence number, a blocking read woken by an append, the log gone with its record (delete,
eviction, expiry) and never written without it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from router.response_store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoredResponse
from tests.mesh_fixtures import REDIS_URL, needs_redis


def _events(first: int, count: int) -> list[dict[str, Any]]:
    return [
        {"type": "response.output_text.delta", "sequence_number": i, "delta": str(i)}
        for i in range(first, first + count)
    ]


async def _logs_after_sequence_numbers(store: ResponseStore) -> None:
    await store.append_events("r", _events(0, 2))  # no record: nothing logged
    assert await store.read_events("r", -1, 0) == []
    await store.put(StoredResponse({"id": "r", "status": "in_progress"}, []))
    await store.append_events("r", _events(0, 3))
    read = await store.read_events("r", -1, 0)
    assert [e.sequence for e in read] == [0, 1, 2] and json.loads(read[2].data) == _events(2, 1)[0]
    assert read[0].type == "response.output_text.delta"
    assert [e.sequence for e in await store.read_events("r", 1, 0)] == [2]
    start = time.monotonic()
    assert await store.read_events("r", 2, 0.2) == []  # nothing new: waited, then none
    assert time.monotonic() - start >= 0.15

    async def append_later() -> None:
        await asyncio.sleep(0.1)
        await store.append_events("r", _events(3, 2))

    writer = asyncio.create_task(append_later())
    start = time.monotonic()
    woken = await store.read_events("r", 2, 5.0)
    assert [e.sequence for e in woken] == [3, 4] and time.monotonic() - start < 2.0
    await writer
    assert await store.delete("r")
    assert await store.read_events("r", -1, 0) == []


def test_the_in_process_log() -> None:
    async def run() -> None:
        store = MemoryResponseStore(max_stored=2, ttl_s=60)
        await _logs_after_sequence_numbers(store)
        assert store._logs == {}
        for i in range(3):
            await store.put(StoredResponse({"id": f"r{i}"}, []))
            await store.append_events(f"r{i}", _events(0, 1))
        assert sorted(store._logs) == ["r1", "r2"]  # r0 evicted, its log with it
        brief = MemoryResponseStore(max_stored=2, ttl_s=0.05)
        await brief.put(StoredResponse({"id": "x"}, []))
        await brief.append_events("x", _events(0, 1))
        await asyncio.sleep(0.1)
        assert await brief.read_events("x", -1, 0) == [] and brief._logs == {}  # expired

    asyncio.run(run())


@needs_redis
def test_the_redis_log() -> None:
    import redis.asyncio as aioredis

    async def run() -> None:
        client = aioredis.from_url(f"{REDIS_URL}/12")
        prefix = f"test-events-{uuid.uuid4().hex}"
        store = RedisResponseStore(client, ttl_s=60, prefix=prefix)
        try:
            await _logs_after_sequence_numbers(store)
            assert await client.exists(store.events_key("r")) == 0
            await store.put(StoredResponse({"id": "t"}, []))
            await store.append_events("t", _events(0, 1))
            assert 0 < await client.pttl(store.events_key("t")) <= 60_000
        finally:
            for key in await client.keys(f"{prefix}:*"):
                await client.delete(key)
            await client.aclose()

    asyncio.run(run())
