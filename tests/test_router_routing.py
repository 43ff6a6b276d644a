"""The router's routing wiring, in process: the scored chooser over a worker pool and a KV index, the
KV index's outage handling, registry discovery, and the StreamKVEvents feed of the in-process index.

The policy itself (scorers, pickers, PD decider) is tested in tests/test_scoring.py; end-to-end routing
with real workers and Redis in tests/test_routing_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from mesh.block_hash import block_hashes, root_hash
from mesh.grpc_server import start_server
from mesh.kv_event_proto import events_from_proto, events_to_proto
from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier
from mesh.kv_index import InProcessKVIndex, PrefixMatch, RedisKVIndex
from mesh.registry import InProcessRegistry, WorkerInfo
from protos.pdmesh.v1 import common_pb2, worker_pb2_grpc
from router.chooser import RouteRequest
from router.config import RouterConfig
from router.discovery import RegistryDiscovery
from router.kv_event_feed import KVEventFeed
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.recent_routes import RecentRoutes, merge
from router.scored_chooser import ScoredChooser
from router.scoring import RoutingWeights, WeightedPicker
from router.service import make_chooser
from router.worker_pool import DECODE, PREFILL, Health, WorkerPool
from tests.mesh_fixtures import REDIS_URL, ReadsFailWhileDown, async_test, metric, needs_redis, until

FP = "tiny-dense-v1:float32"
BS = 16


def stats(
    worker_id: str, role: str, free: int = 256, queued: int = 0, running: int = 0
) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        worker_id=worker_id, model_fingerprint=FP, block_size=BS, num_kv_blocks_total=256,
        num_kv_blocks_free=free, queued_tokens=queued, running_tokens=running, kv_usage=1 - free / 256,
    )  # fmt: skip


def make_pool(prefill: int, decode: int) -> WorkerPool:
    """A pool of workers that are never called: their stats are set by hand."""
    pool = WorkerPool(
        [f"127.0.0.1:{20000 + i}" for i in range(prefill)],
        [f"127.0.0.1:{21000 + i}" for i in range(decode)],
        BS,
    )
    pool.model_fingerprint = FP
    for role, prefix in ((PREFILL, "p"), (DECODE, "d")):
        for i, w in enumerate(pool.by_role(role)):
            w.stats = stats(f"{prefix}{i}", role)
            w.health = Health.UP
    return pool


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 for i in range(n)]


def stored(prompt: list[int]) -> list[BlocksStored]:
    return [BlocksStored(tuple(block_hashes(prompt, BS, root_hash(FP))))]


class CountingIndex(InProcessKVIndex):
    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    def lookup_sync(self, block_hashes: Any) -> dict[str, PrefixMatch]:
        self.lookups += 1
        return super().lookup_sync(block_hashes)


# ---- the scored chooser -------------------------------------------------------------------------------


@async_test
async def test_prefix_routing_prefers_the_worker_holding_the_prompt_and_hashes_once() -> None:
    pool, metrics, index = make_pool(3, 1), RouterMetrics(), CountingIndex()
    chooser = ScoredChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=index), seed=1)
    prompt = tokens(640)
    index.apply_sync("p2", stored(prompt[:512]))  # 32 of the prompt's 40 blocks
    index.apply_sync("p0", stored(prompt[:64]))
    rr = RouteRequest("r1", prompt)
    decode = await chooser.choose(DECODE, rr, pool.by_role(DECODE))
    assert decode.reason == "only_candidate"
    # The decode worker holds nothing: 640 tokens to compute there, so through a prefill worker.
    local = await chooser.local_prefill(rr, pool.by_role(PREFILL), decode.worker)
    assert (local.prefill_on_decode, local.reason) == (False, "long_uncached")
    choice = await chooser.choose(PREFILL, rr, pool.by_role(PREFILL))
    assert (choice.worker.name, choice.reason) == ("p2", "prefix")
    # A retry without p2 takes the next best (p0 holds 4 blocks) and reuses the hashes and the lookup.
    retry = await chooser.choose(PREFILL, rr, [w for w in pool.by_role(PREFILL) if w.name != "p2"])
    assert retry.worker.name == "p0" and index.lookups == 1


class StateCountingChooser(ScoredChooser):
    """Counts how often the prefill candidates' states are built."""

    prefill_builds = 0

    def _states(self, candidates: Any, request: Any) -> Any:
        if candidates and candidates[0].role == PREFILL:
            self.prefill_builds += 1
        return super()._states(candidates, request)


