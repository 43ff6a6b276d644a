"""KV index: both implementations (in-process and Redis) against the same behaviour and a brute-force model."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from mesh.block_hash import block_hashes, root_hash
from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, Tier
from mesh.kv_index import _CLEAR_SLOT_LUA, InProcessKVIndex, KVIndex, PrefixMatch, RedisKVIndex
from tests.mesh_fixtures import REDIS_URL, async_test, needs_redis

FP = "test-model-fp"


KINDS = ["inprocess", pytest.param("redis", marks=needs_redis)]


@asynccontextmanager
async def open_index(kind: str) -> AsyncIterator[KVIndex]:
    if kind == "inprocess":
        yield InProcessKVIndex()
        return
    prefix = f"pdmesh-test-{uuid.uuid4().hex}"
    client = aioredis.from_url(REDIS_URL)
    index = RedisKVIndex(client, FP, prefix=prefix)
    try:
        yield index
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def chain(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n * 16)]
    return block_hashes(tokens, 16, root_hash(FP))


def stored(hashes: list[int], tier: Tier = Tier.GPU) -> BlocksStored:
    return BlocksStored(tuple(hashes), tier)


def match(gpu: int = 0, cpu: int = 0, disk: int = 0) -> PrefixMatch:
    return PrefixMatch.from_counts(gpu, cpu, disk)


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_longest_gap_free_prefix_per_worker(kind: str) -> None:
    c = chain(20)
    async with open_index(kind) as index:
        assert await index.lookup(c) == {}
        assert await index.lookup([]) == {}
        await index.apply("a", [stored(c[:10])])
        await index.apply("b", [stored(c[:5])])
        await index.apply("gap", [stored(c[:4] + c[5:12])])  # block 4 missing: prefix is 4
        await index.apply("no-first", [stored(c[1:20])])  # lacks block 0: no prefix at all
        got = await index.lookup(c)
        assert got == {"a": match(gpu=10), "b": match(gpu=5), "gap": match(gpu=4)}
        # A shorter query is a prefix of the chain too.
        assert (await index.lookup(c[:3]))["a"] == match(gpu=3)
        # A chain that diverges after block 2 matches 2 blocks at most.
        other = c[:2] + chain(5, seed=1)
        assert await index.lookup(other) == {"a": match(gpu=2), "b": match(gpu=2), "gap": match(gpu=2)}


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_tiers_count_once_at_best_tier(kind: str) -> None:
    c = chain(12)
    async with open_index(kind) as index:
        await index.apply(
            "w",
            [
                stored(c[:5], Tier.GPU),
                stored(c[:8], Tier.CPU),  # blocks 0-4 also in cpu: still counted as gpu
                stored(c[8:12], Tier.DISK),
                stored(c[10:12], Tier.CPU),  # 10-11 in disk and cpu: cpu
            ],
        )
        got = (await index.lookup(c))["w"]
        assert got == match(gpu=5, cpu=5, disk=2)
        assert got.blocks == 12

        # Dropping the gpu copies leaves the cpu copies.
        await index.apply("w", [BlocksRemoved(tuple(c[:5]), Tier.GPU)])
        assert (await index.lookup(c))["w"] == match(cpu=10, disk=2)
        # Removing a tier the block is not in changes nothing.
        await index.apply("w", [BlocksRemoved(tuple(c[8:10]), Tier.GPU)])
        assert (await index.lookup(c))["w"] == match(cpu=10, disk=2)
        # Dropping block 6 from its only tier cuts the prefix there.
        await index.apply("w", [BlocksRemoved((c[6],), Tier.CPU)])
        assert (await index.lookup(c))["w"] == match(cpu=6)


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_all_blocks_cleared_drops_one_tier(kind: str) -> None:
    c = chain(6)
    async with open_index(kind) as index:
        await index.apply("w", [stored(c[:6], Tier.GPU), stored(c[:3], Tier.CPU)])
        await index.apply("v", [stored(c[:6], Tier.GPU)])
        await index.apply("w", [AllBlocksCleared(Tier.GPU)])
        assert await index.lookup(c) == {"w": match(cpu=3), "v": match(gpu=6)}
        await index.apply("w", [AllBlocksCleared(Tier.CPU)])
        assert await index.lookup(c) == {"v": match(gpu=6)}
        # Events in one batch apply in order: cleared, then stored again.
        await index.apply("v", [AllBlocksCleared(Tier.GPU), stored(c[:2], Tier.GPU)])
        assert await index.lookup(c) == {"v": match(gpu=2)}


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_remove_worker_and_slot_reuse(kind: str) -> None:
    c = chain(8)
    async with open_index(kind) as index:
        await index.apply("a", [stored(c[:8]), stored(c[:8], Tier.DISK)])
        await index.apply("b", [stored(c[:4], Tier.CPU)])
        await index.remove_worker("a")
        await index.remove_worker("never-seen")  # a no-op, not an error
        assert await index.lookup(c) == {"b": match(cpu=4)}
        # A worker arriving after "a" left may reuse its slot; it must not inherit a's blocks.
        await index.apply("c", [stored(c[:1])])
        assert await index.lookup(c) == {"b": match(cpu=4), "c": match(gpu=1)}
        await index.clear()
        assert await index.lookup(c) == {}


class _RecordingBlocks(dict):
    """The in-process index's block table, noting every block ``remove_worker`` reads or deletes."""

    touched: set[int]

    def get(self, key: Any, default: Any = None) -> Any:
        self.touched.add(key)
        return super().get(key, default)

    def __delitem__(self, key: Any) -> None:
        self.touched.add(key)
        super().__delitem__(key)


