"""The KV offload store as a real process, over real gRPC and real NIXL on host memory.

The test process plays the worker: its KV pool is registered with a NIXL agent and a ``Worker`` gRPC server
answers the store's handshake (``GetTransferMetadata``). Blocks travel worker -> store (Put: the store
READs), store host memory -> disk (LRU) -> host memory (Fetch promotes), store -> worker (the worker READs
a fetched lease); their bytes must come back identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from engine.kv_offload import layout_for_model
from mesh.grpc_server import insecure_channel, start_server
from mesh.kv_index import RedisKVIndex
from mesh.kv_transfer import KVTransferAgent, TransferMetadata, create_transfer_agent
from mesh.kv_transfer_proto import metadata_to_proto
from mesh.registry import RedisRegistry
from protos.pdmesh.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2_grpc
from tests.mesh_fixtures import REDIS_URL, ServiceProcess, async_test, forget_model, needs_redis, until

pytestmark = pytest.mark.e2e

LAYOUT = layout_for_model("tiny-dense")
MODEL = LAYOUT.model_fingerprint
POOL_BLOCKS = 48


class SourceWorker(worker_pb2_grpc.WorkerServicer):
    """The worker side of a handshake: its agent's metadata over ``Worker.GetTransferMetadata``."""

    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent

    async def GetTransferMetadata(self, request, context):
        meta = self.agent.metadata()
        return metadata_to_proto(meta)


class Worker:
    """A KV pool of random bytes, its NIXL agent, a handshake server and a stub to the store."""

    def __init__(self, store: ServiceProcess) -> None:
        g = torch.Generator().manual_seed(1)
        self.pool = torch.empty(POOL_BLOCKS, *LAYOUT.block_shape, dtype=torch.float32)
        raw = self.pool.view(torch.uint8).view(-1)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        self.agent = create_transfer_agent("nixl", "test-worker", self.pool, LAYOUT, progress_thread=False)
        self.store = store
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.channel = insecure_channel(store.address)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)
        self.store_peer: str | None = None

    async def start(self) -> None:
        self.server, port = await start_server(
            [(worker_pb2_grpc.add_WorkerServicer_to_server, SourceWorker(self.agent))], ["pdmesh.v1.Worker"]
        )
        self.address = f"127.0.0.1:{port}"

    async def close(self) -> None:
        await self.channel.close()
        if self.server is not None:
            await self.server.stop(0)
        self.agent.close()

    def block(self, i: int) -> bytes:
        return self.pool[i].contiguous().view(torch.uint8).numpy().tobytes()

    async def put(
        self, hashes: list[int], block_ids: list[int], layout: str | None = None, model: str = MODEL
    ) -> kvstore_pb2.PutResponse:
        request = kvstore_pb2.PutRequest(
            model_fingerprint=model,
            block_hashes=hashes,
            source=common_pb2.KVHandle(
                worker_id="test-worker",
                worker_address=self.address,
                agent_name=self.agent.agent_name,
                block_ids=block_ids,
                layout_fingerprint=layout or LAYOUT.fingerprint,
            ),
        )
        call = asyncio.ensure_future(self.stub.Put(request, timeout=30))
        while not call.done():  # the READ's target must make progress (no NIXL progress thread here)
            self.agent.get_notifications()
            await asyncio.wait({call}, timeout=0.001)
        return call.result()

    async def lookup(self, hashes: list[int]) -> list[int]:
        reply = await self.stub.Lookup(
            kvstore_pb2.LookupRequest(model_fingerprint=MODEL, block_hashes=hashes)
        )
        assert reply.num_prefix_blocks == len(reply.tiers)
        return list(reply.tiers)

    async def fetch(self, hashes: list[int], rid: str = "r") -> kvstore_pb2.FetchResponse:
        return await self.stub.Fetch(
            kvstore_pb2.FetchRequest(
                model_fingerprint=MODEL,
                block_hashes=hashes,
                requester_agent_name=self.agent.agent_name,
                layout_fingerprint=LAYOUT.fingerprint,
                request_id=rid,
            )
        )

    async def read(self, handle: common_pb2.KVHandle, into: list[int]) -> None:
        """READ a fetched lease into local blocks ``into``; the notification names the lease."""
        if self.store_peer is None:
            meta = await self.stub.GetTransferMetadata(
                common_pb2.TransferMetadataRequest(layout_fingerprint=LAYOUT.fingerprint)
            )
            self.store_peer = self.agent.add_peer(
                TransferMetadata(
                    meta.agent_name,
                    meta.agent_metadata,
                    meta.layout_fingerprint,
                    meta.block_nbytes,
                    meta.num_blocks,
                    meta.pool_base_address,
                    meta.device,
                    meta.mem_type,
                )
            )
        xfer = self.agent.start_read(
            self.store_peer, list(handle.block_ids), into, handle.request_id.encode()
        )
        deadline = time.monotonic() + 10
        while self.agent.poll(xfer) != "DONE":
            assert time.monotonic() < deadline, "READ from the store did not finish"
            await asyncio.sleep(0.0005)
        self.agent.release(xfer)

    async def stats(self) -> kvstore_pb2.KVStoreStats:
        return await self.stub.GetStats(kvstore_pb2.KVStoreStatsRequest())


