"""The EPLB controller over real gRPC (in this process, on a loopback port): reports summed over ranks into
a placement group's window, placements published as versions (and streamed to watchers), reports of an old
placement dropped, bad input refused with its status, placements kept in Redis across a restart, and the
controller's registry entry that workers discover."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import redis

from eplb_svc.config import EPLBSettings
from eplb_svc.service import EPLBService
from mesh.eplb_client import ControllerDirectory
from mesh.expert_placement import check_placement, initial_placement
from mesh.grpc_server import insecure_channel
from protos.pdmesh.v1 import eplb_pb2, eplb_pb2_grpc
from tests.mesh_fixtures import REDIS_URL, async_test, needs_redis, until

LAYERS, LOGICAL, PHYSICAL, RANKS = 2, 8, 12, 2
FP = "tiny-moe-test"


def _settings(**kw: Any) -> EPLBSettings:
    base = dict(rebalance_interval_s=3600.0, window_s=600.0, min_window_tokens=100, metrics_port=0)
    base.update(kw)
    return EPLBSettings(**base)


@asynccontextmanager
async def _controller(
    settings: EPLBSettings | None = None,
) -> AsyncIterator[tuple[EPLBService, eplb_pb2_grpc.EPLBStub]]:
    service = EPLBService(settings or _settings())
    await service.start()
    try:
        async with insecure_channel(service.address) as channel:
            yield service, eplb_pb2_grpc.EPLBStub(channel)
    finally:
        await service.stop()


def _hot_counts(hot: list[int], rank: int = 0, tokens: int = 400) -> list[int]:
    """A rank's counts under the initial placement: most tokens to the ``hot`` experts' first replicas."""
    counts = []
    for _ in range(LAYERS):
        row = [5] * PHYSICAL
        for e in hot:
            row[e] = tokens // len(hot) + rank
        counts += row
    return counts


def _report(
    counts: list[int], rank: int = 0, version: int = 0, p2l: list[list[int]] | None = None, **kw: Any
):
    fields = dict(
        worker_id=f"w{rank}", model_fingerprint=FP, ep_rank=rank, num_layers=LAYERS,
        num_physical_experts=PHYSICAL, counts=counts, placement_version=version,
        num_logical_experts=LOGICAL, num_ranks=RANKS, pool="decode",
        physical_to_logical=[e for row in (p2l or initial_placement(LAYERS, LOGICAL, PHYSICAL)) for e in row],
    )  # fmt: skip
    fields.update(kw)
    return eplb_pb2.ExpertLoadReport(**fields)


def _request(**kw: Any) -> eplb_pb2.PlacementRequest:
    fields = dict(model_fingerprint=FP, num_layers=LAYERS, num_physical_experts=PHYSICAL,
                  num_logical_experts=LOGICAL, num_ranks=RANKS, pool="decode")  # fmt: skip
    fields.update(kw)
    return eplb_pb2.PlacementRequest(**fields)


def _rows(p: eplb_pb2.Placement) -> list[list[int]]:
    flat = list(p.physical_to_logical)
    return [flat[i * p.num_physical_experts : (i + 1) * p.num_physical_experts] for i in range(p.num_layers)]


def _metric(service: EPLBService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


@async_test
async def test_reports_of_every_rank_are_summed_and_a_better_placement_is_published_and_streamed() -> None:
    async with _controller() as (service, stub):
        watch = stub.WatchPlacement(_request())
        first = await watch.read()
        assert first.version == 0 and _rows(first) == initial_placement(LAYERS, LOGICAL, PHYSICAL)
        # Experts 4 and 5 are hot: under the initial placement each has one replica, both on rank 0 (slots 0-5).
        for rank in range(RANKS):
            ack = await stub.ReportExpertLoad(_report(_hot_counts([4, 5], rank), rank))
            assert ack.accepted and ack.placement_version == 0
        group = service.servicer.groups[next(iter(service.servicer.groups))]
        load, tokens = group.window_load()
        assert tokens == 2 * (sum(_hot_counts([4, 5])) / LAYERS) + 1 * 2  # both ranks, per layer
        assert load[0][4] == 200 + 201 and load[0][0] == 5 * 4  # both ranks; expert 0: slots 0 and 8
        [(key, decision)] = await service.servicer.rebalance_once()
        assert decision.outcome == "published", decision
        assert decision.balancedness_after > decision.balancedness_before + 0.1
        published = await asyncio.wait_for(watch.read(), 5)
        assert published.version == 1 and published.balancedness_after == pytest.approx(
            decision.balancedness_after
        )
        rows = _rows(published)
        check_placement(rows, LAYERS, LOGICAL, PHYSICAL)
        for row in rows:  # the hot experts are replicated, on both ranks
            for e in (4, 5):
                assert row.count(e) >= 2
            assert {4, 5} & set(row[:6]) and {4, 5} & set(row[6:])
        got = await stub.GetPlacement(_request())
        assert got.version == 1 and _rows(got) == rows and got.pool == "decode" and got.num_ranks == RANKS
        # The window was emptied: nothing more to weigh until new reports arrive.
        assert await service.servicer.rebalance_once() == []
        assert _metric(service, "pdmesh_eplb_placement_version", group=key.name) == 1
        assert _metric(service, "pdmesh_eplb_rebalances_total", group=key.name, outcome="published") == 1
        assert _metric(service, "pdmesh_eplb_reports_total", group=key.name, outcome="accepted") == 2
        assert _metric(service, "pdmesh_eplb_balancedness_ratio", group=key.name, placement="after") > 0.9
        url = f"http://127.0.0.1:{service.metrics_port}/metrics"  # served by this loop: fetch from a thread
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert b"pdmesh_eplb_moved_slots_total" in text and b"pdmesh_eplb_placement_version" in text
        watch.cancel()


@async_test
async def test_reports_measured_under_an_old_placement_are_dropped() -> None:
    async with _controller() as (service, stub):
        await stub.ReportExpertLoad(_report(_hot_counts([4, 5])))
        [(key, decision)] = await service.servicer.rebalance_once()
        assert decision.outcome == "published"
        ack = await stub.ReportExpertLoad(_report(_hot_counts([2, 3])))  # still version 0
        assert not ack.accepted and ack.placement_version == 1
        assert not service.servicer.groups[key].window
        assert _metric(service, "pdmesh_eplb_reports_total", group=key.name, outcome="dropped") == 1
        # Under version 1 (with its map) the counts count again.
        v1 = service.servicer.groups[key].placement.physical_to_logical
        ack = await stub.ReportExpertLoad(_report([1] * LAYERS * PHYSICAL, version=1, p2l=v1))
        assert ack.accepted and len(service.servicer.groups[key].window) == 1


@async_test
async def test_a_report_under_a_newer_version_is_adopted() -> None:
    """A controller that restarted without Redis learns the workers' version from their reports."""
    async with _controller() as (service, stub):
        mine = [list(reversed(row)) for row in initial_placement(LAYERS, LOGICAL, PHYSICAL)]
        ack = await stub.ReportExpertLoad(_report(_hot_counts([0]), version=7, p2l=mine))
        assert ack.accepted and ack.placement_version == 7
        got = await stub.GetPlacement(_request())
        assert got.version == 7 and _rows(got) == mine
        # The counts were mapped through the worker's map: physical slot 0 holds logical expert 3 there.
        group = service.servicer.groups[next(iter(service.servicer.groups))]
        assert group.window_load()[0][0][mine[0][0]] == 400 + 5


