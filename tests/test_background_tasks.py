"""Background tasks end with their owner: ``mesh.background.BackgroundTasks`` alone, and the KV event
feed, whose ``close`` must leave none of its subscriptions or forgetting tasks running."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from mesh.background import BackgroundTasks
from mesh.grpc_server import start_server
from mesh.kv_event_proto import events_to_proto
from mesh.kv_events import AllBlocksCleared, BlocksStored, Tier
from mesh.kv_index import InProcessKVIndex, PrefixMatch
from protos.pdmesh.v1 import common_pb2, worker_pb2_grpc
from router.kv_event_feed import KVEventFeed
from router.metrics import RouterMetrics
from router.worker_pool import WorkerPool
from tests.mesh_fixtures import async_test, until

BS = 16


@async_test
async def test_close_cancels_and_awaits_a_pending_task() -> None:
    tasks = BackgroundTasks("test")
    never = asyncio.Event()
    task = tasks.spawn(never.wait(), "waits-forever")
    await asyncio.sleep(0)
    assert not task.done() and len(tasks) == 1
    await tasks.close()
    assert task.done() and task.cancelled()
    assert len(tasks) == 0


@async_test
async def test_close_gives_running_tasks_their_grace_then_closes_what_they_spawned() -> None:
    tasks = BackgroundTasks("test")
    finished: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        finished.append("quick")

    async def spawns_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            late.append(tasks.spawn(asyncio.Event().wait(), "spawned-while-closing"))
            raise

    late: list[asyncio.Task[Any]] = []
    quick_task = tasks.spawn(quick(), "quick")
    tasks.spawn(spawns_on_cancel(), "spawns-on-cancel")
    await tasks.close(grace_s=1.0)
    assert finished == ["quick"] and not quick_task.cancelled()
    assert len(late) == 1 and late[0].cancelled()
    assert len(tasks) == 0


@async_test
async def test_a_failing_task_is_logged_with_its_name(caplog: Any) -> None:
    tasks = BackgroundTasks("test owner")

    async def fails() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="mesh.background"):
        task = tasks.spawn(fails(), "fails-on-purpose")
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback runs on the next turn of the loop
    assert len(tasks) == 0
    [record] = [r for r in caplog.records if "fails-on-purpose" in r.getMessage()]
    assert "test owner" in record.getMessage() and record.exc_info is not None
    await tasks.close()


class SnapshotWorker(worker_pb2_grpc.WorkerServicer):
    """StreamKVEvents: one snapshot of ``held``, then nothing until the router hangs up."""

    def __init__(self, worker_id: str, held: list[int]) -> None:
        self.worker_id = worker_id
        self.held = held

    async def StreamKVEvents(self, request: Any, context: Any) -> AsyncIterator[common_pb2.KVEventBatch]:  # noqa: N802
        events = [AllBlocksCleared(Tier.GPU), BlocksStored(tuple(self.held), Tier.GPU)]
        yield common_pb2.KVEventBatch(worker_id=self.worker_id, events=events_to_proto(events))
        await asyncio.Event().wait()


@async_test
async def test_feed_close_leaves_no_subscription_or_forgetting_task_running() -> None:
    server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, SnapshotWorker("p-bg", [7, 8]))],
        ["pdmesh.v1.Worker"],
    )
    # The second address has no server: its subscription keeps retrying, i.e. stays pending.
    pool = WorkerPool([f"127.0.0.1:{port}", "127.0.0.1:1"], [], BS)
    index = InProcessKVIndex()
    feed = KVEventFeed(index, pool, RouterMetrics())
    feed.start()
    try:
        assert await until(lambda: index.lookup_sync([7, 8]) == {"p-bg": PrefixMatch.from_counts(2, 0, 0)})
        # The worker leaves: its subscription is cancelled and the index is told to forget it, in a task
        # that has not run yet when close is called.
        pool.remove(pool.workers[0], "test")
        started = [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
        assert {t.get_name() for t in started} >= {f"kv-events-127.0.0.1:{port}", "kv-forget-p-bg"}
        (forget,) = [t for t in started if t.get_name() == "kv-forget-p-bg"]
        assert not forget.done()  # close meets the forgetting task still pending
        await feed.close()
        assert all(t.done() for t in started), [t.get_name() for t in started if not t.done()]
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
    finally:
        await feed.close()
        await pool.close()
        await server.stop(0)


async def _swallows_one_cancellation(ticks: list[int]) -> None:
    """A loop that misses the first cancellation it gets and runs on, as one built on Python 3.11's
    ``asyncio.wait_for`` can when its inner await completes as the cancellation arrives (cpython#86296)."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
            ticks.append(1)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True


@async_test
async def test_close_ends_a_task_that_swallowed_its_cancellation() -> None:
    from mesh import background

    tasks = BackgroundTasks("test")
    ticks: list[int] = []
    task = tasks.spawn(_swallows_one_cancellation(ticks), "stubborn")
    await asyncio.sleep(0.05)
    async with asyncio.timeout(background.RECANCEL_S + 5):  # before: awaited forever
        await tasks.close()
    assert task.cancelled() and len(tasks) == 0 and ticks
    other = asyncio.get_running_loop().create_task(_swallows_one_cancellation([]))
    await asyncio.sleep(0.02)
    async with asyncio.timeout(background.RECANCEL_S + 5):
        await background.cancel_until_done(other)
    assert other.cancelled()


@async_test
async def test_registry_discovery_closes_though_a_read_swallowed_its_cancellation() -> None:
    """The router's registry discovery loop, cancelled on close: a poll that misses the cancellation
    (the cpython#86296 race, which hung a CI run's close for the test's whole timeout) is cancelled again."""
    from mesh import background
    from router.discovery import RegistryDiscovery

    ticks: list[int] = []

    class Registry:
        async def list_workers(self, model_fingerprint: str | None = None) -> list[Any]:
            return []

    discovery = RegistryDiscovery(
        Registry(), WorkerPool([], [], BS), RouterMetrics(), "tiny-dense", interval_s=0.01
    )
    await discovery.start()

    async def poll_once() -> bool:
        await _swallows_one_cancellation(ticks)
        return True

    discovery.poll_once = poll_once  # type: ignore[method-assign]
    await asyncio.sleep(0.05)
    loop_task = discovery._task
    assert loop_task is not None
    started = time.monotonic()
    async with asyncio.timeout(background.RECANCEL_S + 5):
        await discovery.close()
    assert loop_task.done() and time.monotonic() - started < background.RECANCEL_S + 3
    assert ticks
