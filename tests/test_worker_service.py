"""What both worker roles share (``mesh.worker_service``), in process: the tasks a worker servicer starts
are kept until they end, their failures are logged, and ``close`` leaves none running."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.grpc_server import insecure_channel, start_server
from mesh.worker_service import EventFanout, WorkerMetrics, WorkerServicerBase, WorkerSettings
from protos.pdmesh.v1 import worker_pb2_grpc
from tests.mesh_fixtures import async_test


def servicer() -> WorkerServicerBase:
    """A servicer whose engine is never called: draining and closing do not touch it."""
    engine = SimpleNamespace(engine=None, alive=True)
    return WorkerServicerBase(
        engine, None, WorkerSettings(), "w-test", "", EventFanout("w-test"), WorkerMetrics("prefill")
    )


async def health(port: int) -> int:
    async with insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status


@async_test
async def test_start_drain_keeps_its_health_flip_until_it_ends_and_close_awaits_it() -> None:
    s = servicer()
    server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, s)], ["pdmesh.v1.Worker"]
    )
    s.server = server
    try:
        assert await health(port) == health_pb2.HealthCheckResponse.SERVING
        s.start_drain()
        (flip,) = [t for t in asyncio.all_tasks() if t.get_name() == "health-not-serving"]
        assert len(s.tasks) == 1 and not flip.done()  # referenced by the servicer while it runs
        s.start_drain()  # already draining: nothing more is started
        assert len(s.tasks) == 1
        await s.close()
        assert flip.done() and len(s.tasks) == 0
        assert s.draining
    finally:
        await server.stop(0)


class NotAServer:
    pass


@async_test
async def test_a_failed_health_flip_is_logged_at_once(caplog: Any) -> None:
    """A task nobody keeps reports its exception only when it is collected, if ever; the servicer's tasks
    log it as soon as it fails, with the task's name."""
    s = servicer()
    s.server = NotAServer()  # type: ignore[assignment]  # not made by start_server: set_serving raises
    with caplog.at_level(logging.ERROR, logger="mesh.background"):
        s.start_drain()
        await asyncio.sleep(0.01)
    [record] = [r for r in caplog.records if "health-not-serving" in r.getMessage()]
    assert "WorkerServicerBase" in record.getMessage() and record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)
    await s.close()


@async_test
async def test_close_cancels_the_roles_background_work() -> None:
    s = servicer()
    work = s.tasks.spawn(s.background(), "prefill-background")
    await asyncio.sleep(0)
    assert not work.done()
    await s.close()
    assert work.cancelled()