async def _blocks_touched(index: KVIndex, action: Coroutine[Any, Any, None]) -> set[int]:
    """The block hashes ``action`` reads or writes: in process through the block table; in Redis, every
    block key a command names, Lua's own commands included (MONITOR, filtered to this test's keys)."""
    if isinstance(index, InProcessKVIndex):
        blocks = _RecordingBlocks(index._blocks)
        blocks.touched = set()
        index._blocks = blocks
        await action
        return blocks.touched
    assert isinstance(index, RedisKVIndex)
    block_prefix = index.block_key(0)[:-16]
    sentinel = f"{index.namespace}done-{uuid.uuid4().hex}"
    client = aioredis.from_url(REDIS_URL)
    try:
        async with client.monitor() as monitor:
            listening = asyncio.create_task(_monitored(monitor, sentinel))
            await asyncio.sleep(0.05)  # MONITOR is on before the action runs
            await action
            await client.echo(sentinel)
            commands = await asyncio.wait_for(listening, 10)
    finally:
        await client.aclose()
    return {
        int(arg[len(block_prefix) :], 16)
        for command in commands
        for arg in command.split()
        if arg.startswith(block_prefix)
    }


async def _monitored(monitor: Any, sentinel: str) -> list[str]:
    seen = []
    async for entry in monitor.listen():
        if sentinel in entry["command"]:
            return seen
        seen.append(entry["command"])
    return seen


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_remove_worker_touches_only_that_workers_blocks(kind: str) -> None:
    """Forgetting a departed worker costs O(its entries), not O(index): it reads and clears its own
    blocks (kept in a per-worker set), whatever else the index holds."""
    big, small = chain(2000, seed=1), chain(3, seed=2)
    async with open_index(kind) as index:
        await index.apply("big", [stored(big), stored(small[:1], Tier.CPU)])
        await index.apply("small", [stored(small), stored(small[1:], Tier.DISK)])
        touched = await _blocks_touched(index, index.remove_worker("small"))
        assert touched == set(small)
        assert await index.lookup(small) == {"big": match(cpu=1)}
        assert await index.lookup(big) == {"big": match(gpu=2000)}
        # Nothing of it is left: the same id coming back starts empty.
        await index.apply("small", [stored(big[:2])])
        assert await index.lookup(big) == {"big": match(gpu=2000), "small": match(gpu=2)}
        assert await index.lookup(small) == {"big": match(cpu=1)}


def reference_lookup(held: dict[str, dict[int, set[Tier]]], hashes: list[int]) -> dict[str, PrefixMatch]:
    out = {}
    for worker, blocks in held.items():
        counts = {Tier.GPU: 0, Tier.CPU: 0, Tier.DISK: 0}
        for h in hashes:
            tiers = blocks.get(h)
            if not tiers:
                break
            counts[next(t for t in (Tier.GPU, Tier.CPU, Tier.DISK) if t in tiers)] += 1
        if sum(counts.values()):
            out[worker] = PrefixMatch(sum(counts.values()), counts)
    return out