@contextlib.asynccontextmanager
async def store_and_worker(*args: str) -> AsyncIterator[Worker]:
    store = ServiceProcess.start("kvstore_svc", "--metrics-port", "0", *args)
    worker = Worker(store)
    try:
        await worker.start()
        yield worker
    finally:
        await worker.close()
        store.stop()


def chain(n: int, start: int = 0) -> list[int]:
    """``n`` distinct hashes (the store takes any u64 as a block's identity)."""
    return [0xABC0_0000_0000_0000 + start + i for i in range(n)]


CPU, DISK = common_pb2.TIER_CPU, common_pb2.TIER_DISK


@async_test
async def test_put_lookup_fetch_and_read_back_bytes_identical() -> None:
    async with store_and_worker("--host-blocks", "16") as w:
        hashes = chain(5)
        reply = await w.put(hashes, [3, 4, 5, 9, 10])
        assert list(reply.stored_block_hashes) == hashes and reply.num_blocks_read == 5
        again = await w.put(hashes[:3], [3, 4, 5])  # held already: nothing is read
        assert list(again.stored_block_hashes) == hashes[:3] and again.num_blocks_read == 0
        assert await w.lookup(hashes + chain(2, start=100)) == [CPU] * 5
        assert await w.lookup(chain(2, start=100) + hashes) == []  # a prefix starts at block 0

        fetched = await w.fetch(hashes[:4])
        assert fetched.num_prefix_blocks == 4 and len(fetched.kv_handle.block_ids) == 4
        assert fetched.kv_handle.layout_fingerprint == LAYOUT.fingerprint
        assert (await w.stats()).num_leases == 1
        await w.read(fetched.kv_handle, [30, 31, 32, 33])
        assert [w.block(i) for i in (30, 31, 32, 33)] == [w.block(i) for i in (3, 4, 5, 9)]
        # The READ's notification names the lease: the store unpins without a Release call.
        assert await until(lambda: _leases(w, 0), timeout=5)
        stats = await w.stats()
        assert stats.num_blocks_put == 5 and stats.num_fetches == 1
        assert stats.tiers[0].tier == CPU and stats.tiers[0].num_blocks_used == 5
        assert stats.model_fingerprint == MODEL


async def _leases(w: Worker, n: int) -> bool:
    return (await w.stats()).num_leases == n