@async_test
async def test_the_pd_decision_and_the_prefill_choice_share_one_build_of_the_prefill_states() -> None:
    pool, metrics, index = make_pool(3, 1), RouterMetrics(), InProcessKVIndex()
    chooser = StateCountingChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=index), seed=1)
    prompt = tokens(640)
    index.apply_sync("p2", stored(prompt[:512]))
    rr = RouteRequest("r1", prompt)
    decode = await chooser.choose(DECODE, rr, pool.by_role(DECODE))
    assert not (await chooser.local_prefill(rr, pool.by_role(PREFILL), decode.worker)).prefill_on_decode
    choice = await chooser.choose(PREFILL, rr, pool.by_role(PREFILL))
    assert (choice.worker.name, choice.reason) == ("p2", "prefix")
    assert chooser.prefill_builds == 1
    # A retry is chosen from the load as it is then: its states are built again.
    retry = await chooser.choose(PREFILL, rr, [w for w in pool.by_role(PREFILL) if w.name != "p2"])
    assert retry.worker.name in ("p0", "p1") and chooser.prefill_builds == 2


@async_test
async def test_the_prefill_choice_rebuilds_the_states_when_load_changed_since_the_pd_decision() -> None:
    """Nothing needs to keep local_prefill and choose(PREFILL) together: a prefill another request sent to
    p0 in between (here by hand, as one would while this request's router awaited something) is seen."""
    pool, metrics = make_pool(2, 1), RouterMetrics()
    chooser = StateCountingChooser(
        "prefix", pool, metrics, PrefixIndex(metrics, in_process=InProcessKVIndex())
    )
    p0, p1 = pool.by_role(PREFILL)
    p1.stats = stats("p1", PREFILL, queued=500)  # p0 is the less loaded one
    rr = RouteRequest("r1", tokens(640))
    decode = await chooser.choose(DECODE, rr, pool.by_role(DECODE))
    assert not (await chooser.local_prefill(rr, pool.by_role(PREFILL), decode.worker)).prefill_on_decode
    p0.begin_call(6000)
    choice = await chooser.choose(PREFILL, rr, pool.by_role(PREFILL))
    assert (choice.worker.name, choice.reason) == ("p1", "load")
    assert chooser.prefill_builds == 2
    p0.end_call(6000)
    await pool.close()


@async_test
async def test_pd_decision_looks_at_the_chosen_decode_workers_cache() -> None:
    pool, metrics, index = make_pool(2, 2), RouterMetrics(), InProcessKVIndex()
    chooser = ScoredChooser(
        "prefix", pool, metrics, PrefixIndex(metrics, in_process=index), pd_threshold_tokens=256
    )
    prompt = tokens(640, seed=3)
    index.apply_sync("d1", stored(prompt[:512]))  # 128 tokens missing on d1: it prefills them itself
    index.apply_sync("p0", stored(prompt))
    d0, d1 = pool.by_role(DECODE)
    rr = RouteRequest("r", prompt)
    assert (await chooser.local_prefill(rr, pool.by_role(PREFILL), d1)).reason == "short_uncached"
    assert (await chooser.local_prefill(rr, pool.by_role(PREFILL), d0)).reason == "long_uncached"
    assert (await chooser.local_prefill(rr, [], d0)).reason == "no_prefill_worker"
    # A short prompt with nothing cached anywhere is cheaper to prefill where it decodes.
    short = RouteRequest("s", tokens(100, seed=9))
    assert (await chooser.local_prefill(short, pool.by_role(PREFILL), d0)).prefill_on_decode