@pytest.mark.parametrize("kind", KINDS)
@async_test
async def test_random_events_match_brute_force(kind: str) -> None:
    """80 workers (three 32-slot groups), random stores, removals, clears and departures."""
    rng = random.Random(7)
    chains = [chain(64, seed=s) for s in range(4)]
    # Chains 2 and 3 share their first 16 blocks with chain 0 (a common system prompt).
    chains[2] = chains[0][:16] + chains[2][16:]
    chains[3] = chains[0][:16] + chains[3][16:]
    workers = [f"worker-{i}" for i in range(80)]
    held: dict[str, dict[int, set[Tier]]] = {w: {} for w in workers}
    tiers = [Tier.GPU, Tier.CPU, Tier.DISK]
    async with open_index(kind) as index:
        for step in range(500):
            w = rng.choice(workers)
            c = rng.choice(chains)
            roll = rng.random()
            event: KVEvent
            if roll < 0.6:
                lo = 0 if rng.random() < 0.6 else rng.randrange(1, 40)  # mostly whole prefixes
                hi = rng.randrange(lo + 1, 65)
                event = BlocksStored(tuple(c[lo:hi]), rng.choice(tiers))
                for h in c[lo:hi]:
                    held[w].setdefault(h, set()).add(event.tier)
            elif roll < 0.85:
                picked = rng.sample(c, 5)
                event = BlocksRemoved(tuple(picked), rng.choice(tiers))
                for h in picked:
                    held[w].get(h, set()).discard(event.tier)
            elif roll < 0.95:
                event = AllBlocksCleared(rng.choice(tiers))
                for ts in held[w].values():
                    ts.discard(event.tier)
            else:
                await index.remove_worker(w)
                held[w] = {}
                continue
            await index.apply(w, [event])
            if step % 10 == 0:
                for q in chains:
                    assert await index.lookup(q) == reference_lookup(held, q)
        finals = [await index.lookup(q) for q in chains]
        assert finals == [reference_lookup(held, q) for q in chains]
        # The workload exercised what it should: many workers per chain, slots past 32, every tier.
        assert len(finals[0]) > 10
        seen = {t for f in finals for m in f.values() for t, n in m.blocks_by_tier.items() if n}
        assert seen == {Tier.GPU, Tier.CPU, Tier.DISK}
        if isinstance(index, InProcessKVIndex):
            assert index._next_slot > 64


@needs_redis
@async_test
async def test_redis_key_layout_and_cleanup() -> None:
    c = chain(3)
    async with open_index("redis") as index:
        assert isinstance(index, RedisKVIndex)
        client = aioredis.from_url(REDIS_URL)
        try:
            await index.apply("w1", [stored(c)])
            assert index.namespace.endswith(f":{FP}:")
            assert await client.exists(index.block_key(c[0])) == 1
            members = await client.smembers(index.worker_key("w1"))
            assert {m.decode() for m in members} == {f"{h:016x}" for h in c}
            await index.remove_worker("w1")
            assert await client.exists(index.block_key(c[0]), index.worker_key("w1")) == 0
            await index.apply("w2", [stored(c)])
            await index.clear()
            assert [k async for k in client.scan_iter(match=index.namespace + "*")] == []
        finally:
            await client.aclose()


@needs_redis
@async_test
async def test_redis_removal_cut_short_is_finished_later() -> None:
    """A removal that fails after taking the worker's slot (Redis lost mid-way, or the remover cancelled)
    leaves the slot retiring: the worker is no longer listed, so no one would remove it again. Its blocks
    still carry its bit until ``finish_retiring`` clears them and frees the slot for the next worker, once
    the failed remover's clearing lease has expired."""
    c = chain(5)
    async with open_index("redis") as index:
        assert isinstance(index, RedisKVIndex)
        index.retire_lease_s = 0.2
        await index.apply("w1", [stored(c)])
        await index.apply("w2", [stored(c[:2])])
        run = index._run

        async def lost(*_a: Any, **_k: Any) -> None:
            raise redis.ConnectionError("Connection lost")

        index._run = lost  # type: ignore[method-assign]
        with pytest.raises(redis.ConnectionError):
            await index.remove_worker("w1")
        index._run = run  # type: ignore[method-assign]
        assert await index.worker_ids() == {"w2"}
        assert await index._redis.exists(index.block_key(c[4])) == 1  # w1's bit is still set
        assert await index.finish_retiring() == 0  # its clearer may be at work still: its lease holds
        await asyncio.sleep(0.25)
        assert await index.finish_retiring() == 1
        assert await index._redis.exists(index.block_key(c[4])) == 0
        assert await index.lookup(c) == {"w2": match(gpu=2)}
        assert await index.finish_retiring() == 0  # nothing left retiring
        await index.apply("w3", [stored(c)])  # the freed slot is taken again, with no stale bits
        assert await index.lookup(c) == {"w2": match(gpu=2), "w3": match(gpu=5)}


