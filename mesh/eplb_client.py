"""A MoE worker's side of EPLB: report expert load to the controller, apply the placements it publishes.

``EPLBClient`` runs two background tasks beside a worker's engine (``mesh.worker_service`` spawns them
when the engine runs a MoE model with ``enable_eplb``):

- ``report_loop``: every ``report_interval_s``, one engine-thread call takes the counts since the last
  take (``take_expert_counts``), the placement version and map they were measured under, and sends them
  as an ``ExpertLoadReport``. A window with no tokens is not sent.
- ``watch_loop``: ``WatchPlacement`` for the worker's placement group; each newer placement goes to the
  engine (``set_expert_placement``, on the engine thread; with several expert-parallel ranks the engine
  stages it and the group applies it together).

The controller is found at ``address`` or, without one, in the service registry (role ``eplb``). While it
is down, or cannot be found, both loops log, count (``pdmesh_<role>_eplb_errors_total``) and retry with
backoff; requests never wait on it and never fail because of it.

The engine is handed in duck-typed (an ``AsyncEngine``: ``call`` and ``engine``); this module does not
import ``engine`` or any service package.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from redis.exceptions import RedisError

from mesh.expert_placement import MoELayout, PlacementError
from mesh.grpc_server import insecure_channel
from mesh.telemetry import ServiceMetrics
from protos.pdmesh.v1 import eplb_pb2, eplb_pb2_grpc

log = logging.getLogger(__name__)

# The controller's registry entry: role ``eplb``, under this pseudo-model (it serves every model).
EPLB_ROLE = "eplb"
EPLB_REGISTRY_MODEL = "any-model"

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0


class EPLBClientMetrics:
    """``pdmesh_<role>_eplb_*`` on the worker's registry."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.version = metrics.gauge(
            "eplb_placement",
            "version",
            "The expert placement version the MoE layers run (0: the initial one).",
        )
        self.applied = metrics.counter(
            "eplb_placements_applied", "total", "Expert placements from the EPLB controller that took effect."
        )
        self.rejected = metrics.counter(
            "eplb_placements_rejected", "total", "Placements the engine refused (they did not fit the model)."
        )
        self.reports = metrics.counter(
            "eplb_reports", "total", "Expert load reports by outcome: accepted, dropped (an old placement's).",
            ["outcome"],
        )  # fmt: skip
        self.errors = metrics.counter(
            "eplb_errors",
            "total",
            "Failed calls to the EPLB controller (down, not found, refused), by call: report, watch.",
            ["call"],
        )
        self.connected = metrics.gauge(
            "eplb_connected", "bool", "1 while a WatchPlacement stream to the controller is open."
        )


class ControllerDirectory:
    """Where the controller listens: a fixed address, or the registry's first live ``eplb`` entry."""

    def __init__(self, address: str | None = None, redis_url: str | None = None) -> None:
        if not address and not redis_url:
            raise ValueError("the EPLB controller needs an address or a Redis URL to discover it")
        self.address = address
        self.redis_url = redis_url
        self._registry: Any = None

    async def resolve(self) -> str | None:
        if self.address:
            return self.address
        if self._registry is None:
            from mesh.registry import RedisRegistry

            self._registry = RedisRegistry(self.redis_url)  # type: ignore[arg-type]
        live = [
            w for w in await self._registry.list_workers(role=EPLB_ROLE, model_fingerprint=EPLB_REGISTRY_MODEL)
            if not w.draining
        ]  # fmt: skip
        return live[0].address if live else None

    async def aclose(self) -> None:
        if self._registry is not None:
            await self._registry.aclose()