@async_test
async def test_a_salted_request_finds_only_what_was_cached_under_its_salt() -> None:
    pool, metrics, index = make_pool(2, 1), RouterMetrics(), InProcessKVIndex()
    chooser = ScoredChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=index), seed=0)
    prompt = tokens(320, seed=5)
    # p1 computed the prompt for tenant "t1" (the engine's chain: root_hash(fingerprint, salt)).
    index.apply_sync("p1", [BlocksStored(tuple(block_hashes(prompt, BS, root_hash(FP, "t1"))))])
    salted = await chooser.choose(PREFILL, RouteRequest("a", prompt, cache_salt="t1"), pool.by_role(PREFILL))
    assert (salted.worker.name, salted.reason) == ("p1", "prefix")
    for rid, salt in (("b", ""), ("c", "t2")):  # unsalted, or another tenant: nothing cached for them
        rr = RouteRequest(rid, prompt, cache_salt=salt)
        await chooser.choose(PREFILL, rr, pool.by_role(PREFILL))
        assert "p1" not in rr.routing.request.prefix_matches


@async_test
async def test_load_between_polls_counts_what_this_router_has_in_flight() -> None:
    pool, metrics = make_pool(2, 1), RouterMetrics()
    chooser = ScoredChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=InProcessKVIndex()))
    p0, p1 = pool.by_role(PREFILL)
    p0.begin_call(3000)  # polled stats still say idle
    for i in range(5):
        choice = await chooser.choose(PREFILL, RouteRequest(f"r{i}", tokens(300, seed=i)), [p0, p1])
        assert (choice.worker, choice.reason) == (p1, "load")
    p0.end_call(3000)
    assert p0.in_flight == 0 and p0.in_flight_tokens == 0


@async_test
async def test_session_affinity_keeps_a_session_on_its_prefill_worker() -> None:
    pool, metrics = make_pool(3, 1), RouterMetrics()
    chooser = ScoredChooser(
        "prefix", pool, metrics, PrefixIndex(metrics, in_process=InProcessKVIndex()), seed=5
    )
    first = await chooser.choose(
        PREFILL, RouteRequest("a", tokens(64), session_id="s1"), pool.by_role(PREFILL)
    )
    for i in range(4):
        again = await chooser.choose(
            PREFILL, RouteRequest(f"b{i}", tokens(64, seed=i + 1), session_id="s1"), pool.by_role(PREFILL)
        )
        assert (again.worker, again.reason) == (first.worker, "affinity")


@async_test
async def test_baselines_do_not_hash_and_always_disaggregate() -> None:
    pool, metrics = make_pool(3, 1), RouterMetrics()
    rr_chooser = ScoredChooser("round_robin", pool, metrics)
    prefill = pool.by_role(PREFILL)
    got = [
        (await rr_chooser.choose(PREFILL, RouteRequest(f"r{i}", tokens(40)), prefill)).worker.name
        for i in range(6)
    ]
    assert got == ["p0", "p1", "p2", "p0", "p1", "p2"]
    decision = await rr_chooser.local_prefill(RouteRequest("x", tokens(4)), prefill, pool.by_role(DECODE)[0])
    assert (decision.prefill_on_decode, decision.reason) == (False, "disaggregated")
    rnd = ScoredChooser("random", pool, metrics, seed=3)
    picks = {
        (await rnd.choose(PREFILL, RouteRequest(f"x{i}", tokens(40)), prefill)).worker.name for i in range(30)
    }
    assert picks == {"p0", "p1", "p2"}
    with pytest.raises(ValueError, match="KV index"):
        ScoredChooser("prefix", pool, metrics)


