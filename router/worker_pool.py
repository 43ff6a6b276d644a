"""The workers a router sends requests to: one gRPC channel each, their last stats, and whether they answer.

A background task polls every worker's ``GetStats`` (``stats_interval_s``); a worker that answers is
``up``, one that does not (or fails a request with UNAVAILABLE) is ``down`` until a poll finds it again.
Workers announcing another block size or model fingerprint than the pool's are excluded, with a log line.
This module knows where workers are and how they are doing; it does not choose among them
(``router.chooser``) and does not run requests (``router.orchestrator``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from mesh.grpc_server import CHANNEL_OPTIONS, insecure_channel
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"

# gRPC's default reconnect backoff grows to 120 s: a worker restarted after a failure would be refused
# for up to two minutes. Workers are on the local network; retry connecting often.
WORKER_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet: worth a try
    UP = "up"
    DOWN = "down"


@dataclass
class WorkerEndpoint:
    """One worker as the router sees it."""

    address: str
    role: str  # PREFILL | DECODE
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health: Health = Health.UNKNOWN
    stats: common_pb2.WorkerStats | None = None
    last_error: str = ""
    excluded_reason: str = ""  # set when the worker serves another model or block size
    last_seen: float = field(default=0.0)

    @property
    def name(self) -> str:
        """The worker's id once it has announced one, its address before."""
        return self.stats.worker_id if self.stats is not None and self.stats.worker_id else self.address

    @property
    def usable(self) -> bool:
        draining = self.stats is not None and self.stats.draining
        return self.health is not Health.DOWN and not draining and not self.excluded_reason


class WorkerPool:
    """The prefill and decode workers named on the command line."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        block_size: int,
        control_timeout_s: float = 5.0,
        stats_interval_s: float = 2.0,
    ) -> None:
        self.block_size = block_size
        self.control_timeout_s = control_timeout_s
        self.stats_interval_s = stats_interval_s
        self.workers: list[WorkerEndpoint] = []
        for role, addresses in ((PREFILL, prefill_addresses), (DECODE, decode_addresses)):
            for address in dict.fromkeys(addresses):  # a repeated address is one worker
                channel = insecure_channel(address, WORKER_CHANNEL_OPTIONS)
                self.workers.append(
                    WorkerEndpoint(address, role, channel, worker_pb2_grpc.WorkerStub(channel))
                )
        self.model_fingerprint: str | None = None
        self._poller: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Poll every worker once (so the first requests see who is up), then keep polling."""
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever(), name="worker-pool-poller")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for w in self.workers:
            await w.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerEndpoint) -> None:
        try:
            stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.mark_down(w, f"GetStats: {exc.code().name}: {exc.details()}")
            return
        self._accept_stats(w, stats)

    def _accept_stats(self, w: WorkerEndpoint, stats: common_pb2.WorkerStats) -> None:
        w.stats = stats
        w.last_seen = time.monotonic()
        reason = ""
        if stats.block_size and stats.block_size != self.block_size:
            reason = f"block_size {stats.block_size} != the router's {self.block_size} (--block-size)"
        elif stats.model_fingerprint:
            if self.model_fingerprint is None:
                self.model_fingerprint = stats.model_fingerprint
            elif stats.model_fingerprint != self.model_fingerprint:
                reason = f"model {stats.model_fingerprint!r} != the mesh's {self.model_fingerprint!r}"
        if reason != w.excluded_reason:
            if reason:
                log.warning("not using %s worker %s: %s", w.role, w.address, reason)
            elif w.excluded_reason:
                log.info("%s worker %s is usable again", w.role, w.address)
        w.excluded_reason = reason
        if w.health is not Health.UP:
            log.info("%s worker %s (%s) is up", w.role, w.address, w.name)
        w.health = Health.UP
        w.last_error = ""

    # ---- state -------------------------------------------------------------------------------------
    def mark_down(self, w: WorkerEndpoint, why: str) -> None:
        if w.health is not Health.DOWN:
            log.warning("%s worker %s is down: %s", w.role, w.address, why)
        w.health = Health.DOWN
        w.last_error = why

    def by_role(self, role: str) -> list[WorkerEndpoint]:
        return [w for w in self.workers if w.role == role]

    def usable(self, role: str, exclude: Sequence[WorkerEndpoint] = ()) -> list[WorkerEndpoint]:
        """Workers of ``role`` that answered their last poll (or were not polled yet), minus ``exclude``."""
        return [w for w in self.by_role(role) if w.usable and w not in exclude]

    def candidates(self, role: str, exclude: Sequence[WorkerEndpoint] = ()) -> list[WorkerEndpoint]:
        """Workers of ``role`` to try: the usable ones; when there are none, the ones that were down (a
        down worker fails a call within milliseconds, and it may be back before the next poll sees it).
        Draining workers and workers of another model or block size are never candidates."""
        usable = self.usable(role, exclude)
        if usable:
            return usable
        return [
            w
            for w in self.by_role(role)
            if w.health is Health.DOWN
            and not w.excluded_reason
            and not (w.stats is not None and w.stats.draining)
            and w not in exclude
        ]

    def describe_unusable(self, role: str) -> str:
        """Why no worker of ``role`` can take a request (for the 503 message)."""
        workers = self.by_role(role)
        if not workers:
            return f"no {role} workers are configured"
        parts = []
        for w in workers:
            if w.excluded_reason:
                parts.append(f"{w.address}: {w.excluded_reason}")
            elif w.stats is not None and w.stats.draining:
                parts.append(f"{w.address}: draining")
            else:
                parts.append(f"{w.address}: {w.last_error or w.health.value}")
        return f"no {role} worker is available ({'; '.join(parts)})"

    def max_model_len(self) -> int | None:
        """The smallest max_model_len the usable workers announce (None before any has answered)."""
        lens = [
            w.stats.max_model_len
            for w in self.workers
            if w.stats is not None and w.stats.max_model_len and not w.excluded_reason
        ]
        return min(lens) if lens else None