@async_test
async def test_lru_blocks_go_to_disk_and_come_back_identical(tmp_path) -> None:
    disk = tmp_path / "kv.bin"
    async with store_and_worker("--host-blocks", "4", "--disk-path", str(disk), "--disk-blocks", "6") as w:
        a, b = chain(4), chain(4, start=10)
        await w.put(a, [0, 1, 2, 3])
        await w.put(b, [4, 5, 6, 7])  # host memory holds 4: chain a goes to disk, least recently used first
        assert await w.lookup(a) == [DISK] * 4
        assert await w.lookup(b) == [CPU] * 4
        assert disk.stat().st_size == 6 * LAYOUT.block_nbytes
        stats = await w.stats()
        assert stats.num_blocks_demoted == 4 and stats.tiers[1].num_blocks_used == 4

        fetched = await w.fetch(a[:3])  # promoted back into host memory (b's oldest blocks go to disk)
        assert fetched.num_prefix_blocks == 3
        await w.read(fetched.kv_handle, [40, 41, 42])
        assert [w.block(i) for i in (40, 41, 42)] == [w.block(i) for i in (0, 1, 2)]
        assert await w.lookup(a) == [CPU, CPU, CPU, DISK]
        stats = await w.stats()
        assert stats.num_blocks_promoted == 3
        assert stats.tiers[0].num_blocks_used + stats.tiers[1].num_blocks_used == 8

        # More than both tiers hold: host blocks go to disk least recently used first, a chain's tail before
        # its head, and the least recently used disk blocks (the chains' tails) are dropped.
        assert await until(lambda: _leases(w, 0), timeout=5)
        c = chain(4, start=20)
        assert list((await w.put(c, [10, 11, 12, 13])).stored_block_hashes) == c
        stats = await w.stats()
        assert stats.num_blocks_dropped == 2
        assert stats.tiers[0].num_blocks_used == 4 and stats.tiers[1].num_blocks_used == 6
        assert await w.lookup(c) == [CPU] * 4
        assert await w.lookup(a) == [DISK] * 3
        assert await w.lookup(b) == [DISK] * 3
        # An offer larger than host memory: the tail that finds no host block is declined.
        reply = await w.put(chain(6, start=30), [20, 21, 22, 23, 24, 25])
        assert list(reply.stored_block_hashes) == chain(4, start=30)
        assert await w.lookup(c) == [DISK] * 4 and await w.lookup(a) == [DISK] * 2
        fetched = await w.fetch(c[:3])  # back from disk
        await w.read(fetched.kv_handle, [43, 44, 45])
        assert [w.block(i) for i in (43, 44, 45)] == [w.block(i) for i in (10, 11, 12)]


@async_test
async def test_pinned_blocks_are_never_evicted_a_full_store_declines_and_leases_expire() -> None:
    async with store_and_worker("--host-blocks", "4", "--lease-s", "1.0") as w:
        a = chain(4)
        await w.put(a, [0, 1, 2, 3])
        fetched = await w.fetch(a)  # pinned, never read
        assert fetched.num_prefix_blocks == 4
        reply = await w.put(chain(2, start=10), [4, 5])
        assert list(reply.stored_block_hashes) == []  # every host block is pinned: declined
        assert (await w.stats()).num_blocks_declined == 2
        assert await w.lookup(a) == [CPU] * 4
        # The lease ends without a read or a Release: the blocks are unpinned and evictable again.
        assert await until(lambda: _leases(w, 0), timeout=5)
        reply = await w.put(chain(2, start=10), [4, 5])
        assert len(reply.stored_block_hashes) == 2
        assert await w.lookup(a) == [CPU, CPU]  # a's two least recently used blocks dropped (no disk tier)

        # Release unpins at once; a second release of the same lease finds nothing.
        fetched = await w.fetch(chain(2, start=10))
        lease = fetched.kv_handle.request_id
        first = await w.stub.Release(kvstore_pb2.ReleaseRequest(lease_id=lease))
        assert first.released and first.num_blocks_unpinned == 2
        assert not (await w.stub.Release(kvstore_pb2.ReleaseRequest(lease_id=lease))).released