@async_test
async def test_one_rank_gains_nothing_unless_the_threshold_allows_it() -> None:
    """Balancedness over one rank is always 1.0: the default threshold publishes nothing; a negative one
    publishes the replicas of the hot experts."""
    one = dict(num_ranks=1)
    async with _controller() as (service, stub):
        await stub.ReportExpertLoad(_report(_hot_counts([5]), **one))
        [(_, decision)] = await service.servicer.rebalance_once()
        assert (
            decision.outcome == "no_gain" and decision.balancedness_before == decision.balancedness_after == 1
        )
    async with _controller(_settings(min_improvement=-1.0)) as (service, stub):
        await stub.ReportExpertLoad(_report(_hot_counts([5]), **one))
        [(_, decision)] = await service.servicer.rebalance_once()
        assert decision.outcome == "published"
        rows = _rows(await stub.GetPlacement(_request(**one)))
        assert all(row.count(5) == 1 + PHYSICAL - LOGICAL for row in rows)
        assert all(row[:LOGICAL] == list(range(LOGICAL)) for row in rows)  # experts kept their slots


@async_test
async def test_too_few_tokens_publish_nothing() -> None:
    async with _controller(_settings(min_window_tokens=10_000)) as (service, stub):
        await stub.ReportExpertLoad(_report(_hot_counts([4, 5])))
        [(_, decision)] = await service.servicer.rebalance_once()
        assert decision.outcome == "too_few_tokens"
        assert (await stub.GetPlacement(_request())).version == 0


