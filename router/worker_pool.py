"""The workers a router sends requests to: one gRPC channel each, their last stats, and whether they answer.

Workers come from the command line (``static``: kept for the router's lifetime) and from the registry
(``router.discovery`` adds and retires them). A background task polls every worker's ``GetStats``
(``stats_interval_s``); a worker that answers is ``up``, one that does not (or fails a request with
UNAVAILABLE) is ``down`` until a poll finds it again. Workers announcing another block size or model
fingerprint than the pool's are excluded, with a log line; draining workers (their stats or their
registration say so) take no new requests. The orchestrator counts what it has sent to each worker
(``in_flight``, ``in_flight_tokens``): load scoring uses it between polls, and a retired worker's channel
is closed only once nothing is in flight on it. Listeners (``on_added``, ``on_removed``) let the KV event
feed follow the pool.

This module knows where workers are and how they are doing; it does not choose among them
(``router.chooser``), does not read the registry (``router.discovery``) and does not run requests
(``router.orchestrator``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from mesh.background import BackgroundTasks
from mesh.grpc_server import CHANNEL_OPTIONS, insecure_channel
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"
KVSTORE = "kvstore"  # a KV offload store's registry role: never a routing target

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


@dataclass(eq=False)  # an endpoint is its identity (one channel): hashable, compared with `is`
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
    static: bool = True  # named on the command line: never retired
    registered_id: str = ""  # its id in the registry, when it came from there
    registry_draining: bool = False  # its registration says it is draining
    missing_since: float | None = None  # when discovery last found it absent from the registry
    in_flight: int = 0  # worker calls of this router on it now (Prefill, Decode)
    in_flight_tokens: int = 0  # prompt tokens of those calls
    in_flight_tokens_at_poll: int = 0  # in_flight_tokens when the last stats arrived
    # The LoRA adapters it serves (name -> PEFT directory): from its stats, and from the replies of the
    # adapter loads and unloads this router sent it. ``lora_version`` counts those changes, so that a poll
    # that began before one does not put the older list back.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_version: int = 0

    @property
    def name(self) -> str:
        """The worker's id once it has announced one (stats, else registry), its address before."""
        if self.stats is not None and self.stats.worker_id:
            return self.stats.worker_id
        return self.registered_id or self.address

    @property
    def draining(self) -> bool:
        return self.registry_draining or (self.stats is not None and self.stats.draining)

    @property
    def usable(self) -> bool:
        return self.health is not Health.DOWN and not self.draining and not self.excluded_reason

    def set_lora_adapters(self, adapters: Sequence[common_pb2.LoRAAdapter]) -> None:
        """What a LoadLoRAAdapter or UnloadLoRAAdapter reply says the worker serves now."""
        self.lora_adapters = {a.name: a.path for a in adapters}
        self.lora_version += 1

    def serves_lora(self, name: str) -> bool:
        return name in self.lora_adapters

    def begin_call(self, tokens: int) -> None:
        self.in_flight += 1
        self.in_flight_tokens += tokens

    def end_call(self, tokens: int) -> None:
        self.in_flight -= 1
        self.in_flight_tokens -= tokens


