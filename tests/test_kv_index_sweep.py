"""Discovery's sweep of the KV index: ids of workers that died while no router watched them.

Real Redis, a real ``RedisKVIndex`` written by the "workers" as theirs is, a real ``RedisRegistry``; each
test works under a model fingerprint and a registry prefix of its own, and deletes its keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from mesh.block_hash import block_hashes, root_hash
from mesh.kv_events import BlocksRemoved, BlocksStored, Tier
from mesh.kv_index import RedisKVIndex
from mesh.registry import RedisRegistry, WorkerInfo
from protos.pdmesh.v1 import common_pb2
from router.discovery import RegistryDiscovery
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.worker_pool import PREFILL, Health, WorkerPool
from tests.mesh_fixtures import REDIS_URL, ReadsFailWhileDown, async_test, metric, needs_redis, until

pytestmark = needs_redis

BS = 16
SWEPT = "swept: not registered and not in the pool"


@dataclass
class Mesh:
    fp: str
    client: aioredis.Redis
    registry: RedisRegistry
    worker_side: RedisKVIndex  # what a worker writes its events through
    index: PrefixIndex  # the router's
    pool: WorkerPool
    metrics: RouterMetrics
    hashes: list[int]

    def info(self, worker_id: str, role: str, port: int) -> WorkerInfo:
        return WorkerInfo(worker_id, role, f"127.0.0.1:{port}", self.fp, BS, 256)

    async def store(self, worker_id: str) -> None:
        await self.worker_side.apply(worker_id, [BlocksStored(tuple(self.hashes), Tier.GPU)])

    def discovery(self, registry: RedisRegistry | None = None, **kw: Any) -> RegistryDiscovery:
        """The router's registry discovery over this mesh's pool and index (``kw``: timings, clock)."""
        return RegistryDiscovery(
            registry or self.registry, self.pool, self.metrics, "tiny-dense", index=self.index, **kw
        )

    async def holders(self) -> set[str]:
        return set(await self.worker_side.lookup(self.hashes))


@contextlib.asynccontextmanager
async def mesh(static_decode: tuple[str, ...] = ()) -> AsyncIterator[Mesh]:
    fp = f"tiny-dense-sweep-{uuid.uuid4().hex[:12]}"
    client = aioredis.from_url(REDIS_URL)
    registry = RedisRegistry(client, prefix=f"pdmesh-sweep-{uuid.uuid4().hex[:12]}")
    worker_side = RedisKVIndex(REDIS_URL, fp)
    metrics = RouterMetrics()
    index = PrefixIndex(metrics, redis_client=client)
    pool = WorkerPool([], static_decode, BS)
    pool.model_fingerprint = fp  # as the first stats poll of a worker sets it
    hashes = block_hashes([(i * 31) % 500 for i in range(128)], BS, root_hash(fp))
    try:
        yield Mesh(fp, client, registry, worker_side, index, pool, metrics, hashes)
    finally:
        await pool.close()
        await index.close()
        await worker_side.aclose()
        for prefix in (worker_side.namespace, registry.prefix + ":"):
            keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
            if keys:
                await client.delete(*keys)
        await client.aclose()


async def poll(discovery: RegistryDiscovery) -> bool:
    """One registry read, and the sweep it started in the background (if one was due), to its end."""
    answered = await discovery.poll_once()
    if discovery.sweeping is not None:
        await discovery.sweeping
    return answered


def swept_lines(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if SWEPT in r.getMessage()]


@async_test
async def test_worker_ids_lists_every_worker_holding_a_slot() -> None:
    async with mesh() as m:
        assert await m.worker_side.worker_ids() == set()
        await m.store("p-a")
        await m.store("p-b")
        # p-b's blocks all go: its set of held blocks is empty, yet it holds a slot, so it is listed.
        await m.worker_side.apply("p-b", [BlocksRemoved(tuple(m.hashes), Tier.GPU)])
        assert not await m.client.exists(m.worker_side.worker_key("p-b"))
        assert await m.worker_side.worker_ids() == {"p-a", "p-b"}
        assert await m.index.worker_ids(m.fp) == {"p-a", "p-b"}
        await m.worker_side.remove_worker("p-b")
        assert await m.worker_side.worker_ids() == {"p-a"}


@async_test
async def test_discovery_sweeps_a_worker_that_died_unseen_and_keeps_the_live_ones(caplog: Any) -> None:
    """p-dead registered, stored blocks and died before the router started: its registration expired. The
    router's discovery forgets it once the registry has answered for the grace; p-live (registered) and
    d-static (named on the command line, not registered) keep their entries. One line, one removal."""
    async with mesh(static_decode=("127.0.0.1:30403",)) as m:
        await m.registry.register(m.info("p-dead", PREFILL, 30401), 0.2)
        await m.registry.register(m.info("p-live", PREFILL, 30402), 60)
        for worker_id in ("p-dead", "p-live", "d-static"):
            await m.store(worker_id)
        (static,) = m.pool.workers  # named on the command line; its id comes from its stats
        static.stats = common_pb2.WorkerStats(worker_id="d-static", model_fingerprint=m.fp, block_size=BS)
        await asyncio.sleep(0.3)  # p-dead's registration expires
        assert [w.worker_id for w in await m.registry.list_workers()] == ["p-live"]
        assert await m.holders() == {"p-dead", "p-live", "d-static"}

        discovery = m.discovery(interval_s=0.02, grace_s=0.3, sweep_interval_s=0.1)
        with caplog.at_level(logging.INFO, logger="router.prefix_index"):
            started = time.monotonic()
            await discovery.start()
            try:
                assert await until(lambda: _lacks(m, "p-dead"))
                assert time.monotonic() - started >= 0.3  # not before the grace
                await asyncio.sleep(0.35)  # more sweeps: p-dead is not swept again
            finally:
                await discovery.close()
        assert await m.holders() == {"p-live", "d-static"}
        assert await m.worker_side.worker_ids() == {"p-live", "d-static"}
        assert not await m.client.exists(m.worker_side.worker_key("p-dead"))
        assert swept_lines(caplog) == [f"KV index: forgot worker p-dead ({SWEPT})"]
        assert metric(m.metrics, "pdmesh_router_index_forget_errors_total") == 0


async def _lacks(m: Mesh, worker_id: str) -> bool:
    return worker_id not in await m.worker_side.worker_ids()


@async_test
async def test_nothing_is_swept_within_the_grace(caplog: Any) -> None:
    """A restarted Redis holds the index (persisted) but no registration yet: until the registry has
    answered for the grace, the workers' heartbeats may still register them, so nothing is swept."""
    async with mesh() as m:
        for worker_id in ("p-a", "d-b"):
            await m.store(worker_id)  # no registration: the workers have not re-registered yet
        discovery = m.discovery(interval_s=0.02, grace_s=30.0, sweep_interval_s=0.05)
        with caplog.at_level(logging.INFO, logger="router.prefix_index"):
            await discovery.start()
            try:
                await asyncio.sleep(0.5)  # ~25 reads, ~10 sweep intervals
                await m.registry.register(m.info("p-a", PREFILL, 30411), 60)  # p-a's heartbeat is back
                await asyncio.sleep(0.1)
            finally:
                await discovery.close()
        assert await m.holders() == {"p-a", "d-b"}
        assert swept_lines(caplog) == []