class FlakyRedis:
    """Stands in for a redis.asyncio client: the lookup and PING fail while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.lookups = 0

    def _check(self) -> None:
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    async def ping(self) -> bool:
        self._check()
        return True

    async def script_load(self, script: str) -> str:
        self._check()
        return "0" * 40


@async_test
async def test_unreachable_index_routes_by_load_with_one_warning_and_recovers(
    caplog: Any, monkeypatch: Any
) -> None:
    from mesh import kv_index

    client = FlakyRedis()

    async def lookup(self: Any, hashes: Any) -> dict[str, PrefixMatch]:
        client._check()
        client.lookups += 1
        return {"p1": PrefixMatch.from_counts(len(hashes), 0, 0)}

    monkeypatch.setattr(kv_index.RedisKVIndex, "lookup", lookup)
    pool, metrics = make_pool(2, 1), RouterMetrics()
    index = PrefixIndex(metrics, redis_client=client, timeout_s=0.2, probe_interval_s=0.05)  # type: ignore[arg-type]
    chooser = ScoredChooser("prefix", pool, metrics, index, seed=0)
    p0, p1 = pool.by_role(PREFILL)
    p1.stats = stats("p1", PREFILL, queued=4000)  # busier, but it holds the prompt
    assert (await chooser.choose(PREFILL, RouteRequest("up", tokens(320)), [p0, p1])).reason == "prefix"
    client.down = True
    with caplog.at_level(logging.WARNING, logger="router.prefix_index"):
        for i in range(4):
            choice = await chooser.choose(PREFILL, RouteRequest(f"down{i}", tokens(320)), [p0, p1])
            assert (choice.worker, choice.reason) == (p0, "load")
    assert len(caplog.records) == 1 and "routing by load alone" in caplog.records[0].getMessage()
    assert metric(metrics, "pdmesh_router_index_up") == 0
    assert metric(metrics, "pdmesh_router_index_unavailable_total") == 4
    assert client.lookups == 1  # while down, requests do not wait on Redis
    client.down = False
    for _ in range(100):
        if index.up:
            break
        await asyncio.sleep(0.01)
    assert metric(metrics, "pdmesh_router_index_up") == 1
    # (A new prompt: p0 was just sent the old one four times, and the router remembers that.)
    assert (
        await chooser.choose(PREFILL, RouteRequest("back", tokens(320, seed=4)), [p0, p1])
    ).reason == "prefix"
    await index.close()


@async_test
async def test_the_routers_weights_reach_both_pickers_as_one_routing_weights() -> None:
    config = RouterConfig(prefix_weight=5, load_weight=1, kv_headroom_weight=4, hotspot_margin_tokens=-1)
    assert config.routing_weights() == RoutingWeights(5.0, 1.0, 4.0, None)
    pool, metrics = make_pool(2, 1), RouterMetrics()
    chooser = make_chooser(config, pool, metrics, PrefixIndex(metrics, in_process=InProcessKVIndex()))
    prefill, decode = chooser.pickers[PREFILL], chooser.pickers[DECODE]
    assert isinstance(prefill, WeightedPicker) and isinstance(decode, WeightedPicker)
    assert [(s.name, w) for s, w in prefill.scorers] == [("prefix", 5.0), ("load", 1.0)]
    assert [(s.name, w) for s, w in decode.scorers] == [("kv_headroom", 4.0), ("load", 1.0)]
    assert prefill.hotspot_margin_tokens is None and decode.hotspot_margin_tokens is None
    guarded = RouterConfig(hotspot_margin_tokens=100).routing_weights()
    assert guarded.hotspot_margin_tokens == 100
    with pytest.raises(ValueError, match="routing weights must be >= 0"):
        RouterConfig(kv_headroom_weight=-1)
    with pytest.raises(ValueError, match="hotspot_margin_tokens must be >= 0 or None"):
        RoutingWeights(hotspot_margin_tokens=-1)
    await pool.close()


# ---- discovery ------------------------------------------------------------------------------------------


def info(worker_id: str, role: str, port: int, fp: str = FP, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{port}", fp, BS, 256, draining=draining)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@async_test
async def test_discovery_follows_joins_drains_and_leaves() -> None:
    registry, clock, metrics = InProcessRegistry(), Clock(), RouterMetrics()
    pool = WorkerPool([], ["127.0.0.1:30000"], BS)  # one static decode worker
    discovery = RegistryDiscovery(registry, pool, metrics, "tiny-dense", grace_s=5.0, clock=clock)
    await registry.register(info("p-a", "prefill", 30001), 60)
    await registry.register(info("d-b", "decode", 30002), 60)
    await registry.register(info("other", "prefill", 30003, fp="llama:abc:bf16"), 60)
    await registry.register(info("d-static", "decode", 30000), 60)
    assert await discovery.poll_once()
    assert sorted(w.address for w in pool.workers) == [
        "127.0.0.1:30000",
        "127.0.0.1:30001",
        "127.0.0.1:30002",
    ]
    static = pool.find("127.0.0.1:30000")
    assert static is not None and static.static and static.name == "d-static"
    a, b = pool.find("127.0.0.1:30001"), pool.find("127.0.0.1:30002")
    assert a is not None and b is not None and a.name == "p-a" and a.usable and not a.static
    # Draining: no new requests at once, before any stats poll.
    await registry.set_draining("d-b", True)
    await discovery.poll_once()
    assert not b.usable and pool.usable(DECODE) == [static]
    # It deregisters on its way out: gone at once.
    await registry.deregister("d-b")
    await discovery.poll_once()
    assert pool.find("127.0.0.1:30002") is None
    # A worker missing while it answers (a restarted Redis) is kept for the grace period...
    await registry.deregister("p-a")
    a.health = Health.UP
    await discovery.poll_once()
    clock.now = 4.0
    await discovery.poll_once()
    assert pool.find("127.0.0.1:30001") is a
    await registry.register(info("p-a", "prefill", 30001), 60)  # ...and stays when it comes back
    clock.now = 9.0
    await discovery.poll_once()
    assert pool.find("127.0.0.1:30001") is a and a.missing_since is None
    await registry.deregister("p-a")
    await discovery.poll_once()
    clock.now = 14.5
    await discovery.poll_once()
    assert pool.find("127.0.0.1:30001") is None
    # One that died (its registration expired, it does not answer) goes at once; static workers stay.
    await registry.register(info("p-c", "prefill", 30004), 60)
    await discovery.poll_once()
    c = pool.find("127.0.0.1:30004")
    assert c is not None
    c.health = Health.DOWN
    await registry.deregister("p-c")
    await registry.deregister("d-static")
    await discovery.poll_once()
    assert [w.address for w in pool.workers] == ["127.0.0.1:30000"]
    await pool.close()


class BrokenRegistry(ReadsFailWhileDown, InProcessRegistry):
    pass


@async_test
async def test_discovery_keeps_the_last_list_while_the_registry_is_down(caplog: Any) -> None:
    registry, metrics = BrokenRegistry(), RouterMetrics()
    pool = WorkerPool([], [], BS)
    discovery = RegistryDiscovery(registry, pool, metrics, "tiny-dense", grace_s=0.0)
    await registry.register(info("d-a", "decode", 30010), 60)
    await discovery.poll_once()
    registry.down = True
    with caplog.at_level(logging.WARNING, logger="router.discovery"):
        for _ in range(3):
            assert not await discovery.poll_once()
    assert len(caplog.records) == 1 and "keeping the last known 1 workers" in caplog.records[0].getMessage()
    assert [w.name for w in pool.workers] == ["d-a"]
    assert metric(metrics, "pdmesh_router_registry_up") == 0
    assert metric(metrics, "pdmesh_router_registry_errors_total") == 3
    registry.down = False
    assert await discovery.poll_once() and metric(metrics, "pdmesh_router_registry_up") == 1
    await pool.close()


@async_test
async def test_a_removed_worker_keeps_its_channel_until_its_calls_end() -> None:
    pool = WorkerPool([], [], BS)
    w = pool.add("127.0.0.1:30020", DECODE, "d-x")
    w.begin_call(10)
    pool.remove(w, "test")
    await asyncio.sleep(0.05)
    assert w not in pool.workers and w in pool._retired
    w.end_call(10)
    await pool._close_retired()
    assert w not in pool._retired
    await pool.close()


# ---- departed workers leave the KV index ------------------------------------------------------------


@contextlib.asynccontextmanager
async def redis_index(fp: str, metrics: RouterMetrics) -> AsyncIterator[tuple[PrefixIndex, RedisKVIndex]]:
    """The router's index in Redis (the only home discovery sweeps), and the index as a worker writes its
    events into it, under the model's real key namespace."""
    client = aioredis.from_url(REDIS_URL)
    worker_side = RedisKVIndex(REDIS_URL, fp)
    index = PrefixIndex(metrics, redis_client=client)
    try:
        yield index, worker_side
    finally:
        await index.close()
        await worker_side.aclose()
        keys = [k async for k in client.scan_iter(match=f"{worker_side.namespace}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@needs_redis
@async_test
async def test_a_dead_workers_entries_attract_no_request_before_the_sweep_removes_them() -> None:
    """p-a holds the prompt and is killed. From its first failed stats poll it is no candidate, and once its
    registration expires discovery drops it from the pool: its blocks, still in the index until the sweep,
    never win a request. The sweep (after the grace, every sweep interval) removes them."""
    fp = f"tiny-dense-test-{uuid.uuid4().hex[:12]}"  # a model of this test's own: its own Redis keys
    clock, metrics = Clock(), RouterMetrics()
    registry = InProcessRegistry(clock=clock)
    pool = WorkerPool([], [], BS)
    pool.model_fingerprint = fp
    prompt = tokens(320)
    hashes = block_hashes(prompt, BS, root_hash(fp))

    def usable_with_stats() -> None:  # what the first stats poll of a new worker would set
        for w in pool.workers:
            if w.stats is None:
                busy = 4000 if w.name == "p-a" else 0  # p-a is busier: only its cache makes it win
                w.stats, w.health = stats(w.name, w.role, queued=busy), Health.UP

    async with redis_index(fp, metrics) as (index, worker_side):
        discovery = RegistryDiscovery(
            registry,
            pool,
            metrics,
            "tiny-dense",
            clock=clock,
            index=index,
            grace_s=5.0,
            sweep_interval_s=30.0,
        )
        chooser = ScoredChooser("prefix", pool, metrics, index, seed=0)
        workers = (
            ("p-a", PREFILL, 30201),
            ("p-b", PREFILL, 30202),
            ("p-c", PREFILL, 30204),
            ("d-d", DECODE, 30203),
        )
        for worker_id, role, port in workers:
            await registry.register(info(worker_id, role, port, fp=fp), 10)
        assert await discovery.poll_once()
        usable_with_stats()
        await worker_side.apply("p-a", [BlocksStored(tuple(hashes), Tier.GPU)])

        async def choose(rid: str) -> tuple[str, str]:
            choice = await chooser.choose(PREFILL, RouteRequest(rid, prompt), pool.candidates(PREFILL))
            return choice.worker.name, choice.reason

        assert await choose("before") == ("p-a", "prefix")
        clock.now = 5.0  # the first sweep (past the grace) finds nobody to forget; the next is at 35
        assert await discovery.poll_once()
        assert discovery.sweeping is not None
        await discovery.sweeping
        assert set(await index.lookup(fp, hashes)) == {"p-a"}
        # p-a is killed: its stats poll fails at once; the others renew their registrations, its own expires.
        p_a = pool.find("127.0.0.1:30201")
        assert p_a is not None
        pool.mark_down(p_a, "GetStats: UNAVAILABLE: connection refused")
        assert (await choose("down"))[0] != "p-a"
        clock.now = 6.0
        for worker_id in ("p-b", "p-c", "d-d"):
            assert await registry.heartbeat(worker_id, 10)
        clock.now = 12.0
        assert await discovery.poll_once()
        assert sorted(w.name for w in pool.by_role(PREFILL)) == ["p-b", "p-c"]
        assert set(await index.lookup(fp, hashes)) == {"p-a"}  # still indexed: the sweep is not due yet
        assert (await choose("gone"))[0] != "p-a"
        clock.now = 35.0  # the next sweep
        assert await discovery.poll_once()
        assert discovery.sweeping is not None and not discovery.sweeping.done()  # in the background
        await discovery.sweeping
        assert await index.lookup(fp, hashes) == {}
        assert metric(metrics, "pdmesh_router_index_forget_errors_total") == 0
        await pool.close()


@async_test
async def test_only_a_redis_index_is_swept() -> None:
    """The in-process index is written by this router's feed alone, which forgets workers as they leave the
    pool: it never holds an id with no worker behind it, so neither discovery nor the index sweeps it."""
    metrics = RouterMetrics()
    in_process = PrefixIndex(metrics, in_process=InProcessKVIndex())
    with pytest.raises(ValueError, match="sweeps a Redis KV index"):
        RegistryDiscovery(
            InProcessRegistry(), WorkerPool([], [], BS), metrics, "tiny-dense", index=in_process
        )
    for sweep_step in (
        in_process.worker_ids(FP),
        in_process.forget_worker(FP, "p-x"),
        in_process.finish_retiring(FP),
    ):
        with pytest.raises(TypeError, match="only a Redis index is"):
            await sweep_step


@async_test
async def test_forgetting_a_worker_while_redis_is_unreachable_is_one_warning_and_counted(caplog: Any) -> None:
    metrics = RouterMetrics()
    client = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)  # nothing listens
    index = PrefixIndex(metrics, redis_client=client)
    with caplog.at_level(logging.WARNING, logger="router.prefix_index"):
        assert not await index.forget_worker(FP, "p-gone")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "could not remove the KV index entries of departed worker p-gone"
    ]
    assert metric(metrics, "pdmesh_router_index_forget_errors_total") == 1
    await client.aclose()


