"""Telemetry and gRPC plumbing over real sockets: trace context across gRPC (in one process and across
two), /metrics over HTTP, health checking, reflection and status mapping on a ``start_server`` server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace

from mesh import telemetry
from mesh.grpc_server import (
    ServerStartError,
    StatusError,
    abort_with,
    check_health,
    insecure_channel,
    service_name,
    set_serving,
    start_server,
    status_for,
    wait_for_health,
)
from mesh.kv_layout import LayoutMismatchError
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = service_name(worker_pb2, "Worker")


class StatsOnlyWorker(worker_pb2_grpc.WorkerServicer):
    """Serves GetStats (in a server span) and Abort; every other RPC is the generated UNIMPLEMENTED."""

    async def GetStats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        with telemetry.server_span("Worker/GetStats", context.invocation_metadata()):
            return common_pb2.WorkerStats(worker_id="w0", role=common_pb2.WORKER_ROLE_DECODE)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        await abort_with(
            context, grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} on this worker"
        )


async def _start_worker() -> tuple[grpc.aio.Server, int]:
    return await start_server([(worker_pb2_grpc.add_WorkerServicer_to_server, StatsOnlyWorker())], [WORKER])


def test_client_and_server_spans_share_a_trace() -> None:
    tracing = telemetry.setup_tracing("pdmesh-test", in_memory=True)

    async def main() -> None:
        server, port = await _start_worker()
        try:
            async with insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                with telemetry.get_tracer("test").start_as_current_span("client", kind=trace.SpanKind.CLIENT):
                    stats = await stub.GetStats(
                        worker_pb2.StatsRequest(), metadata=telemetry.inject_metadata()
                    )
                assert stats.worker_id == "w0"
                await stub.GetStats(worker_pb2.StatsRequest())  # no trace context sent
        finally:
            await server.stop(None)

    asyncio.run(main())
    spans = tracing.finished_spans()
    client = next(s for s in spans if s.name == "client")
    server_spans = [s for s in spans if s.name == "Worker/GetStats"]
    assert len(server_spans) == 2
    joined, orphan = server_spans
    assert joined.context.trace_id == client.context.trace_id
    assert joined.parent is not None and joined.parent.span_id == client.context.span_id
    assert joined.kind == trace.SpanKind.SERVER
    assert joined.resource.attributes["service.name"] == "pdmesh-test"
    # Without metadata the server starts a trace of its own.
    assert orphan.parent is None and orphan.context.trace_id != client.context.trace_id
    tracing.shutdown()


_SERVER_PROCESS = textwrap.dedent(
    """
    import asyncio, sys
    from mesh import telemetry
    from mesh.grpc_server import service_name, start_server
    from protos.pdmesh.v1 import worker_pb2, worker_pb2_grpc
    from tests.test_telemetry import StatsOnlyWorker

    async def main():
        telemetry.setup_tracing("test-server", jsonl_path=sys.argv[1])
        server, port = await start_server(
            [(worker_pb2_grpc.add_WorkerServicer_to_server, StatsOnlyWorker())], [service_name(worker_pb2, "Worker")])
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
    """
)


def test_trace_crosses_processes_into_one_jsonl_file(tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_PROCESS, str(trace_file)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        tracing = telemetry.setup_tracing("test-client", jsonl_path=trace_file)

        async def call() -> None:
            async with insecure_channel(f"127.0.0.1:{port}") as channel:
                with telemetry.get_tracer("test").start_as_current_span("router/Generate"):
                    await worker_pb2_grpc.WorkerStub(channel).GetStats(
                        worker_pb2.StatsRequest(), metadata=telemetry.inject_metadata(), timeout=10
                    )

        asyncio.run(call())
        tracing.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
    records = telemetry.read_spans_jsonl(trace_file)
    by_service = {r["service"]: r for r in records}
    assert set(by_service) == {"test-client", "test-server"}
    client, server = by_service["test-client"], by_service["test-server"]
    assert server["trace_id"] == client["trace_id"]
    assert server["parent_id"] == client["span_id"] and client["parent_id"] is None
    assert server["name"] == "Worker/GetStats" and server["kind"] == "SERVER"
    assert server["start_ns"] <= server["end_ns"]


def test_metrics_are_named_and_served_over_http() -> None:
    metrics = telemetry.ServiceMetrics("router", registry=telemetry.new_registry())
    requests = metrics.counter("requests", "total", "Requests received.", labelnames=["status"])
    assert metrics.counter("requests", "total", "Requests received.", labelnames=["status"]) is requests
    ttft = metrics.histogram("time_to_first_token", "seconds", "Time to first token.", buckets=[0.1, 1.0])
    requests.labels(status="ok").inc(3)
    ttft.observe(0.5)

    async def scrape() -> tuple[str, str, str, int]:
        port = await telemetry.start_metrics_server(metrics.registry, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text, ctype = await resp.text(), resp.headers["Content-Type"]
                headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
                async with http.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as resp:
                    openmetrics = await resp.text()
                async with http.get(f"http://127.0.0.1:{port}/nothing") as resp:
                    missing = resp.status
        finally:
            await telemetry.stop_metrics_server(port)
        return text, ctype, openmetrics, missing

    text, ctype, openmetrics, missing = asyncio.run(scrape())
    assert ctype.startswith("text/plain")
    assert 'pdmesh_router_requests_total{status="ok"} 3.0' in text
    assert 'pdmesh_router_time_to_first_token_seconds_bucket{le="1.0"} 1.0' in text
    assert "process_cpu_seconds_total" in text  # the per-process registry carries process metrics
    assert openmetrics.rstrip().endswith("# EOF")
    assert missing == 404


def test_metric_names_are_checked() -> None:
    assert telemetry.metric_name("decode", "kv_transfer", "bytes") == "pdmesh_decode_kv_transfer_bytes"
    for bad in [
        ("Router", "requests", "total"),
        ("router", "requests-sent", "total"),
        ("router", "x_", "total"),
        ("router", "requests", ""),
    ]:
        with pytest.raises(ValueError, match="lower snake case"):
            telemetry.metric_name(*bad)
    metrics = telemetry.ServiceMetrics("prefill", registry=telemetry.new_registry(process_metrics=False))
    metrics.gauge("running", "requests", "Running requests.")
    with pytest.raises(ValueError, match="already exists as a Gauge"):
        metrics.counter("running", "requests", "Running requests.")


def test_health_reflection_and_statuses_on_a_started_server() -> None:
    async def main() -> None:
        server, port = await _start_worker()
        address = f"127.0.0.1:{port}"
        try:
            await wait_for_health(address, WORKER, timeout=5)
            async with insecure_channel(address) as channel:
                assert await check_health(channel, "") == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await check_health(channel, "pdmesh.v1.Nothing")
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

                stub = worker_pb2_grpc.WorkerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as other_role:
                    await stub.Prefill(worker_pb2.PrefillRequest(request_id="r"))
                assert other_role.value.code() == grpc.StatusCode.UNIMPLEMENTED
                with pytest.raises(grpc.aio.AioRpcError) as aborted:
                    await stub.Abort(worker_pb2.AbortRequest(request_id="r9"))
                assert aborted.value.code() == grpc.StatusCode.NOT_FOUND and "'r9'" in aborted.value.details()

                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=WORKER),
                ]
                replies = [r async for r in reflect.ServerReflectionInfo(iter(requests))]
                names = {s.name for s in replies[0].list_services_response.service}
                assert {WORKER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
                files = [
                    descriptor_pb2.FileDescriptorProto.FromString(b)
                    for b in replies[1].file_descriptor_response.file_descriptor_proto
                ]
                worker_file = next(f for f in files if f.name == "protos/pdmesh/v1/worker.proto")
                assert "Decode" in {m.name for m in worker_file.service[0].method}

                await set_serving(server, False)  # drain
                assert await check_health(channel, WORKER) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await check_health(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(TimeoutError, match="NOT_SERVING"):
                    await wait_for_health(address, WORKER, timeout=0.3)
                await set_serving(server, True)
                await wait_for_health(address, WORKER, timeout=2)
        finally:
            await server.stop(None)
        with pytest.raises(TimeoutError, match="UNAVAILABLE"):
            await wait_for_health(address, WORKER, timeout=0.3)

    asyncio.run(main())


def test_taken_port_is_a_clear_error() -> None:
    async def main() -> None:
        server, port = await _start_worker()
        try:
            with pytest.raises(ServerStartError, match=f"127.0.0.1:{port}"):
                await start_server([], [], port=port)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_errors_map_to_statuses() -> None:
    assert status_for(StatusError(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt too long",
    )
    assert status_for(LayoutMismatchError("fingerprints differ"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED

    class NamedStatusError(ValueError):  # how the engine's typed errors carry their status
        status = "RESOURCE_EXHAUSTED"

    assert status_for(NamedStatusError("KV pool full")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "KV pool full",
    )
    NamedStatusError.status = "NOT_A_STATUS_CODE"
    assert status_for(NamedStatusError("x"))[0] == grpc.StatusCode.INTERNAL
    code, message = status_for(KeyError("x"))
    assert code == grpc.StatusCode.INTERNAL and message.startswith("KeyError")
