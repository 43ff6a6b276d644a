"""The KVStore RPCs: Put (READ offered blocks from a worker), Lookup, Fetch (pin under a lease), Release,
GetTransferMetadata, GetStats; and the lease keeper that unpins fetched blocks when the reader's NIXL
notification arrives, on Release, or when the lease ends.

Block placement lives in ``kvstore_svc.block_store``; this module checks requests (fingerprints: the model's,
FAILED_PRECONDITION on a mismatch; shapes: INVALID_ARGUMENT), moves bytes through the transfer agent and
counts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from kvstore_svc.block_store import BlockStore
from mesh.background import BackgroundTasks
from mesh.grpc_server import StatusError, insecure_channel, status_for
from mesh.kv_events import Tier
from mesh.kv_layout import LayoutMismatchError
from mesh.kv_transfer import KVTransferAgent, KVTransferError
from mesh.kv_transfer_proto import metadata_from_proto, metadata_to_proto
from mesh.telemetry import ServiceMetrics
from protos.pdmesh.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2_grpc

log = logging.getLogger(__name__)

_TIER_PROTO = {Tier.CPU: common_pb2.TIER_CPU, Tier.DISK: common_pb2.TIER_DISK}


@dataclass
class Lease:
    lease_id: str
    hashes: list[int]
    deadline: float  # time.monotonic()


class KVStoreMetrics:
    """``pdmesh_kvstore_*``: blocks per tier, puts, hits, evictions, leases."""

    def __init__(self) -> None:
        m = ServiceMetrics("kvstore")
        self.registry = m.registry
        self.blocks = m.gauge("held", "blocks", "Blocks held, by tier (cpu: host memory, disk).", ["tier"])
        self.capacity = m.gauge("capacity", "blocks", "Blocks each tier can hold.", ["tier"])
        self.puts = m.counter("puts", "total", "Put calls, by outcome (ok, failed).", ["outcome"])
        self.blocks_put = m.counter("put", "blocks", "Blocks READ from workers by Put.")
        self.blocks_declined = m.counter(
            "declined", "blocks", "Offered blocks declined: no free or evictable host block."
        )
        self.lookups = m.counter("lookups", "total", "Lookup and Fetch calls.")
        self.blocks_requested = m.counter("requested", "blocks", "Blocks asked for by Lookup and Fetch.")
        self.blocks_hit = m.counter("hit", "blocks", "Blocks Lookup and Fetch found held.")
        self.evictions = m.counter(
            "evictions",
            "blocks",
            "Blocks evicted: demoted (host memory to disk) or dropped (out of the store).",
            ["kind"],
        )
        self.promotions = m.counter(
            "promotions", "blocks", "Blocks promoted from disk to host memory by Fetch."
        )
        self.fetches = m.counter("fetches", "total", "Fetch calls that pinned blocks.")
        self.leases = m.gauge("fetch_leases", "count", "Fetch leases not yet released.")
        self.leases_expired = m.counter("leases_expired", "total", "Fetch leases ended by their deadline.")
        self.bytes_read = m.counter("transfer", "bytes", "KV bytes READ from workers.")


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(
        self,
        store: BlockStore,
        transfer: KVTransferAgent,
        store_id: str,
        address: str,
        model_fingerprint: str,
        lease_s: float,
        transfer_timeout_s: float,
        metrics: KVStoreMetrics | None = None,
    ) -> None:
        self.store = store
        self.transfer = transfer
        self.store_id = store_id
        self.address = address
        self.model_fingerprint = model_fingerprint
        self.layout_fingerprint = store.layout.fingerprint
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics or KVStoreMetrics()
        self.leases: dict[str, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._handshakes: dict[str, asyncio.Lock] = {}
        self.tasks = BackgroundTasks(type(self).__name__)
        self.num_lookups = 0
        self.num_blocks_hit = 0
        self.num_blocks_requested = 0
        self.num_puts = 0
        self.num_fetches = 0
        self._seen = [0, 0, 0, 0, 0]  # store counters already added to the metrics
        self.metrics.capacity.labels(tier="cpu").set(store.host_blocks)
        self.metrics.capacity.labels(tier="disk").set(store.disk_blocks)

    # ---- checks -------------------------------------------------------------------------------------
    def _check_model(self, fingerprint: str) -> None:
        if fingerprint != self.model_fingerprint:
            raise StatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model fingerprint {fingerprint!r} is not this store's ({self.model_fingerprint!r}): start the "
                "store with the workers' model, dtype, quantization and cache salt",
            )

    def _check_layout(self, fingerprint: str, who: str) -> None:
        if fingerprint != self.layout_fingerprint:
            raise LayoutMismatchError(
                f"KV layout fingerprint mismatch: {who} has {fingerprint!r}, this store has "
                f"{self.layout_fingerprint!r}; the store and the workers must have the same model, dtype, "
                "kv cache dtype and block size"
            )

    @staticmethod
    def _check_chain(hashes: list[int]) -> None:
        if not hashes:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "block_hashes is empty")
        if len(set(hashes)) != len(hashes):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "block_hashes repeats a hash: a chain cannot")

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code, message = status_for(exc)
        await context.abort(code, message)

    # ---- RPCs ---------------------------------------------------------------------------------------
    async def Put(
        self, request: kvstore_pb2.PutRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        try:
            return await self._put(request)
        except Exception as exc:
            self.metrics.puts.labels(outcome="failed").inc()
            log.warning("Put failed: %s", exc)
            await self._fail(context, exc)
            raise

    async def _put(self, request: kvstore_pb2.PutRequest) -> kvstore_pb2.PutResponse:
        self._check_model(request.model_fingerprint)
        hashes = list(request.block_hashes)
        self._check_chain(hashes)
        src = request.source
        if len(src.block_ids) != len(hashes):
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(hashes)} block hashes but source.block_ids has {len(src.block_ids)} ids: one id per hash",
            )
        if not src.agent_name or not src.worker_address:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "source needs agent_name and worker_address (the offering worker)",
            )
        self._check_layout(src.layout_fingerprint, f"worker {src.worker_id or src.worker_address}")
        self.num_puts += 1
        plan = self.store.plan_put(hashes)
        nbytes = 0
        if plan.read:
            try:
                # Host slots freed by demotions: their old blocks are written out before the READ lands.
                self.store.discard(await self._disk_done())
                peer = await self._ensure_peer(src.agent_name, src.worker_address)
                remote = [src.block_ids[i] for i, _ in plan.read]
                local = [slot for _, slot in plan.read]
                xfer = self.transfer.start_read(
                    peer, remote, local, b"", layout_fingerprint=src.layout_fingerprint
                )
                try:
                    deadline = time.monotonic() + self.transfer_timeout_s
                    while self.transfer.poll(xfer) != "DONE":
                        if time.monotonic() > deadline:
                            raise StatusError(
                                grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"READ of {len(local)} blocks from {src.worker_address} not done after "
                                f"{self.transfer_timeout_s} s",
                            )
                        await asyncio.sleep(0.0002)
                finally:
                    self.transfer.release(xfer)
                nbytes = xfer.nbytes
            except BaseException:
                self.store.abort_put(plan)
                raise
        parent = request.parent_hash if request.HasField("parent_hash") else None
        stored = self.store.commit_put(plan, parent)
        self.metrics.puts.labels(outcome="ok").inc()
        self.metrics.bytes_read.inc(nbytes)
        self._update_metrics()
        return kvstore_pb2.PutResponse(stored_block_hashes=stored, num_blocks_read=len(plan.read))

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        try:
            self._check_model(request.model_fingerprint)
        except StatusError as exc:
            await self._fail(context, exc)
        hashes = list(request.block_hashes)
        tiers = self.store.prefix_tiers(hashes)
        self._count_lookup(len(hashes), len(tiers))
        return kvstore_pb2.LookupResponse(num_prefix_blocks=len(tiers), tiers=[_TIER_PROTO[t] for t in tiers])

    async def Fetch(
        self, request: kvstore_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.FetchResponse:
        try:
            self._check_model(request.model_fingerprint)
            self._check_layout(request.layout_fingerprint, f"reader {request.requester_agent_name or '?'}")
            hashes = list(request.block_hashes)
            self._check_chain(hashes)
            slots = self.store.pin_prefix(hashes)
        except Exception as exc:
            await self._fail(context, exc)
            raise
        try:
            failed = await self._disk_done()  # promoted blocks read back before anyone may READ them
        except BaseException:
            self.store.unpin(hashes[: len(slots)])
            raise
        if failed:
            self.store.unpin(hashes[: len(slots)])
            self.store.discard(failed)
            await self._fail(
                context,
                StatusError(
                    grpc.StatusCode.INTERNAL, f"reading {len(failed)} blocks from the disk tier failed"
                ),
            )
        self._count_lookup(len(hashes), len(slots))
        self._update_metrics()
        if not slots:
            return kvstore_pb2.FetchResponse(num_prefix_blocks=0)
        self.num_fetches += 1
        self.metrics.fetches.inc()
        lease_id = f"{request.request_id or 'fetch'}@{self.store_id}#{next(self._lease_ids)}"
        self.leases[lease_id] = Lease(lease_id, hashes[: len(slots)], time.monotonic() + self.lease_s)
        self.metrics.leases.set(len(self.leases))
        return kvstore_pb2.FetchResponse(
            num_prefix_blocks=len(slots),
            kv_handle=common_pb2.KVHandle(
                worker_id=self.store_id,
                worker_address=self.address,
                agent_name=self.transfer.agent_name,
                block_ids=slots,
                layout_fingerprint=self.layout_fingerprint,
                num_tokens=len(slots) * self.store.layout.block_size,
                lease_deadline_unix_ms=int((time.time() + self.lease_s) * 1000),
                request_id=lease_id,
            ),
        )

    async def Release(
        self, request: kvstore_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.ReleaseResponse:
        lease = self.leases.get(request.lease_id)
        released = self.release(request.lease_id)
        return kvstore_pb2.ReleaseResponse(
            released=released, num_blocks_unpinned=len(lease.hashes) if released and lease else 0
        )

    async def GetTransferMetadata(
        self, request: common_pb2.TransferMetadataRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TransferMetadata:
        if request.layout_fingerprint:
            try:
                self._check_layout(
                    request.layout_fingerprint, f"requester {request.requester_agent_name or '?'}"
                )
            except LayoutMismatchError as exc:
                await self._fail(context, exc)
        meta = self.transfer.metadata()
        return metadata_to_proto(meta)

    async def GetStats(
        self, request: kvstore_pb2.KVStoreStatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.KVStoreStats:
        s = self.store
        return kvstore_pb2.KVStoreStats(
            store_id=self.store_id,
            block_size=s.layout.block_size,
            tiers=[
                kvstore_pb2.KVStoreTierStats(
                    tier=common_pb2.TIER_CPU, num_blocks_total=s.host_blocks, num_blocks_used=s.used(Tier.CPU)
                ),
                kvstore_pb2.KVStoreTierStats(
                    tier=common_pb2.TIER_DISK,
                    num_blocks_total=s.disk_blocks,
                    num_blocks_used=s.used(Tier.DISK),
                ),
            ],
            num_lookups=self.num_lookups,
            num_blocks_hit=self.num_blocks_hit,
            num_blocks_requested=self.num_blocks_requested,
            model_fingerprint=self.model_fingerprint,
            layout_fingerprint=self.layout_fingerprint,
            num_puts=self.num_puts,
            num_blocks_put=s.blocks_put,
            num_blocks_declined=s.blocks_declined,
            num_blocks_demoted=s.blocks_demoted,
            num_blocks_dropped=s.blocks_dropped,
            num_blocks_promoted=s.blocks_promoted,
            num_leases=len(self.leases),
            num_fetches=self.num_fetches,
        )

    # ---- leases -------------------------------------------------------------------------------------
    def release(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.store.unpin(lease.hashes)
        self.metrics.leases.set(len(self.leases))
        return True

    async def background(self) -> None:
        """Unpin fetched blocks when the reader's notification (the lease id) arrives or the lease ends."""
        while True:
            try:
                for _peer, messages in self.transfer.get_notifications().items():
                    for msg in messages:
                        self.release(msg.decode(errors="replace"))
                now = time.monotonic()
                for lease_id in [i for i, lease in self.leases.items() if lease.deadline <= now]:
                    log.warning("fetch lease %s ended without a read; unpinning its blocks", lease_id)
                    self.metrics.leases_expired.inc()
                    self.release(lease_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease keeper iteration failed")
            await asyncio.sleep(0.002 if self.leases else 0.02)

    # ---- helpers ------------------------------------------------------------------------------------
    async def _disk_done(self) -> list[int]:
        """Wait (off the event loop: the store's disk thread does the I/O) for the disk operations the last
        store call asked for; returns the blocks whose operation failed (their bytes cannot be trusted)."""
        ops = self.store.take_io()
        if not ops:
            return []
        results = await asyncio.gather(
            *(asyncio.wrap_future(op.future) for op in ops), return_exceptions=True
        )
        failed = [(op, r) for op, r in zip(ops, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            log.error(
                "disk tier: %d of %d operations failed (first: %s %016x: %r); those blocks are dropped",
                len(failed), len(ops), failed[0][0].kind, failed[0][0].block_hash, failed[0][1],
            )  # fmt: skip
        return [op.block_hash for op, _r in failed]

    def _count_lookup(self, requested: int, hit: int) -> None:
        self.num_lookups += 1
        self.num_blocks_requested += requested
        self.num_blocks_hit += hit
        self.metrics.lookups.inc()
        self.metrics.blocks_requested.inc(requested)
        self.metrics.blocks_hit.inc(hit)

    def _update_metrics(self) -> None:
        s, m = self.store, self.metrics
        m.blocks.labels(tier="cpu").set(s.used(Tier.CPU))
        m.blocks.labels(tier="disk").set(s.used(Tier.DISK))
        now = [s.blocks_put, s.blocks_declined, s.blocks_demoted, s.blocks_dropped, s.blocks_promoted]
        m.blocks_put.inc(now[0] - self._seen[0])
        m.blocks_declined.inc(now[1] - self._seen[1])
        m.evictions.labels(kind="demoted").inc(now[2] - self._seen[2])
        m.evictions.labels(kind="dropped").inc(now[3] - self._seen[3])
        m.promotions.inc(now[4] - self._seen[4])
        self._seen = now

    async def _ensure_peer(self, agent_name: str, address: str) -> str:
        """One handshake per worker agent: its transfer metadata over gRPC (Worker.GetTransferMetadata)."""
        if self.transfer.has_peer(agent_name):
            return agent_name
        lock = self._handshakes.setdefault(agent_name, asyncio.Lock())
        async with lock:
            if self.transfer.has_peer(agent_name):
                return agent_name
            async with insecure_channel(address) as channel:
                try:
                    meta = await worker_pb2_grpc.WorkerStub(channel).GetTransferMetadata(
                        common_pb2.TransferMetadataRequest(
                            requester_agent_name=self.transfer.agent_name,
                            layout_fingerprint=self.layout_fingerprint,
                            agent_name=agent_name,  # the pool's, or the worker's host staging agent
                        ),
                        timeout=10.0,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        raise LayoutMismatchError(exc.details()) from exc
                    raise StatusError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"KV handshake with worker at {address} failed: {exc.code().name} {exc.details()}",
                    ) from exc
            if meta.agent_name != agent_name:
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the worker at {address} has agent {meta.agent_name!r}, not {agent_name!r}",
                )
            try:
                return self.transfer.add_peer(metadata_from_proto(meta))
            except KVTransferError as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"KV transfer setup failed: {exc}") from exc