@async_test
async def test_the_rebalance_loop_publishes_on_its_own() -> None:
    async with _controller(_settings(rebalance_interval_s=0.1)) as (service, stub):
        watch = stub.WatchPlacement(_request(after_version=0))  # only versions after 0
        await stub.ReportExpertLoad(_report(_hot_counts([4, 5])))
        placement = await asyncio.wait_for(watch.read(), 10)
        assert placement.version == 1
        watch.cancel()


@async_test
async def test_bad_input_is_refused_with_its_status() -> None:
    async with _controller() as (service, stub):

        async def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            return info.value.code(), info.value.details()

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        code, msg = await code_of(stub.ReportExpertLoad(_report([1, 2, 3])))
        assert code == invalid and "counts has 3 values" in msg
        code, msg = await code_of(stub.ReportExpertLoad(_report(_hot_counts([0]), num_ranks=5)))
        assert code == invalid and "do not divide over 5" in msg
        code, msg = await code_of(stub.ReportExpertLoad(_report(_hot_counts([0]), rank=3)))
        assert code == invalid and "ep_rank 3" in msg
        code, msg = await code_of(stub.ReportExpertLoad(_report(_hot_counts([0]), model_fingerprint="")))
        assert code == invalid and "model_fingerprint" in msg
        bad_map = [[0] * PHYSICAL for _ in range(LAYERS)]
        code, msg = await code_of(stub.ReportExpertLoad(_report(_hot_counts([0]), version=2, p2l=bad_map)))
        assert code == invalid and "without a replica" in msg
        code, msg = await code_of(stub.GetPlacement(_request()))
        assert code == grpc.StatusCode.NOT_FOUND and "no worker of it has reported" in msg
        code, msg = await code_of(stub.GetPlacement(eplb_pb2.PlacementRequest(model_fingerprint="nope")))
        assert code == grpc.StatusCode.NOT_FOUND
        # The model's only group is found by its fingerprint alone; with two groups that is ambiguous.
        await stub.ReportExpertLoad(_report(_hot_counts([0])))
        assert (await stub.GetPlacement(eplb_pb2.PlacementRequest(model_fingerprint=FP))).version == 0
        await stub.ReportExpertLoad(_report(_hot_counts([0]), pool="prefill"))
        code, msg = await code_of(stub.GetPlacement(eplb_pb2.PlacementRequest(model_fingerprint=FP)))
        assert code == invalid and "2 placement groups" in msg
        got = await stub.GetPlacement(eplb_pb2.PlacementRequest(model_fingerprint=FP, pool="prefill"))
        assert got.pool == "prefill"


@needs_redis
@async_test
async def test_placements_persist_in_redis_and_the_controller_registers() -> None:
    prefix = f"pdmesh:eplb-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        settings = _settings(redis_url=REDIS_URL, redis_key_prefix=prefix, registry_ttl_s=2.0)
        async with _controller(settings) as (service, stub):
            directory = ControllerDirectory(redis_url=REDIS_URL)
            try:
                assert await until(lambda: directory.resolve(), 5)
                found = await directory.resolve()
                # Another controller may be registered by a test running beside this one; ours is listed.
                from mesh.eplb_client import EPLB_REGISTRY_MODEL, EPLB_ROLE
                from mesh.registry import RedisRegistry

                registry = RedisRegistry(REDIS_URL)
                listed = await registry.list_workers(role=EPLB_ROLE, model_fingerprint=EPLB_REGISTRY_MODEL)
                await registry.aclose()
                assert service.address in {w.address for w in listed} and found
            finally:
                await directory.aclose()
            await stub.ReportExpertLoad(_report(_hot_counts([4, 5])))
            [(key, decision)] = await service.servicer.rebalance_once()
            assert decision.outcome == "published"
            saved = _rows(await stub.GetPlacement(_request()))
            keys = {k.decode() for k in client.keys(f"{prefix}:*")}
            assert keys == {f"{prefix}:groups", f"{prefix}:group:{key.digest}"}
        settings.min_improvement = -1.0  # any different placement: the version must go on from 1
        async with _controller(settings) as (service, stub):
            got = await stub.GetPlacement(_request())  # known at once, before any report
            assert got.version == 1 and _rows(got) == saved
            ack = await stub.ReportExpertLoad(_report(_hot_counts([4, 5])))  # a version-0 report: old
            assert not ack.accepted and ack.placement_version == 1
            await stub.ReportExpertLoad(_report(_hot_counts([6, 7]), version=1, p2l=saved))
            [(_, decision)] = await service.servicer.rebalance_once()
            assert decision.outcome == "published" and decision.placement.version == 2
    finally:
        for k in client.keys(f"{prefix}:*"):
            client.delete(k)
        assert not client.keys(f"{prefix}:*")
        client.close()