# ---- the KV event feed ------------------------------------------------------------------------------


def test_events_from_proto_inverts_the_workers_encoding() -> None:
    events = [
        AllBlocksCleared(Tier.GPU),
        BlocksStored((1, 2**64 - 1), Tier.GPU, parent_hash=0),
        BlocksStored((3,), Tier.CPU),
        BlocksRemoved((2**64 - 1,), Tier.DISK),
    ]
    assert events_from_proto(events_to_proto(events)) == events
    with pytest.raises(ValueError, match="tier"):
        events_from_proto([common_pb2.KVEvent(blocks_removed=common_pb2.BlocksRemoved(block_hashes=[1]))])


class EventWorker(worker_pb2_grpc.WorkerServicer):
    """Serves StreamKVEvents: a snapshot of ``held``, then what ``push`` sends; ``hang_up`` ends streams."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.held: list[int] = []
        self.queues: list[asyncio.Queue[list[Any] | None]] = []
        self.subscriptions = 0

    def _batch(self, events: list[Any]) -> common_pb2.KVEventBatch:
        return common_pb2.KVEventBatch(
            worker_id=self.worker_id, model_fingerprint=FP, events=events_to_proto(events)
        )

    async def StreamKVEvents(self, request: Any, context: Any) -> AsyncIterator[common_pb2.KVEventBatch]:  # noqa: N802
        self.subscriptions += 1
        q: asyncio.Queue[list[Any] | None] = asyncio.Queue()
        self.queues.append(q)
        if request.include_snapshot:
            yield self._batch([AllBlocksCleared(Tier.GPU), BlocksStored(tuple(self.held), Tier.GPU)])
        while (events := await q.get()) is not None:
            yield self._batch(events)

    def push(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, BlocksStored):
                self.held += list(e.block_hashes)
        for q in self.queues:
            q.put_nowait(events)

    def hang_up(self) -> None:
        for q in self.queues:
            q.put_nowait(None)
        self.queues.clear()


@async_test
async def test_feed_applies_snapshot_and_events_and_resubscribes() -> None:
    worker = EventWorker("p-feed")
    server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, worker)], ["pdmesh.v1.Worker"]
    )
    silent = worker_pb2_grpc.WorkerServicer()  # answers UNIMPLEMENTED
    server2, port2 = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, silent)], ["pdmesh.v1.Worker"]
    )
    index, metrics = InProcessKVIndex(), RouterMetrics()
    pool = WorkerPool([f"127.0.0.1:{port}", f"127.0.0.1:{port2}"], [], BS)
    feed = KVEventFeed(index, pool, metrics)
    worker.held = [11, 12]
    feed.start()
    try:
        assert await until(
            lambda: index.lookup_sync([11, 12]) == {"p-feed": PrefixMatch.from_counts(2, 0, 0)}
        )
        worker.push([BlocksStored((13,), Tier.GPU)])
        assert await until(
            lambda: index.lookup_sync([11, 12, 13]).get("p-feed") == PrefixMatch.from_counts(3, 0, 0)
        )
        # The stream breaks: the feed counts it, resubscribes, and the snapshot sets the index right.
        worker.hang_up()
        worker.held = [11]
        assert await until(lambda: worker.subscriptions == 2)
        assert await until(
            lambda: index.lookup_sync([11, 12]).get("p-feed") == PrefixMatch.from_counts(1, 0, 0)
        )
        assert metric(metrics, "pdmesh_router_kv_event_stream_errors_total") == 1
        # A worker that stops answering and leaves the pool is forgotten by the index, and by the feed.
        await server.stop(0)
        assert await until(lambda: metric(metrics, "pdmesh_router_kv_event_stream_errors_total") >= 2)
        gone = pool.workers[0]
        pool.remove(gone, "test")
        assert await until(lambda: index.lookup_sync([11]) == {})
        assert gone not in feed._tasks and gone not in feed._ids and gone not in feed._broken
    finally:
        await feed.close()
        await pool.close()
        await server.stop(0)
        await server2.stop(0)


# ---- recent routes --------------------------------------------------------------------------------------


def test_recent_routes_match_settle_expire_and_merge_with_the_index() -> None:
    clock = Clock()
    recent = RecentRoutes(ttl_s=30.0, settle_lag_s=0.5, clock=clock)
    a = recent.record("p0", [1, 2, 3, 4])
    clock.now = 2.0
    b = recent.record("p1", [1, 2])
    assert a is not None and b is not None
    assert recent.lookup([1, 2, 3, 9]) == {"p0": 3, "p1": 2}
    assert recent.lookup([7, 1]) == {}
    recent.settle(a)  # p0's prefill ended: its events reach the index within the lag
    clock.now = 2.4
    assert recent.lookup([1, 2, 3]) == {"p0": 3, "p1": 2}
    clock.now = 2.6
    assert recent.lookup([1, 2, 3]) == {"p1": 2} and len(recent) == 2
    c = recent.record("p1", [1, 2])  # a second route of the same chain: settling the first keeps it
    recent.settle(b)
    clock.now = 10.0
    assert recent.lookup([1, 2]) == {"p1": 2}
    clock.now = 40.0  # never settled: gone after the ttl
    assert recent.lookup([1, 2]) == {} and len(recent) == 0 and c is not None
    recent.record("p2", [5])
    recent.forget_worker("p2")
    assert recent.lookup([5]) == {}
    assert not recent._holders  # no empty entry left behind (nothing would ever expire it)
    index = {"p0": PrefixMatch.from_counts(1, 2, 0), "p2": PrefixMatch.from_counts(4, 0, 0)}
    merged = merge(index, {"p0": 5, "p1": 2, "p2": 1})
    assert merged["p0"] == PrefixMatch(5, {Tier.GPU: 3, Tier.CPU: 2, Tier.DISK: 0})
    assert merged["p1"] == PrefixMatch.from_counts(2, 0, 0) and merged["p2"] == index["p2"]


@async_test
async def test_a_new_prefix_sent_twice_at_once_goes_to_one_worker() -> None:
    """The second request arrives before the first one's KV events: the router remembers where it sent
    the first, so the prefix is computed and cached once."""
    pool, metrics = make_pool(3, 1), RouterMetrics()
    chooser = ScoredChooser(
        "prefix", pool, metrics, PrefixIndex(metrics, in_process=InProcessKVIndex()), seed=2
    )
    prompt = tokens(512, seed=11)
    first = await chooser.choose(PREFILL, RouteRequest("a", prompt + [1]), pool.by_role(PREFILL))
    first.worker.begin_call(513)  # in flight: it is now the busiest worker
    second = await chooser.choose(PREFILL, RouteRequest("b", prompt + [2]), pool.by_role(PREFILL))
    assert (second.worker, second.reason) == (first.worker, "prefix")
    assert len(chooser.recent) > 0