class WorkerPool:
    """The prefill and decode workers: those named on the command line, and those discovery adds."""

    # Worker ids of the KV offload stores registered for the model (discovery sets them): their KV index
    # entries are every worker's to load, not a routing target.
    kvstore_ids: frozenset[str] = frozenset()

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
        self.on_added: list[Callable[[WorkerEndpoint], None]] = []
        self.on_removed: list[Callable[[WorkerEndpoint], None]] = []
        self._retired: list[WorkerEndpoint] = []  # removed, channel open until nothing is in flight
        self._tasks = BackgroundTasks("worker pool")  # the poller, polls of new workers, channel closes
        for role, addresses in ((PREFILL, prefill_addresses), (DECODE, decode_addresses)):
            for address in addresses:
                if self.find(address) is None:  # a repeated address is one worker
                    self.workers.append(self._endpoint(address, role, static=True))
        self.model_fingerprint: str | None = None
        self._poller: asyncio.Task[None] | None = None

    @staticmethod
    def _endpoint(address: str, role: str, static: bool) -> WorkerEndpoint:
        channel = insecure_channel(address, WORKER_CHANNEL_OPTIONS)
        return WorkerEndpoint(address, role, channel, worker_pb2_grpc.WorkerStub(channel), static=static)

    # ---- membership --------------------------------------------------------------------------------
    def find(self, address: str) -> WorkerEndpoint | None:
        return next((w for w in self.workers if w.address == address), None)

    def add(self, address: str, role: str, registered_id: str = "") -> WorkerEndpoint:
        """A worker found in the registry; polled at once. An address already in the pool is that worker."""
        w = self.find(address)
        if w is not None:
            w.registered_id = registered_id or w.registered_id
            return w
        w = self._endpoint(address, role, static=False)
        w.registered_id = registered_id
        self.workers.append(w)
        log.info("%s worker %s (%s) joined the pool", role, address, registered_id or "no id")
        for listener in self.on_added:
            listener(w)
        if self._poller is not None:  # started: learn its stats now rather than at the next poll
            self._tasks.spawn(self._poll(w), f"poll-{address}")
        return w

    def remove(self, w: WorkerEndpoint, why: str) -> None:
        """Take a discovered worker out of the pool; its channel closes once no call is in flight on it."""
        if w not in self.workers:
            return
        self.workers.remove(w)
        self._retired.append(w)
        log.info("%s worker %s (%s) left the pool: %s", w.role, w.address, w.name, why)
        for listener in self.on_removed:
            listener(w)
        self._tasks.spawn(self._close_retired(), "close-retired-channels")

    async def _close_retired(self) -> None:
        for w in [w for w in self._retired if w.in_flight <= 0]:
            self._retired.remove(w)
            await w.channel.close()

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Poll every worker once (so the first requests see who is up), then keep polling."""
        await self.poll_once()
        self._poller = self._tasks.spawn(self._poll_forever(), "worker-pool-poller")

    async def close(self) -> None:
        await self._tasks.close()
        for w in [*self.workers, *self._retired]:
            await w.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            await self.poll_once()
            await self._close_retired()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerEndpoint) -> None:
        lora_version = w.lora_version
        try:
            stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.mark_down(w, f"GetStats: {exc.code().name}: {exc.details()}")
            return
        except grpc.aio.UsageError:  # removed from the pool meanwhile: its channel is closed
            return
        self._accept_stats(w, stats, lora_current=w.lora_version == lora_version)

    def _accept_stats(
        self, w: WorkerEndpoint, stats: common_pb2.WorkerStats, lora_current: bool = True
    ) -> None:
        w.stats = stats
        if lora_current:  # else a load or unload answered while this poll was under way: its list is newer
            w.lora_adapters = {a.name: a.path for a in stats.lora_adapters}
        w.in_flight_tokens_at_poll = w.in_flight_tokens
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

    def candidates(
        self, role: str, exclude: Sequence[WorkerEndpoint] = (), lora_name: str = ""
    ) -> list[WorkerEndpoint]:
        """Workers of ``role`` to try: the usable ones; when there are none, the ones that were down (a
        down worker fails a call within milliseconds, and it may be back before the next poll sees it).
        Draining workers and workers of another model or block size are never candidates. With a LoRA
        adapter, those that serve it (or have not said yet); when none does, all of them: a worker refuses
        what it cannot serve with a message that says so."""
        found = self.usable(role, exclude)
        if not found:
            found = [
                w
                for w in self.by_role(role)
                if w.health is Health.DOWN and not w.excluded_reason and not w.draining and w not in exclude
            ]
        if lora_name:
            serving = [w for w in found if w.stats is None or w.serves_lora(lora_name)]
            return serving or found
        return found

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the mesh serves (name -> PEFT directory): those any worker of the mesh's
        model announces, by name."""
        adapters: dict[str, str] = {}
        for w in self.workers:
            if not w.excluded_reason:
                for name, path in w.lora_adapters.items():
                    adapters.setdefault(name, path)
        return dict(sorted(adapters.items()))

    def describe_unusable(self, role: str) -> str:
        """Why no worker of ``role`` can take a request (for the 503 message)."""
        workers = self.by_role(role)
        if not workers:
            return f"no {role} workers are configured or registered"
        parts = []
        for w in workers:
            if w.excluded_reason:
                parts.append(f"{w.address}: {w.excluded_reason}")
            elif w.draining:
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