@async_test
async def test_fingerprint_mismatch_is_failed_precondition_and_bad_input_invalid_argument() -> None:
    async with store_and_worker("--host-blocks", "8") as w:
        cases = [
            (w.put(chain(2), [0, 1], layout="another-layout"), grpc.StatusCode.FAILED_PRECONDITION),
            (w.put(chain(2), [0, 1], model="another-model"), grpc.StatusCode.FAILED_PRECONDITION),
            (w.put(chain(2), [0]), grpc.StatusCode.INVALID_ARGUMENT),
            (w.put([], []), grpc.StatusCode.INVALID_ARGUMENT),
            (w.put([7, 7], [0, 1]), grpc.StatusCode.INVALID_ARGUMENT),
            (
                w.stub.Lookup(kvstore_pb2.LookupRequest(model_fingerprint="x", block_hashes=[1])),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (
                w.stub.Fetch(
                    kvstore_pb2.FetchRequest(
                        model_fingerprint=MODEL, block_hashes=[1], layout_fingerprint="x"
                    )
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (
                w.stub.GetTransferMetadata(common_pb2.TransferMetadataRequest(layout_fingerprint="x")),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
        ]
        for call, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == code, err.value.details()
        stats = await w.stats()
        assert stats.num_blocks_put == 0 and stats.tiers[0].num_blocks_used == 0  # nothing reserved leaked
        assert list((await w.put(chain(2), [0, 1])).stored_block_hashes) == chain(2)


@needs_redis
@async_test
async def test_store_registers_and_publishes_its_tiers_to_the_kv_index(tmp_path) -> None:
    salt = uuid.uuid4().hex[:8]  # a model fingerprint of this test's own: keys of its own in Redis
    from mesh.block_hash import salted_fingerprint

    fp = salted_fingerprint(MODEL, salt)
    args = ["--host-blocks", "2", "--disk-path", str(tmp_path / "kv.bin"), "--disk-blocks", "4"]
    index = RedisKVIndex(REDIS_URL, fp)
    registry = RedisRegistry(REDIS_URL)
    try:
        async with store_and_worker(*args, "--redis-url", REDIS_URL, "--cache-salt", salt) as w:
            stores = await registry.list_workers(role="kvstore", model_fingerprint=fp)
            assert len(stores) == 1 and stores[0].address == w.store.address
            store_id = stores[0].worker_id
            hashes = chain(4)
            await w.put(hashes[:2], [0, 1], model=fp)
            await w.put(hashes[2:], [2, 3], model=fp)  # the first two go to disk

            async def tiers() -> dict:
                match = (await index.lookup(hashes)).get(store_id)
                return {} if match is None else {t.value: n for t, n in match.blocks_by_tier.items() if n}

            assert await until(lambda: _equals(tiers, {"disk": 2, "cpu": 2}), timeout=5)
        # Stopped: deregistered and its entries removed.
        assert await registry.list_workers(role="kvstore", model_fingerprint=fp) == []
        assert (await index.lookup(chain(4))).get(store_id) is None
    finally:
        await forget_model(fp)
        await index.aclose()
        await registry.aclose()


async def _equals(fn, expected) -> bool:
    return (await fn()) == expected


@needs_redis
@async_test
async def test_the_router_never_takes_a_registered_store_for_a_worker() -> None:
    """A store registers (role kvstore) and writes its blocks (tiers cpu and disk) into the index beside a
    prefill worker's: the router's discovery adds only the worker to its pool, and its index sweeps keep
    the registered store's entries."""
    from mesh.kv_events import BlocksStored, Tier
    from router.worker_pool import PREFILL
    from tests.test_kv_index_sweep import mesh, poll

    async with mesh() as m:
        await m.registry.register(m.info("p-live", PREFILL, 30451), 60)
        await m.registry.register(m.info("kvstore-1", "kvstore", 30452), 60)
        await m.store("p-live")
        await m.worker_side.apply("kvstore-1", [BlocksStored(tuple(m.hashes[:4]), Tier.CPU)])
        await m.worker_side.apply("kvstore-1", [BlocksStored(tuple(m.hashes[4:]), Tier.DISK)])
        discovery = m.discovery(interval_s=0.02, grace_s=0.0, sweep_interval_s=0.01)
        try:
            for _ in range(3):
                assert await poll(discovery)
            assert [w.role for w in m.pool.workers] == [PREFILL]
            assert await m.holders() == {"p-live", "kvstore-1"}  # swept neither
        finally:
            await discovery.close()
