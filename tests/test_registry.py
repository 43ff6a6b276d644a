"""Service registry: both implementations, real TTL expiry (300 ms), and the heartbeat helper."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from mesh.registry import Heartbeater, InProcessRegistry, RedisRegistry, Registry, WorkerInfo
from tests.mesh_fixtures import REDIS_URL, async_test, needs_redis

KINDS = ["inprocess", pytest.param("redis", marks=needs_redis)]
TTL = 0.3  # seconds


@asynccontextmanager
async def open_registry(kind: str) -> AsyncIterator[Registry]:
    if kind == "inprocess":
        yield InProcessRegistry()
        return
    prefix = f"pdmesh-test-{uuid.uuid4().hex}"
    client = aioredis.from_url(REDIS_URL)
    try:
        yield RedisRegistry(client, prefix=prefix)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def worker(worker_id: str, role: str = "prefill", fp: str = "fp-a", **kw: Any) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{5000 + len(worker_id)}", fp, 16, 1024, **kw)


def ids(workers: list[WorkerInfo]) -> list[str]:
    return [w.worker_id for w in workers]


def test_worker_info_json_round_trip_ignores_unknown_fields() -> None:
    info = worker("p0", http_address="127.0.0.1:8000", extra={"tp": 2, "gpu": "h200"})
    assert WorkerInfo.from_json(info.to_json()) == info
    newer = info.to_json()[:-1] + ',"field_from_the_future":1}'
    assert WorkerInfo.from_json(newer) == info


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_register_list_filter_deregister(kind: str) -> None:
    async with open_registry(kind) as reg:
        assert await reg.list_workers() == []
        p1 = worker("p1", extra={"tp": 2})
        await reg.register(p1, 30)
        await reg.register(worker("p0"), 30)
        await reg.register(worker("d0", role="decode"), 30)
        await reg.register(worker("b0", fp="fp-b"), 30)
        assert ids(await reg.list_workers()) == ["b0", "d0", "p0", "p1"]
        assert ids(await reg.list_workers(role="prefill")) == ["b0", "p0", "p1"]
        assert ids(await reg.list_workers(role="prefill", model_fingerprint="fp-a")) == ["p0", "p1"]
        assert (await reg.list_workers(role="prefill", model_fingerprint="fp-a"))[1] == p1
        # Registering again replaces what was announced.
        await reg.register(worker("p1", extra={"tp": 4}), 30)
        assert [w.extra for w in await reg.list_workers(role="prefill", model_fingerprint="fp-a")] == [
            {},
            {"tp": 4},
        ]
        await reg.deregister("p1")
        await reg.deregister("nobody")
        assert ids(await reg.list_workers()) == ["b0", "d0", "p0"]
        assert await reg.heartbeat("p1", 30) is False


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_expiry_and_heartbeat_renewal(kind: str) -> None:
    async with open_registry(kind) as reg:
        await reg.register(worker("kept"), TTL)
        await reg.register(worker("lapsed"), TTL)
        assert ids(await reg.list_workers()) == ["kept", "lapsed"]
        await asyncio.sleep(0.15)
        assert await reg.heartbeat("kept", 2 * TTL) is True  # now expires 0.75 s after registering
        await asyncio.sleep(0.3)  # 0.45 s: the other one has expired
        assert ids(await reg.list_workers()) == ["kept"]
        assert await reg.heartbeat("lapsed", TTL) is False
        await asyncio.sleep(0.4)  # 0.85 s: both expired
        assert await reg.list_workers() == []
        assert await reg.heartbeat("kept", TTL) is False
        # Re-registering after expiry works as a fresh registration.
        await reg.register(worker("lapsed"), TTL)
        assert ids(await reg.list_workers()) == ["lapsed"]


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_set_draining_keeps_registration_and_ttl(kind: str) -> None:
    async with open_registry(kind) as reg:
        await reg.register(worker("d0", role="decode"), TTL)
        assert await reg.set_draining("d0", True) is True
        (info,) = await reg.list_workers()
        assert info.draining and info.role == "decode"
        await asyncio.sleep(0.4)  # draining does not renew the registration
        assert await reg.list_workers() == []
        assert await reg.set_draining("d0", False) is False
        assert await reg.set_draining("nobody", True) is False


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_heartbeater_renews_reregisters_and_deregisters(kind: str) -> None:
    async with open_registry(kind) as reg:
        hb = Heartbeater(reg, worker("p0"), ttl_s=TTL, interval_s=0.05)
        async with hb:
            await asyncio.sleep(0.5)  # well past one TTL: alive only because it renews
            assert ids(await reg.list_workers()) == ["p0"]
            assert hb.renewals >= 3
            await reg.deregister("p0")  # registration lost (e.g. Redis restarted)
            await asyncio.sleep(0.2)
            assert hb.reregistrations >= 1
            assert ids(await reg.list_workers()) == ["p0"]
            await hb.set_draining(True)
            assert (await reg.list_workers())[0].draining
        assert await reg.list_workers() == []  # stop deregisters
        assert hb.failures == 0


def test_heartbeater_default_interval_is_a_third_of_ttl() -> None:
    assert Heartbeater(InProcessRegistry(), worker("p0"), ttl_s=9).interval_s == 3
    with pytest.raises(ValueError):
        Heartbeater(InProcessRegistry(), worker("p0"), ttl_s=0)


class FlakyRegistry(InProcessRegistry):
    """Fails every other heartbeat as an unreachable Redis would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        self.calls += 1
        if self.calls % 2:
            raise redis.ConnectionError("Redis is unreachable")
        return await super().heartbeat(worker_id, ttl_s)