class FlakyRegistry(ReadsFailWhileDown, RedisRegistry):
    """The real registry, with reads that fail while ``down`` (Redis restarting, for the router)."""


@async_test
async def test_a_failed_registry_read_starts_the_grace_again() -> None:
    async with mesh() as m:
        registry = FlakyRegistry(m.client, prefix=m.registry.prefix)
        now = [0.0]
        discovery = m.discovery(registry, grace_s=5.0, clock=lambda: now[0], sweep_interval_s=30.0)
        await m.store("p-dead")
        assert await poll(discovery)
        now[0] = 4.0
        registry.down = True
        assert not await poll(discovery)
        now[0] = 6.0
        registry.down = False
        assert await poll(discovery)  # answering again since 6.0
        now[0] = 10.9
        assert await poll(discovery)
        assert await m.holders() == {"p-dead"}
        now[0] = 11.0
        assert await poll(discovery)
        assert await m.holders() == set()


@async_test
async def test_the_sweep_forgets_every_id_with_no_worker_behind_it_however_it_left() -> None:
    """Leaving the registry does not touch the index; the next sweep forgets every id that is neither
    registered nor in the pool: one that drained and deregistered (had it not removed its own entries), one
    whose address another process answers at now under a new id, and one dropped after the grace while it
    still answered (it writes its cache again when it registers again: mesh.worker_registration)."""
    async with mesh() as m:
        now = [0.0]
        discovery = m.discovery(grace_s=5.0, clock=lambda: now[0], sweep_interval_s=30.0)
        ids = {"p-drain": 30501, "p-old": 30502, "p-lost": 30503, "p-stay": 30504}
        for worker_id, port in ids.items():
            await m.registry.register(m.info(worker_id, PREFILL, port), 600)
            await m.store(worker_id)
        assert await poll(discovery)
        for w in m.pool.workers:
            w.stats = common_pb2.WorkerStats(worker_id=w.registered_id, model_fingerprint=m.fp, block_size=BS)
            w.health = Health.UP
        now[0] = 5.0
        assert await poll(discovery)  # the first sweep: everyone is registered
        await m.registry.set_draining("p-drain", True)
        assert await poll(discovery)
        await m.registry.deregister("p-drain")  # done draining, exits
        await m.registry.deregister("p-old")  # restarted: another process, another id, same address
        await m.registry.register(m.info("p-new", PREFILL, 30502), 600)
        await m.registry.deregister("p-lost")  # its registration is lost, but it answers
        assert await poll(discovery)
        restarted = m.pool.find("127.0.0.1:30502")
        assert restarted is not None  # what its next stats poll says:
        restarted.stats = common_pb2.WorkerStats(worker_id="p-new", model_fingerprint=m.fp, block_size=BS)
        now[0] = 11.0
        assert await poll(discovery)
        assert sorted(w.name for w in m.pool.workers) == ["p-new", "p-stay"]
        assert await m.holders() == set(ids)  # no sweep yet: leaving touched nothing
        now[0] = 35.0
        assert await poll(discovery)
        assert await m.holders() == {"p-stay"}


