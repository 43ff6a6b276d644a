"""What both worker roles share (``mesh.worker_service``), in process: the tasks a worker servicer starts
are kept until they end, their failures are logged, and ``close`` leaves none running; a request refused
before any of it ran says so in its status's trailing metadata."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.servicer import DecodeServicer
from mesh.grpc_server import insecure_channel, start_server
from mesh.worker_service import (
    REFUSAL_KEY,
    EventFanout,
    WorkerMetrics,
    WorkerServicerBase,
    WorkerSettings,
    refusal_of,
)
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.orchestrator import _kv_untouched
from tests.mesh_fixtures import async_test


def servicer(cls: type[WorkerServicerBase] = WorkerServicerBase, alive: bool = True) -> WorkerServicerBase:
    """A servicer whose engine is never called: draining, refusing and closing do not touch it."""
    engine = SimpleNamespace(engine=None, alive=alive)
    return cls(engine, None, WorkerSettings(), "w-test", "", EventFanout("w-test"), WorkerMetrics("decode"))


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


@pytest.mark.parametrize(
    ("draining", "alive", "refusal"),
    [(True, True, "REFUSAL_DRAINING"), (False, False, "REFUSAL_ENGINE_DOWN")],
)
@async_test
async def test_a_refused_decode_says_so_in_its_trailing_metadata(
    draining: bool, alive: bool, refusal: str
) -> None:
    """The worker's own refusal, over real gRPC: UNAVAILABLE with the pdmesh-refusal trailer, which is what
    lets the router give the request's KV handle to another decode worker."""
    s = servicer(DecodeServicer, alive=alive)
    s.draining = draining
    server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, s)], ["pdmesh.v1.Worker"]
    )
    try:
        async with insecure_channel(f"127.0.0.1:{port}") as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Decode(
                worker_pb2.DecodeRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
        exc = caught.value
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert (REFUSAL_KEY, refusal) in list(exc.trailing_metadata())
        assert refusal_of(exc) == worker_pb2.Refusal.Value(refusal)
        assert _kv_untouched(exc)
    finally:
        await server.stop(0)


def test_worker_knows_the_engines_kinds_of_forward_pass() -> None:
    """mesh does not import engine: the worker's list of pass kinds must equal the runner's."""
    from engine.model_runner import PASS_KINDS
    from mesh.worker_service import FORWARD_PASS_KINDS

    assert FORWARD_PASS_KINDS == PASS_KINDS


def test_worker_counters_follow_the_engines_running_totals() -> None:
    """Each counter that mirrors an engine total (tokens, cached tokens, lookahead steps and drains) ends
    equal to the last total it saw, however many steps reported it."""
    from engine.llm_engine import EngineStats

    metrics = WorkerMetrics("decode")
    base = dict(num_waiting=0, num_running=1, num_held=0, running_tokens=0, queued_tokens=0,
                num_kv_blocks_total=8, num_kv_blocks_free=5, num_preemptions=0)  # fmt: skip
    for step, (prompt, cached, generated, ahead, drains) in enumerate([(10, 4, 1, 0, 0), (10, 4, 7, 5, 1)]):
        passes = {"decode_graph": 3 * step, "prefill_graph": 1 + step, "eager": 2}
        metrics.update_from(EngineStats(**base, prompt_tokens_total=prompt, cached_prompt_tokens_total=cached,
                                        generated_tokens_total=generated, lookahead_steps=ahead,
                                        lookahead_drains=drains,
                                        **{f"{k}_passes": n for k, n in passes.items()}))  # fmt: skip
        sample = metrics.registry.get_sample_value
        assert sample("pdmesh_decode_prompt_tokens_tokens_total") == prompt, step
        assert sample("pdmesh_decode_prompt_tokens_cached_tokens_total", {"tier": "gpu"}) == cached, step
        assert sample("pdmesh_decode_generation_tokens_tokens_total") == generated, step
        assert sample("pdmesh_decode_lookahead_steps_total") == ahead, step
        assert sample("pdmesh_decode_lookahead_drains_total") == drains, step
        for kind, n in passes.items():
            assert sample("pdmesh_decode_forward_passes_total", {"kind": kind}) == n, (step, kind)
    assert metrics.registry.get_sample_value("pdmesh_decode_kv_blocks_used_blocks") == 3


def test_cache_config_info_labels_the_engines_kv_cache() -> None:
    """``pdmesh_<role>_cache_config_info`` (value 1) carries the engine's KV cache configuration as labels,
    vLLM's cache_config_info for the same dashboards: block size, cache dtype, blocks, whether KV scales
    from the checkpoint are in use, prefix caching."""
    from engine import LLM
    from mesh.worker_service import CACHE_INFO_LABELS

    for kv_cache_dtype, dtype_name in (("auto", "float32"), ("fp8", "float8_e4m3fn")):
        engine = LLM("tiny-dense", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=24, block_size=8).engine
        info = engine.cache_info()
        assert tuple(info) == CACHE_INFO_LABELS
        metrics = WorkerMetrics("prefill")
        metrics.set_cache_info(info)
        labels = {"block_size": "8", "cache_dtype": dtype_name, "num_blocks": "24", "kv_scales": "none",
                  "prefix_caching": "true", "gpu_memory_utilization": ""}  # fmt: skip
        assert metrics.registry.get_sample_value("pdmesh_prefill_cache_config_info", labels) == 1


def test_sampling_kwargs_carry_the_priority() -> None:
    """common.proto's priority reaches the engine's SamplingParams (0, the default, is left out)."""
    from mesh.worker_service import sampling_kwargs

    assert sampling_kwargs(common_pb2.SamplingParams(priority=-4))["priority"] == -4
    assert "priority" not in sampling_kwargs(common_pb2.SamplingParams())