@async_test
async def test_heartbeater_survives_registry_errors() -> None:
    reg = FlakyRegistry()
    async with Heartbeater(reg, worker("p0"), ttl_s=1.0, interval_s=0.03) as hb:
        await asyncio.sleep(0.25)
        assert hb.failures >= 2 and hb.renewals >= 2
        assert ids(await reg.list_workers()) == ["p0"]


class DownAtStartRegistry(InProcessRegistry):
    """Unreachable for the first registration, as Redis might be while a worker starts."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        if self.down:
            self.down = False
            raise redis.ConnectionError("Redis is unreachable")
        await super().register(info, ttl_s)


@async_test
async def test_heartbeater_starts_while_the_registry_is_down() -> None:
    reg = DownAtStartRegistry()
    async with Heartbeater(reg, worker("p0"), ttl_s=1.0, interval_s=0.03) as hb:
        assert hb.failures == 1
        await asyncio.sleep(0.1)
        assert ids(await reg.list_workers()) == ["p0"]
        assert hb.reregistrations >= 1


@async_test
async def test_in_process_expiry_uses_the_injected_clock() -> None:
    now = [100.0]
    reg = InProcessRegistry(clock=lambda: now[0])
    await reg.register(worker("p0"), 10)
    now[0] += 9.9
    assert await reg.heartbeat("p0", 10) is True
    now[0] += 9.9
    assert ids(await reg.list_workers()) == ["p0"]
    now[0] += 0.2
    assert await reg.list_workers() == []


@needs_redis
@async_test
async def test_redis_layout_pruning_and_a_second_client() -> None:
    async with open_registry("redis") as reg:
        assert isinstance(reg, RedisRegistry)
        client = aioredis.from_url(REDIS_URL)
        other = RedisRegistry(REDIS_URL, prefix=reg.prefix)  # another process: knows nothing cached
        try:
            await reg.register(worker("p0"), 30)
            await reg.register(worker("gone"), TTL)
            key = reg.worker_key("fp-a", "p0")
            assert key == f"{reg.prefix}:fp-a:worker:p0"
            assert 29_000 < await client.pttl(key) <= 30_000
            assert WorkerInfo.from_json(await client.get(key)) == worker("p0")
            assert await client.smembers(f"{reg.prefix}:models") == {b"fp-a"}

            # A second registry finds the worker's model by itself, for heartbeat and draining.
            assert await other.heartbeat("p0", 60) is True
            assert await client.pttl(key) > 30_000
            assert await other.set_draining("p0", True) is True
            assert await client.pttl(key) > 30_000  # KEEPTTL

            await asyncio.sleep(0.4)
            assert ids(await other.list_workers()) == ["p0"]
            # The expired id was pruned from the set index.
            assert await client.smembers(reg.workers_key("fp-a")) == {b"p0"}
            await reg.deregister("p0")
            assert await other.list_workers() == []
            assert await client.exists(reg.workers_key("fp-a"), f"{reg.prefix}:models") == 0
        finally:
            await other.aclose()
            await client.aclose()


@needs_redis
@async_test
async def test_redis_follows_a_worker_that_moved_to_another_model() -> None:
    """Registry A remembers p0 under fp-a; p0 re-registers under fp-b through registry B."""
    async with open_registry("redis") as a:
        assert isinstance(a, RedisRegistry)
        b = RedisRegistry(REDIS_URL, prefix=a.prefix)
        try:
            await a.register(worker("p0", fp="fp-a"), TTL)
            await b.register(worker("p0", fp="fp-b"), 30)
            await asyncio.sleep(0.4)  # the fp-a registration has expired
            assert await a.heartbeat("p0", 30) is True
            assert await a.set_draining("p0", True) is True
            (info,) = await b.list_workers()
            assert (info.model_fingerprint, info.draining) == ("fp-b", True)
            await a.deregister("p0")
            assert await b.list_workers() == []
        finally:
            await b.aclose()