@async_test
async def test_a_slow_sweep_holds_up_no_registry_read() -> None:
    """The sweep runs beside the read loop: while it waits on a slow Redis, reads go on (a worker that
    registers joins the pool), no second sweep starts, and close cancels the one running."""
    async with mesh() as m:
        await m.store("p-dead")
        now = [0.0]
        discovery = m.discovery(grace_s=0.0, clock=lambda: now[0], sweep_interval_s=30.0)
        listed, slow = asyncio.Event(), asyncio.Event()
        worker_ids = m.index.worker_ids

        async def slow_worker_ids(fingerprint: str) -> set[str] | None:
            listed.set()
            await slow.wait()
            return await worker_ids(fingerprint)

        m.index.worker_ids = slow_worker_ids  # type: ignore[method-assign]
        assert await asyncio.wait_for(discovery.poll_once(), 1.0)
        sweep = discovery.sweeping
        assert sweep is not None
        await asyncio.wait_for(listed.wait(), 1.0)
        await m.registry.register(m.info("p-new", PREFILL, 30601), 60)
        now[0] = 31.0  # another sweep would be due, but one is running
        assert await asyncio.wait_for(discovery.poll_once(), 1.0)
        assert [w.registered_id for w in m.pool.workers] == ["p-new"]
        assert discovery.sweeping is sweep and not sweep.done()
        slow.set()
        await sweep
        assert await m.holders() == set()

        slow.clear()
        now[0] = 62.0
        assert await discovery.poll_once()
        assert discovery.sweeping is not sweep and not discovery.sweeping.done()
        await discovery.close()
        assert discovery.sweeping is None and sweep.done()
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "kv-index-sweep"]


@async_test
async def test_routers_sweeping_together_forget_a_dead_worker_once(caplog: Any) -> None:
    """Every router sweeps the same index. Two at once find the same dead worker: one removes it, with one
    line; the other finds its slot taken and leaves the work to the first."""
    async with mesh() as m:
        await m.store("p-dead")
        await m.store("p-live")
        await m.registry.register(m.info("p-live", PREFILL, 30701), 60)
        other_client = aioredis.from_url(REDIS_URL)
        other_index = PrefixIndex(RouterMetrics(), redis_client=other_client)
        other_pool = WorkerPool([], [], BS)
        other_pool.model_fingerprint = m.fp
        first = m.discovery(grace_s=0.0)
        second = RegistryDiscovery(
            m.registry, other_pool, RouterMetrics(), "tiny-dense", index=other_index, grace_s=0.0
        )
        try:
            with caplog.at_level(logging.INFO, logger="router.prefix_index"):
                assert all(await asyncio.gather(poll(first), poll(second)))
            assert await m.holders() == {"p-live"}
            assert swept_lines(caplog) == [f"KV index: forgot worker p-dead ({SWEPT})"]
        finally:
            await first.close()
            await second.close()
            await other_pool.close()
            await other_index.close()
            await other_client.aclose()
