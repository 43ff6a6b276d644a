"""A worker's use of the KV offload store (``kvstore_svc``): offload finished requests' blocks, load prefixes.

Owns the worker side of both directions, over gRPC (``pdmesh.v1.KVStore``) and the worker's transfer agent:

- **Offload.** The engine's ``KVOffload`` (``engine.kv_offload``) queues the cached blocks of finished requests
  and wakes this client, which ``take``s them and offers each chain to the store (``Put``: the store READs
  them from this worker's pool), at most ``kvstore_max_puts`` at once; batches beyond ``kvstore_max_queued``
  waiting are dropped (counted). Each batch's block references are dropped when the store has answered.
- **Load.** Before a request is added, ``generate`` counts the prompt's leading blocks the local prefix cache
  holds and ``Fetch``es the rest from the store (one call: a miss answers nothing, a hit comes pinned under a
  lease); where the store holds at least ``kvstore_min_blocks`` of them, it reserves local blocks, READs them
  (the notification names the lease, so the store unpins at once), and has the engine enter them into its
  prefix cache in the same engine call that adds the request: the request counts them as cached prompt
  tokens.
- **GPU pools** move the store's blocks through host blocks of the worker (``mesh.kv_staging``): offers are
  copied out before the store reads them, loads are read in before they are copied into the pool.

The store being down, slow or failing never fails a request: every store call has a deadline, a failure
is logged once per outage, counted (``pdmesh_<role>_kvstore_errors_total``), and the store is left alone
for ``kvstore_retry_s``; the request computes its prompt as without a store.

The engine is reached only through ``AsyncEngine.call`` (and its methods by duck typing): this module must
not import ``engine`` or any service package.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from engine.pooling import PoolingParams, needs_every_token
from mesh.block_hash import block_hashes, root_hash
from mesh.grpc_server import insecure_channel
from mesh.kv_transfer_proto import metadata_from_proto
from mesh.telemetry import ServiceMetrics, inject_metadata
from protos.pdmesh.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["KVOffloadClient", "PrefixLoad"]

# How often the client looks for a store in the registry while it has none (with a Redis URL).
DISCOVERY_INTERVAL_S = 2.0


class StoreUnavailable(Exception):
    """The store could not be used for this call (down, slow, refusing); the caller goes on without it."""


@dataclass
class PrefixLoad:
    """Blocks READ from the store into reserved local blocks, waiting to enter the prefix cache.
    ``commit`` runs on the engine thread (``AsyncEngine.generate``'s ``before_add``); ``discard`` gives
    the blocks back when the request was never added."""

    client: KVOffloadClient
    load_id: str
    num_blocks: int
    committed: bool = False

    def commit(self) -> None:
        self.committed = True
        self.client.offload.commit_load(self.load_id)

    async def discard(self) -> None:
        if not self.committed:
            self.committed = True
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self.client.aengine.call(lambda: self.client.offload.cancel_load(self.load_id))
                )


class KVOffloadClient:
    def __init__(
        self,
        aengine: Any,
        transfer: Any,
        settings: Any,
        metrics_registry: Any,
        role: str,
        progress: Callable[[], None] | None = None,
    ) -> None:
        """``settings``: the worker's (``kvstore_*`` fields, ``redis_url``, ``kv_transfer_timeout_s``);
        ``progress``: drives the transfer agent while the store READs this worker's pool (NIXL without a
        progress thread completes a READ only as often as its target polls)."""
        self.aengine = aengine
        self.engine = aengine.engine
        self.transfer = transfer
        self.settings = settings
        self.worker_id = ""
        self.address = ""
        self.block_size = int(self.engine.config.block_size)
        self.model_fingerprint = self.engine.model_fingerprint
        self.layout_fingerprint = self.engine.layout.fingerprint
        self.max_held_blocks = settings.kvstore_max_held_blocks or max(
            1, self.engine.block_pool.num_blocks // 4
        )
        self.offload: Any = None  # the engine's KVOffload, once started
        # Host staging between a GPU pool and the store (mesh.kv_staging): its agent then reads and offers the
        # store's blocks instead of the pool's.
        self.staging: Any = None
        mode = settings.kvstore_staging
        if mode == "on" or (mode == "auto" and transfer.pool.device.type == "cuda"):
            from mesh.kv_staging import KVStaging, staging_blocks

            n = staging_blocks(settings.kvstore_staging_blocks, self.max_held_blocks,
                               transfer.block_nbytes)  # fmt: skip
            self.staging = KVStaging(
                transfer.pool, self.engine.layout, n, settings.kv_transfer, f"{transfer.name}-staging",
                progress_thread=False, xfer_mode=settings.kv_xfer_mode,
            )  # fmt: skip
            log.info(
                "KV offload store blocks staged through %d page-locked host blocks (%.0f MiB)",
                n,
                n * transfer.block_nbytes / 2**20,
            )
        self.reader = self.staging.agent if self.staging is not None else transfer
        self.store_address: str | None = settings.kvstore_address
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._store_agent: str | None = None
        self._down_until = 0.0
        self._failing = False
        self._wake = asyncio.Event()
        self._puts = asyncio.Semaphore(max(1, settings.kvstore_max_puts))
        self._queued = 0
        self._put_tasks: set[asyncio.Task] = set()
        self._tasks: Any = None  # the servicer's BackgroundTasks, once started
        self.progress = progress
        self.num_puts_in_flight = 0
        m = ServiceMetrics(role, registry=metrics_registry)
        self.errors = m.counter(
            "kvstore_errors",
            "total",
            "Calls to the KV offload store that failed or timed out (the request went on without the store).",
            ["op"],
        )
        self.offloaded = m.counter(
            "kv_offload",
            "blocks",
            "Blocks offered to the KV offload store, by outcome: stored, declined (store full), dropped "
            "(too many offers waiting, or no store), failed.",
            ["outcome"],
        )
        self.loaded = m.counter("kv_onboard", "blocks", "Blocks loaded from the KV offload store.")
        self.loaded_tokens = m.counter(
            "kv_onboard", "tokens", "Prompt tokens whose KV came from the KV offload store."
        )
        self.load_seconds = m.histogram(
            "kvstore_load",
            "seconds",
            "Phases of a prefix load from the KV offload store: fetch (the Fetch RPC, a miss included), read (the "
            "NIXL READ), copy (host staging blocks into the pool, GPU workers).",
            ["phase"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
        )
        if self.staging is not None:
            staging = self.staging
            m.gauge(
                "kv_staging_free",
                "blocks",
                "Free host staging blocks (a GPU worker's path to the KV offload store).",
            ).set_function(lambda: staging.num_free)
            self.staged = m.counter(
                "kv_staging_copied",
                "bytes",
                "Bytes copied between the KV pool and the host staging blocks, by direction (to_host: offers, "
                "to_device: loads).",
                ["direction"],
            )

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self, tasks: Any, worker_id: str, address: str) -> None:
        """Start using the store (``--kvstore-address``), or looking for one in the registry; ``tasks``:
        the servicer's."""
        self.worker_id, self.address = worker_id, address
        self._tasks = tasks
        if self.store_address:
            await self._enable()
        elif self.settings.redis_url:
            tasks.spawn(self._discover_loop(), "kvstore-discovery")

    async def _enable(self) -> None:
        """Hook the engine (its ``kv_offload``) and start offloading, once there is a store: until then the
        engine holds no block for one."""
        if self.offload is not None:
            return
        if not self.engine.config.enable_prefix_caching:
            log.warning(
                "KV offload store %s not used: the engine's prefix caching is off", self.store_address
            )
            self.store_address = None
            return
        loop = asyncio.get_running_loop()
        wake = self._wake
        at_prefill = self.settings.kvstore_offload_at == "prefill"
        offload = await self.aengine.call(
            lambda: self.engine.enable_kv_offload(self.max_held_blocks, at_prefill)
        )
        offload.on_ready = lambda: loop.call_soon_threadsafe(wake.set)
        self.offload = offload
        self._tasks.spawn(self._offload_loop(), "kv-offload")

    async def close(self) -> None:
        for t in list(self._put_tasks):
            t.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self.staging is not None:
            self.staging.close()

    # ---- the store ----------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return bool(self.store_address) and time.monotonic() >= self._down_until

    def _stub_for(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._stub is None:
            assert self.store_address
            self._channel = insecure_channel(self.store_address)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        return self._stub

    def _failed(self, op: str, exc: BaseException) -> None:
        self.errors.labels(op=op).inc()
        self._down_until = time.monotonic() + self.settings.kvstore_retry_s
        if not self._failing:
            self._failing = True
            detail = (
                f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            )
            log.warning(
                "KV offload store %s failed (%s: %s); requests compute their prompts without it, next try in "
                "%.1f s (further failures are counted in kvstore_errors_total, not logged)",
                self.store_address,
                op,
                detail,
                self.settings.kvstore_retry_s,
            )
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            # It may have restarted (a new agent, empty): handshake again and offer everything again.
            self._store_agent = None
            self.offload_forget = True

    def _succeeded(self) -> None:
        if self._failing:
            self._failing = False
            log.info("KV offload store %s answers again", self.store_address)

    async def _ensure_store_peer(self) -> str:
        if self._store_agent is not None and self.reader.has_peer(self._store_agent):
            return self._store_agent
        meta = await self._stub_for().GetTransferMetadata(
            common_pb2.TransferMetadataRequest(
                requester_agent_name=self.reader.agent_name, layout_fingerprint=self.layout_fingerprint
            ),
            timeout=self.settings.kvstore_timeout_s,
        )
        self._store_agent = self.reader.add_peer(metadata_from_proto(meta))
        return self._store_agent

    async def _discover_loop(self) -> None:
        from mesh.registry import RedisRegistry

        registry = RedisRegistry(self.settings.redis_url)
        try:
            while True:
                try:
                    stores = [
                        s
                        for s in await registry.list_workers(
                            role="kvstore", model_fingerprint=self.model_fingerprint
                        )
                        if not s.draining
                    ]
                except Exception as exc:  # Redis down: keep the store we know
                    log.debug("kvstore discovery failed: %s", exc)
                    stores = None
                if stores is not None:
                    address = stores[0].address if stores else None
                    if address != self.store_address:
                        log.info("KV offload store: %s", address or "none registered")
                        await self._switch(address)
                await asyncio.sleep(DISCOVERY_INTERVAL_S)
        finally:
            with contextlib.suppress(Exception):
                await registry.aclose()

    async def _switch(self, address: str | None) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        self._store_agent = None
        self.store_address = address
        self._down_until = 0.0
        if self.offload is not None:
            await self.aengine.call(self.offload.forget_stored)
        if address:
            await self._enable()

    # ---- load ---------------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        hold_kv: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[Any]:
        """``AsyncEngine.generate``, with the prompt's blocks the store holds loaded first."""
        load = None
        # Prompts with prompt logprobs, and embeddings pooled over every token, are computed whole anyway.
        whole = getattr(params, "prompt_logprobs", None) is not None or needs_every_token(pooling)
        if self.offload is not None and not whole:
            load = await self.load_prefix(request_id, prompt_token_ids, cache_salt, lora_name)
        try:
            async for out in self.aengine.generate(
                request_id,
                prompt_token_ids,
                params,
                hold_kv=hold_kv,
                cache_salt=cache_salt,
                lora_name=lora_name,
                before_add=load.commit if load is not None else None,
                pooling=pooling,
            ):
                yield out
        finally:
            if load is not None:
                await load.discard()

    async def load_prefix(
        self, request_id: str, prompt: list[int], cache_salt: str | None = None, lora_name: str | None = None
    ) -> PrefixLoad | None:
        """READ the blocks of the prompt's prefix the store holds beyond the local prefix cache into reserved
        local blocks; None when there is nothing worth loading or the store cannot help now."""
        if not self.available:
            return None
        bs = self.block_size
        root = root_hash(self.model_fingerprint, cache_salt, lora_name)
        # At least one prompt token is always computed (the engine's match_prefix rule).
        chain = block_hashes(prompt, bs, root)[: (len(prompt) - 1) // bs]
        need = self.settings.kvstore_min_blocks
        if len(chain) < need:
            return None
        # Read on this thread, not the engine's (a lookup in the prefix cache's hash map, atomic under the GIL):
        # a block cached or evicted meanwhile is settled by the reserve and the commit on the engine thread, as
        # it would be after a hop there.
        local = self.offload.local_prefix(chain)
        if len(chain) - local < need:
            return None
        wanted = chain[local:]
        stub = self._stub_for()
        timeout = self.settings.kvstore_timeout_s
        op = "fetch"
        lease_id = ""
        try:
            # Fetch alone (it answers a miss as Lookup does, and pins a hit): one round trip before the READ.
            started = time.monotonic()
            fetched = await stub.Fetch(
                kvstore_pb2.FetchRequest(
                    model_fingerprint=self.model_fingerprint,
                    block_hashes=wanted,
                    requester_agent_name=self.reader.agent_name,
                    layout_fingerprint=self.layout_fingerprint,
                    request_id=request_id,
                ),
                timeout=timeout,
                metadata=inject_metadata(),
            )
            self.load_seconds.labels(phase="fetch").observe(time.monotonic() - started)
            n = fetched.num_prefix_blocks
            handle = fetched.kv_handle
            lease_id = handle.request_id
            if n < need or len(handle.block_ids) != n:
                await self._release(lease_id)
                self._succeeded()
                return None
            op = "handshake"
            peer = await self._ensure_store_peer()
        except grpc.aio.AioRpcError as exc:
            self._failed(op, exc)
            if lease_id:
                await self._release(lease_id)
            return None
        except Exception as exc:  # a handshake the transfer agent refused
            self._failed(op, exc)
            if lease_id:
                await self._release(lease_id)
            return None
        slots: list[int] = []
        if self.staging is not None:  # READ into host blocks of the staging pool, as many as are free
            slots = self.staging.take(n)
            if len(slots) < need:
                await self.staging.give_back(slots)
                await self._release(lease_id)
                return None
            n = len(slots)
        parent = chain[local - 1] if local else None
        load_id = f"{request_id}#kvstore"
        hashes = wanted[:n]
        try:
            blocks = await self.aengine.call(lambda: self.offload.reserve_load(load_id, hashes, parent))
        except Exception:  # a request id in use (the engine refuses the request itself, saying so)
            blocks = []
        if not blocks:
            if self.staging is not None:
                await self.staging.give_back(slots)
            await self._release(lease_id)
            return None
        load = PrefixLoad(self, load_id, n)
        try:
            started = time.monotonic()
            xfer = self.reader.start_read(
                peer,
                list(handle.block_ids[:n]),
                slots or blocks,
                lease_id.encode(),
                layout_fingerprint=handle.layout_fingerprint,
            )
            try:
                deadline = time.monotonic() + self.settings.kv_transfer_timeout_s
                while self.reader.poll(xfer) != "DONE":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"READ of {n} blocks from the KV offload store timed out")
                    await asyncio.sleep(0.0002)
            finally:
                self.reader.release(xfer)
            read_done = time.monotonic()
            self.load_seconds.labels(phase="read").observe(read_done - started)
            if self.staging is not None:
                await self.staging.to_device(slots, blocks)
                self.load_seconds.labels(phase="copy").observe(time.monotonic() - read_done)
                self.staged.labels(direction="to_device").inc(n * self.transfer.block_nbytes)
        except BaseException as exc:
            await load.discard()
            await self._release(lease_id)
            if not isinstance(exc, Exception):
                raise
            self._failed("read", exc)
            return None
        finally:
            if self.staging is not None:
                await self.staging.give_back(slots)
        self._succeeded()
        self.loaded.inc(n)
        self.loaded_tokens.inc(n * bs)
        return load

    async def _release(self, lease_id: str) -> None:
        if not lease_id or self._stub is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Release(
                kvstore_pb2.ReleaseRequest(lease_id=lease_id), timeout=self.settings.kvstore_timeout_s
            )

    # ---- offload ------------------------------------------------------------------------------------
    offload_forget = False

    async def _offload_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):  # also picks up batches whose wake-up was missed
                    await self._wake.wait()
            self._wake.clear()
            if self.offload_forget:
                self.offload_forget = False
                await self.aengine.call(self.offload.forget_stored)
            batches = await self.aengine.call(self.offload.take)
            for batch in batches:
                if not self.available or self._queued >= self.settings.kvstore_max_queued:
                    self.offloaded.labels(outcome="dropped").inc(len(batch.block_ids))
                    await self.aengine.call(lambda b=batch: self.offload.finish(b.batch_id))
                    continue
                self._queued += 1
                task = asyncio.create_task(self._put(batch), name=f"kv-offload-put-{batch.batch_id}")
                self._put_tasks.add(task)
                task.add_done_callback(self._put_tasks.discard)

    async def _progressing(self, call: Coroutine[Any, Any, Any]) -> Any:
        """Await ``call`` (a Put: the store READs this worker's pool, or its staging blocks, meanwhile),
        driving the read agent's progress."""
        progress = self.staging.agent.get_notifications if self.staging is not None else self.progress
        task = asyncio.ensure_future(call)
        self.num_puts_in_flight += 1
        try:
            while not task.done():
                if progress is not None:
                    progress()
                await asyncio.wait({task}, timeout=0.001)
        except BaseException:
            task.cancel()
            raise
        finally:
            self.num_puts_in_flight -= 1
        return task.result()

    async def _put(self, batch: Any) -> None:
        stored: list[int] = []
        slots: list[int] = []
        ids, hashes = list(batch.block_ids), list(batch.block_hashes)
        try:
            async with self._puts:
                source, source_ids = self.transfer, ids
                if self.staging is not None and self.available:
                    # The store reads host copies: the chain's head, as much as the staging pool holds.
                    if len(ids) > self.staging.num_blocks:
                        self.offloaded.labels(outcome="dropped").inc(len(ids) - self.staging.num_blocks)
                        ids, hashes = ids[: self.staging.num_blocks], hashes[: self.staging.num_blocks]
                    slots = await self.staging.take_all(len(ids))
                    await self.staging.to_host(ids, slots)
                    self.staged.labels(direction="to_host").inc(len(ids) * self.transfer.block_nbytes)
                    source, source_ids = self.staging.agent, slots
                request = kvstore_pb2.PutRequest(
                    model_fingerprint=self.model_fingerprint,
                    block_hashes=hashes,
                    source=common_pb2.KVHandle(
                        worker_id=self.worker_id,
                        worker_address=self.address,
                        agent_name=source.agent_name,
                        block_ids=source_ids,
                        layout_fingerprint=self.layout_fingerprint,
                        num_tokens=len(ids) * self.block_size,
                    ),
                )
                if batch.parent_hash is not None:
                    request.parent_hash = batch.parent_hash
                if self.available:
                    reply = await self._progressing(
                        self._stub_for().Put(
                            request,
                            timeout=self.settings.kvstore_timeout_s + self.settings.kv_transfer_timeout_s,
                        )
                    )
                    stored = list(reply.stored_block_hashes)
                    self._succeeded()
                    self.offloaded.labels(outcome="stored").inc(len(stored))
                    self.offloaded.labels(outcome="declined").inc(len(ids) - len(stored))
                else:
                    self.offloaded.labels(outcome="dropped").inc(len(ids))
        except grpc.aio.AioRpcError as exc:
            self._failed("put", exc)
            self.offloaded.labels(outcome="failed").inc(len(ids))
        finally:
            self._queued -= 1
            if slots:
                await asyncio.shield(self.staging.give_back(slots))
            with contextlib.suppress(Exception):
                await asyncio.shield(self.aengine.call(lambda: self.offload.finish(batch.batch_id, stored)))
