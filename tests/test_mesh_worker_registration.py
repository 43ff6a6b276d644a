"""A worker's presence in a shared mesh (``mesh.worker_registration``) keeps its KV index entries true by
itself, on real Redis: a worker restarted under the same id starts with none of its earlier process's
entries, and a registration that lapsed while the worker lived (routers may have swept its entries
meanwhile) is followed by a snapshot of its cache. Routers rely on both (``router.discovery``: the sweep is
their only removal). Each test works under a model fingerprint of its own and deletes its keys."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

from mesh.block_hash import block_hashes, root_hash
from mesh.kv_events import BlocksStored, Tier
from mesh.kv_index import RedisKVIndex
from mesh.worker_registration import WorkerRegistration
from mesh.worker_service import EventFanout
from tests.mesh_fixtures import REDIS_URL, async_test, forget_model, needs_redis, until

pytestmark = needs_redis

BS = 16


def fake_servicer(worker_id: str, fp: str) -> SimpleNamespace:
    """What ``WorkerRegistration`` reads of a servicer and its engine, and the real event fan-out."""
    engine = SimpleNamespace(
        model_fingerprint=fp,
        config=SimpleNamespace(block_size=BS),
        block_pool=SimpleNamespace(num_blocks=64),
        layout=SimpleNamespace(fingerprint="layout-test"),
        max_model_len=256,
    )
    events = EventFanout(worker_id, fp)
    events.loop = asyncio.get_running_loop()
    return SimpleNamespace(engine=engine, worker_id=worker_id, address="127.0.0.1:30901", events=events)


@contextlib.asynccontextmanager
async def shared_mesh() -> AsyncIterator[tuple[str, RedisKVIndex, list[int]]]:
    """A model fingerprint of the test's own, the index as a router reads it, and a prompt's chain."""
    fp = f"tiny-dense-reg-{uuid.uuid4().hex[:12]}"
    index = RedisKVIndex(REDIS_URL, fp)
    try:
        yield fp, index, block_hashes(list(range(64)), BS, root_hash(fp))
    finally:
        await forget_model(fp)
        await index.aclose()


def settings(ttl_s: float = 0.3) -> SimpleNamespace:
    return SimpleNamespace(redis_url=REDIS_URL, advertise_host=None, host="127.0.0.1", registry_ttl_s=ttl_s)


@async_test
async def test_a_worker_restarted_under_its_id_starts_with_none_of_its_earlier_entries() -> None:
    async with shared_mesh() as (fp, index, hashes):
        await index.apply("p-live", [BlocksStored(tuple(hashes), Tier.GPU)])  # its earlier process, killed
        registration = WorkerRegistration("prefill", fake_servicer("p-live", fp), settings(5.0), -1)
        try:
            await registration.start()
            assert await until(lambda: _holders(index, hashes, set()))
        finally:
            await registration.stop()


@async_test
async def test_a_worker_registered_again_writes_its_cache_again() -> None:
    async with shared_mesh() as (fp, index, hashes):
        servicer = fake_servicer("p-live", fp)
        registration = WorkerRegistration("prefill", servicer, settings(), -1)
        try:
            await registration.start()
            servicer.events.publish([BlocksStored(tuple(hashes), Tier.GPU)])
            assert await until(lambda: _holders(index, hashes, {"p-live"}))
            # Its registration lapses while it lives (a partition), and a router sweeps its entries meanwhile.
            await registration.registry.deregister("p-live")
            await index.remove_worker("p-live")
            assert await index.lookup(hashes) == {}
            # Its next heartbeat (every ttl / 3) registers it again, and its cache is written again.
            assert await until(lambda: registration.heartbeater.reregistrations >= 1)
            assert await until(lambda: _holders(index, hashes, {"p-live"}))
        finally:
            await registration.stop()


async def _holders(index: RedisKVIndex, hashes: list[int], expected: set[str]) -> bool:
    return set(await index.lookup(hashes)) == expected
