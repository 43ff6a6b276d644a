"""gRPC plumbing every pdmesh service shares: server start-up, channels, health, errors.

``start_server`` gives each service the same server: health checking (``grpc.health.v1``) with every
service SERVING until ``set_serving(server, False)`` (drain), server reflection, 64 MiB messages,
keepalive, and a clear error when the port is taken. ``insecure_channel`` opens client channels with
matching options; ``wait_for_health`` polls a service until it is SERVING (launchers, tests).
``status_for`` maps errors to gRPC statuses and ``abort_with`` ends an RPC with one, with a message
that says what to do.

It knows no service: servicers and their service names come from the caller.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh.kv_layout import LayoutMismatchError

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive: clients ping idle connections every 30 s so a dead peer (a killed worker) breaks its
# long-lived streams (Decode, StreamKVEvents) within ~40 s; servers accept pings that often.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    # Two processes must not share a port silently: a taken port is an error, not a load balancer.
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# A generated ``add_XServicer_to_server`` function and the servicer it registers.
AddServicerFn = Callable[[Any, grpc.aio.Server], None]

_health_by_server: weakref.WeakKeyDictionary[grpc.aio.Server, tuple[health.aio.HealthServicer, list[str]]] = (
    weakref.WeakKeyDictionary()
)


class ServerStartError(RuntimeError):
    """The server could not bind its address (port taken, bad host)."""


def service_name(pb2_module: Any, service: str) -> str:
    """Fully qualified name of ``service`` in a generated module, e.g. ``pdmesh.v1.Worker``."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def start_server(
    servicers: Sequence[tuple[AddServicerFn, Any]],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    options: Sequence[tuple[str, Any]] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    reflection_enabled: bool = True,
) -> tuple[grpc.aio.Server, int]:
    """Build, bind and start a grpc.aio server; return it and its bound port (``port=0``: a free one).

    ``servicers`` pairs each generated ``add_*_to_server`` with its servicer; ``service_names`` are
    their full names (``service_name(worker_pb2, "Worker")``), reported SERVING by the health service
    (and the overall ``""`` service) and listed by reflection.
    """
    server = grpc.aio.server(
        options=list(options if options is not None else SERVER_OPTIONS),
        interceptors=list(interceptors or []),
    )
    for add_fn, servicer in servicers:
        add_fn(servicer, server)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _health_by_server[server] = (health_servicer, names)

    if reflection_enabled:
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise ServerStartError(
            f"cannot listen on {address}: {exc}; is another process using the port?"
        ) from exc
    if bound == 0:
        raise ServerStartError(f"cannot listen on {address}; is another process using the port?")
    await server.start()
    return server, bound


async def set_serving(server: grpc.aio.Server, serving: bool) -> None:
    """Flip every service of a ``start_server`` server (and the overall ``""``) SERVING / NOT_SERVING.

    Drain sets NOT_SERVING so routers and launchers stop sending new work; in-flight RPCs go on.
    """
    try:
        health_servicer, names = _health_by_server[server]
    except KeyError:
        raise ValueError("set_serving needs a server made by mesh.grpc_server.start_server") from None
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def insecure_channel(address: str, options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A grpc.aio client channel to ``address`` (``host:port``) with the mesh's options."""
    return grpc.aio.insecure_channel(
        address, options=list(options if options is not None else CHANNEL_OPTIONS)
    )


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> int:
    """One health check; returns the ``HealthCheckResponse.ServingStatus``. Raises ``grpc.aio.AioRpcError``."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return reply.status


async def wait_for_health(
    address: str, service: str = "", timeout: float = 30.0, interval: float = 0.05
) -> None:
    """Poll ``address`` until ``service`` is SERVING; ``TimeoutError`` saying the last answer otherwise."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    async with insecure_channel(address) as channel:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{address} service {service!r} not SERVING after {timeout:.1f}s (last: {last})"
                )
            try:
                status = await check_health(channel, service, timeout=min(1.0, max(remaining, 0.01)))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0)))


# --- errors -----------------------------------------------------------------------------------------


class StatusError(Exception):
    """An error that knows its gRPC status; service code raises it, the servicer edge aborts with it (and
    with ``trailing_metadata``, for callers that need more than the code: ``mesh.worker_service``'s
    refusals)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception surfaces as. An error with a ``status`` attribute naming a status code
    (the engine's typed errors) surfaces as that code. Unknown errors are INTERNAL, named by their type."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, LayoutMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    name = getattr(exc, "status", None)
    if isinstance(name, str) and isinstance(code := getattr(grpc.StatusCode, name, None), grpc.StatusCode):
        return code, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the RPC with ``code`` and ``message`` (raises; nothing after it runs)."""
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


async def wait_for_stop_signal() -> None:
    """Return once the process gets SIGTERM or SIGINT (a service's main task waits here, then stops)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