@needs_redis
@async_test
async def test_redis_reloads_scripts_redis_lost() -> None:
    """Redis keeps nothing on disk: after a restart its script cache is empty. Simulated with a
    cached SHA Redis does not know (flushing the shared script cache would disturb other users)."""
    c = chain(4)
    async with open_index("redis") as index:
        assert isinstance(index, RedisKVIndex)
        await index.apply("w", [stored(c)])
        index._sha = {src: "0" * 40 for src in index._sha}
        await index.apply("w", [BlocksStored((c[3],), Tier.CPU)])
        assert await index.lookup(c) == {"w": match(gpu=4)}
        index._sha = {src: "0" * 40 for src in index._sha}
        await index.apply("w", [BlocksRemoved((c[2],))])
        assert await index.lookup(c) == {"w": match(gpu=2)}


@needs_redis
@async_test
async def test_redis_index_is_shared_between_clients() -> None:
    """Two routers with their own clients see the same index; another model's index is separate."""
    c = chain(5)
    async with open_index("redis") as writer:
        assert isinstance(writer, RedisKVIndex)
        prefix = writer.namespace.split(":")[0]
        reader = RedisKVIndex(REDIS_URL, FP, prefix=prefix)
        other_model = RedisKVIndex(REDIS_URL, "another-model", prefix=prefix)
        try:
            await writer.apply("w", [stored(c)])
            assert await reader.lookup(c) == {"w": match(gpu=5)}
            assert await other_model.lookup(c) == {}
        finally:
            await reader.aclose()
            await other_model.aclose()


@needs_redis
@pytest.mark.parametrize(
    "client_options",
    [
        {"protocol": 2},
        {"protocol": 3},
        {"protocol": 2, "decode_responses": True},
        {"protocol": 3, "decode_responses": True},
    ],
    ids=["resp2", "resp3", "resp2-decoded", "resp3-decoded"],
)
@async_test
async def test_redis_lookup_with_any_client_protocol(client_options: dict[str, Any]) -> None:
    """The lookup reads raw replies itself: RESP2 (the slot table comes back as a flat list) and RESP3 (a
    map), decoding or not, must give the same answer, and a cancelled lookup must not leave its reply for
    the next user of the connection."""
    c = chain(40)
    async with open_index("redis") as plain:
        assert isinstance(plain, RedisKVIndex)
        prefix = plain.namespace.split(":")[0]
        client = aioredis.from_url(REDIS_URL, max_connections=1, **client_options)
        index = RedisKVIndex(client, FP, prefix=prefix)
        try:
            await index.apply("a", [stored(c[:40])])
            await index.apply("b", [stored(c[:7], Tier.CPU)])
            expected = {"a": match(gpu=40), "b": match(cpu=7)}
            assert await index.lookup(c) == expected
            assert await plain.lookup(c) == expected
            for delay in range(6):
                task = asyncio.create_task(index.lookup(c))
                for _ in range(delay):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert await index.lookup(c[:3]) == {"a": match(gpu=3), "b": match(cpu=3)}
        finally:
            await client.aclose()


@needs_redis
@async_test
async def test_redis_a_removal_is_done_once_however_many_remove_at_once() -> None:
    """Routers sweeping the same index may all find the same dead worker. One takes its slot and clears it
    under a lease; the others, removing it or finishing cut-short removals meanwhile, do none of that work."""
    c = chain(5000)  # two rounds of clearing (4096 blocks each)
    async with open_index("redis") as a:
        assert isinstance(a, RedisKVIndex)
        b = RedisKVIndex(a._redis, FP, prefix=a.namespace.split(":")[0])
        await a.apply("w1", [stored(c)])
        cleared: dict[str, int] = {"a": 0, "b": 0}
        paused, resume = asyncio.Event(), asyncio.Event()

        def counting(index: RedisKVIndex, name: str, pause: bool) -> None:
            run = index._run

            async def wrapped(pending: list[tuple[str, list[str], list[Any]]]) -> None:
                await run(pending)
                clears = sum(len(keys) - 1 for src, keys, _ in pending if src is _CLEAR_SLOT_LUA)
                cleared[name] += clears
                if clears and pause and not resume.is_set():
                    paused.set()
                    await resume.wait()

            index._run = wrapped  # type: ignore[method-assign]

        counting(a, "a", pause=True)
        counting(b, "b", pause=False)
        removal = asyncio.create_task(a.remove_worker("w1"))
        await asyncio.wait_for(paused.wait(), 5.0)  # a has cleared its first round and holds the lease
        assert not await b.remove_worker("w1")  # the slot is taken: nothing to do
        assert await b.finish_retiring() == 0  # the slot is being cleared: left to its clearer
        assert cleared["b"] == 0
        resume.set()
        assert await removal
        assert cleared == {"a": 5000, "b": 0}
        assert await a.lookup(c) == {}
        assert await a._redis.smembers(a._retiring_slots) == set()
        assert await a._redis.exists(a._lease_key(0)) == 0
        assert await b.finish_retiring() == 0