class EPLBClient:
    def __init__(
        self,
        aengine: Any,
        directory: ControllerDirectory,
        *,
        worker_id: str,
        model_fingerprint: str,
        pool: str,
        layout: MoELayout,
        metrics: EPLBClientMetrics,
        report_interval_s: float = 5.0,
    ) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.directory = directory
        self.worker_id = worker_id
        self.model_fingerprint = model_fingerprint
        self.pool = pool
        self.layout = layout
        self.metrics = metrics
        self.report_interval_s = report_interval_s
        self.last_version = 0
        self._channel: grpc.aio.Channel | None = None
        self._channel_address: str | None = None

    async def _stub(self) -> eplb_pb2_grpc.EPLBStub:
        address = await self.directory.resolve()
        if address is None:
            raise LookupError("no EPLB controller is registered (role eplb)")
        if address != self._channel_address:
            if self._channel is not None:
                await self._channel.close()
            self._channel = insecure_channel(address)
            self._channel_address = address
        return eplb_pb2_grpc.EPLBStub(self._channel)

    def _placement_request(self) -> eplb_pb2.PlacementRequest:
        k = self.layout
        return eplb_pb2.PlacementRequest(
            model_fingerprint=self.model_fingerprint,
            num_layers=k.num_layers,
            num_physical_experts=k.num_physical,
            num_logical_experts=k.num_logical,
            num_ranks=k.num_ranks,
            pool=self.pool,
        )

    def _observe_version(self, version: int) -> None:
        if version > self.last_version:
            self.metrics.applied.inc()
            log.info("expert placement version %d is running", version)
        self.last_version = max(self.last_version, version)
        self.metrics.version.set(version)

    # ---- reporting -------------------------------------------------------------------------------
    def _take(self) -> tuple[Any, int, list[list[int]] | None, int]:
        """On the engine thread: counts, the version and map they were measured under, and the engine's
        forward passes so far (the report's ``step``), together."""
        eng = self.engine
        s = eng.stats()
        steps = sum(getattr(s, f"{kind}_passes", 0) for kind in ("decode_graph", "prefill_graph", "eager"))
        return eng.take_expert_counts(), eng.placement_version, eng.expert_placement(), steps

    async def report_once(self) -> bool | None:
        """Take and send one report; the controller's verdict (accepted), or None when nothing was sent."""
        counts, version, p2l, steps = await self.aengine.call(self._take)
        self._observe_version(version)
        if counts is None:
            return None
        flat = [int(x) for x in counts.reshape(-1).tolist()]
        if not any(flat):
            return None
        k = self.layout
        report = eplb_pb2.ExpertLoadReport(
            worker_id=self.worker_id,
            model_fingerprint=self.model_fingerprint,
            ep_rank=k.rank,
            step=steps,
            num_layers=k.num_layers,
            num_physical_experts=k.num_physical,
            counts=flat,
            placement_version=version,
            num_logical_experts=k.num_logical,
            num_ranks=k.num_ranks,
            pool=self.pool,
            physical_to_logical=[e for row in (p2l or []) for e in row],
        )
        stub = await self._stub()
        ack = await stub.ReportExpertLoad(report, timeout=10.0)
        self.metrics.reports.labels(outcome="accepted" if ack.accepted else "dropped").inc()
        return ack.accepted

    async def report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            try:
                await self.report_once()
            except (grpc.aio.AioRpcError, LookupError, RedisError, OSError) as exc:
                # The window's counts are lost; the next report measures afresh.
                self.metrics.errors.labels(call="report").inc()
                log.warning(
                    "EPLB load report failed (%s); next in %.1fs", _describe(exc), self.report_interval_s
                )

    # ---- placements ------------------------------------------------------------------------------
    async def apply(self, placement: eplb_pb2.Placement) -> bool:
        """Hand one placement to the engine (False: refused as not fitting, logged and counted)."""
        k = self.layout
        n = placement.num_physical_experts
        flat = list(placement.physical_to_logical)
        rows = [flat[i * n : (i + 1) * n] for i in range(placement.num_layers)]
        version = placement.version
        try:
            await self.aengine.call(lambda: self.engine.set_expert_placement(version, rows))
        except PlacementError as exc:
            self.metrics.rejected.inc()
            log.error("EPLB placement version %d refused: %s (layout %s)", version, exc, k)
            return False
        log.info("EPLB placement version %d handed to the engine", version)
        if k.num_ranks == 1:
            self._observe_version(await self.aengine.call(lambda: self.engine.placement_version))
        return True

    async def watch_once(self) -> None:
        """One WatchPlacement stream, from the engine's version on, until it ends or fails."""
        stub = await self._stub()
        request = self._placement_request()
        request.after_version = await self.aengine.call(lambda: self.engine.placement_version)
        call = stub.WatchPlacement(request)
        self.metrics.connected.set(1)
        try:
            async for placement in call:
                await self.apply(placement)
        finally:
            self.metrics.connected.set(0)
            call.cancel()

    async def watch_loop(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        backoff = BACKOFF_START_S
        while True:
            started = time.monotonic()
            try:
                await self.watch_once()
                reason = "stream ended"
            except (grpc.aio.AioRpcError, LookupError, RedisError, OSError) as exc:
                reason = _describe(exc)
            self.metrics.errors.labels(call="watch").inc()
            if time.monotonic() - started > BACKOFF_MAX_S:
                backoff = BACKOFF_START_S  # it ran a while: start the backoff over
            log.warning("EPLB placement watch: %s; retrying in %.1fs", reason, backoff)
            await sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        await self.directory.aclose()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def start_eplb_client(
    aengine: Any,
    spawn: Callable[[Any, str], Any],
    metrics: ServiceMetrics,
    *,
    role: str,
    worker_id: str,
    address: str | None,
    redis_url: str | None,
    pool: str | None,
    report_interval_s: float,
) -> EPLBClient | None:
    """Start the report and watch tasks (through ``spawn(coro, name)``) for an engine with EPLB on; None
    (and nothing started) for a dense engine, without ``enable_eplb``, or with no way to reach a
    controller (logged)."""
    engine = aengine.engine
    if not getattr(engine.config, "enable_eplb", False):
        return None
    layout, version = await aengine.call(lambda: (engine.moe_layout(), engine.placement_version))
    if layout is None:
        return None
    if not address and not redis_url:
        log.warning("enable_eplb without --eplb-address or --redis-url: no EPLB controller to report to")
        return None
    client = EPLBClient(
        aengine,
        ControllerDirectory(address, redis_url),
        worker_id=worker_id,
        model_fingerprint=engine.model_fingerprint,
        pool=pool or role,
        layout=layout,
        metrics=EPLBClientMetrics(metrics),
        report_interval_s=report_interval_s,
    )
    client.metrics.version.set(version)
    spawn(client.report_loop(), f"{role}-eplb-report")
    spawn(client.watch_loop(), f"{role}-eplb-watch")
    return client
