"""KV offloading end to end: a KV offload store and two workers as real processes, real gRPC, real NIXL on
host memory.

A prompt computed on worker A is offloaded when its KV lease ends; worker B (and A, after its prefix cache
is reset) then loads the prompt's blocks from the store instead of computing them: cached prompt tokens
come from the store, and the greedy tokens are the offline engine's. With the store killed, requests go on
without it.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
import uuid

import grpc
import pytest

from engine import LLM, SamplingParams
from engine.kv_offload import layout_for_model
from mesh.block_hash import salted_fingerprint
from protos.pdmesh.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.mesh_fixtures import (
    REDIS_URL,
    ServiceProcess,
    async_test,
    forget_model,
    needs_redis,
    until,
    worker_args,
)

pytestmark = pytest.mark.e2e

BS = 16
MAX_TOKENS = 8
PARAMS = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _offline(prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM("tiny-dense", num_kv_blocks=256, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, greedy)]


def _metric(proc: ServiceProcess, name: str) -> float:
    """Sum of a worker's /metrics samples named ``name`` (any labels)."""
    total = 0.0
    with urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _decode(stub, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens: list[int] = []
    cached = -1
    req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=PARAMS)
    async for msg in stub.Decode(req, timeout=60):
        tokens += list(msg.token_ids)
        if msg.finish_reason:
            cached = msg.usage.cached_prompt_tokens
    return tokens, cached


async def _prefill(stub, rid: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    reply = await stub.Prefill(
        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=PARAMS), timeout=60
    )
    await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid))  # the lease ends: offload
    return reply


@async_test
async def test_blocks_offloaded_by_one_worker_are_loaded_by_another_with_identical_tokens(tmp_path) -> None:
    prompt, other, fresh = _prompt(200, 1), _prompt(150, 2), _prompt(120, 5)
    expected, expected_other, expected_fresh = _offline([prompt, other, fresh])
    full_blocks = (len(prompt) - 1) // BS  # a prompt always computes at least its last token
    store = ServiceProcess.start(
        "kvstore_svc",
        "--metrics-port",
        "0",
        "--host-blocks",
        "16",
        "--disk-path",
        str(tmp_path / "kv.bin"),
        "--disk-blocks",
        "64",
    )
    flags = ["--kvstore-address", store.address, "--kvstore-retry-s", "0.5", "--kvstore-timeout-s", "0.5"]
    a = b = None
    try:
        a = ServiceProcess.start("prefill_svc", *worker_args("tiny-dense", 128, *flags))
        # B steps one decode step ahead (asynchronous scheduling): loads and offloads meet a step in flight.
        # B stages the store's blocks through host blocks of its own (the default on GPUs): its loads land
        # there before they are copied into its pool.
        b = ServiceProcess.start(
            "decode_svc",
            *worker_args("tiny-dense", 128, *flags, "--async-scheduling", "--kvstore-staging", "on"),
        )
        async with (
            grpc.aio.insecure_channel(a.address) as ca,
            grpc.aio.insecure_channel(b.address) as cb,
            grpc.aio.insecure_channel(store.address) as cs,
        ):
            wa, wb, ks = (
                worker_pb2_grpc.WorkerStub(ca),
                worker_pb2_grpc.WorkerStub(cb),
                kvstore_pb2_grpc.KVStoreStub(cs),
            )

            async def stored() -> int:
                return (await ks.GetStats(kvstore_pb2.KVStoreStatsRequest())).num_blocks_put

            # Worker A computes the prompt; when its KV lease ends, its blocks go to the store.
            first = await _prefill(wa, "a1", prompt)
            assert first.num_cached_tokens == 0 and first.first_token_id == expected[0]
            assert await until(lambda: _at_least(stored, len(prompt) // BS), timeout=10)

            # Worker B never saw the prompt: its blocks come from the store (through its staging blocks), the
            # tokens are the offline engine's.
            tokens, cached = await _decode(wb, "b1", prompt)
            assert tokens == expected
            assert cached == full_blocks * BS
            assert _metric(b, "pdmesh_decode_kv_onboard_blocks_total") == full_blocks

            # Worker A after a prefix cache reset loads them back too (the store moved some to disk meanwhile:
            # 16 host blocks hold less than the two workers offered).
            await _prefill(wa, "a-other", other)
            assert await until(lambda: _at_least(stored, len(prompt) // BS + len(other) // BS), timeout=10)
            assert (await wa.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())).num_evicted_blocks > 0
            again = await _prefill(wa, "a2", prompt)
            assert again.num_cached_tokens == full_blocks * BS and again.first_token_id == expected[0]
            stats = await ks.GetStats(kvstore_pb2.KVStoreStatsRequest())
            assert stats.num_blocks_demoted > 0 and stats.num_fetches == 2

            # An embedding request loads its prompt's prefix from the store as a prefill does (last-token
            # pooling) and gives the offline engine's embedding; a mean-pooled one computes its prompt whole.
            await wa.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())
            emb = await wa.Embed(
                worker_pb2.EmbedRequest(request_id="a-emb", prompt_token_ids=other), timeout=30
            )
            assert emb.num_cached_tokens == (len(other) - 1) // BS * BS
            offline = LLM("tiny-dense", num_kv_blocks=256)
            assert list(emb.embedding) == pytest.approx(offline.embed([other])[0].embedding, abs=1e-5)
            mean = await wa.Embed(
                worker_pb2.EmbedRequest(request_id="a-mean", prompt_token_ids=other, pooling_type="mean"),
                timeout=30,
            )
            assert mean.num_cached_tokens == 0
            assert (
                await ks.GetStats(kvstore_pb2.KVStoreStatsRequest())
            ).num_fetches == 3  # the mean one: none

            # B offers what it computed through its staging blocks (the store READs those); A, which never saw
            # the prompt, loads it from the store and gets the offline engine's first token.
            put_before = await stored()
            tokens, cached = await _decode(wb, "b-fresh", fresh)
            assert tokens == expected_fresh and cached == 0
            assert await until(lambda: _at_least(stored, put_before + len(fresh) // BS), timeout=10)
            reply = await _prefill(wa, "a-fresh", fresh)
            assert reply.num_cached_tokens == (len(fresh) - 1) // BS * BS
            assert reply.first_token_id == expected_fresh[0]

            # A prompt whose only block the store holds is its first: one block is below --kvstore-min-blocks
            # (2), so B computes it all and gives back the lease its Fetch took.
            await wb.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())
            _tokens, cached = await _decode(wb, "b-short", prompt[:BS] + _prompt(3 * BS, 3))
            assert cached == 0

            # Every block a worker held for the store, or reserved for a load, is back in its pool, and no
            # lease pins a store block (the misses' Fetches pinned nothing, the hits' READs unpinned).
            for stub in (wa, wb):
                assert await until(lambda s=stub: _all_free(s), timeout=10)
            assert (await ks.GetStats(kvstore_pb2.KVStoreStatsRequest())).num_leases == 0

            # The store dies: requests still succeed, computing their prompts, and the failures are counted.
            store.kill()
            await wb.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())
            tokens, cached = await _decode(wb, "b2", prompt)
            assert tokens == expected and cached == 0
            tokens, _ = await _decode(wb, "b3", other)
            assert tokens == expected_other
            await asyncio.sleep(0.6)  # past --kvstore-retry-s: the store is tried (and fails) again
            tokens, _ = await _decode(wb, "b4", _prompt(120, 3))
            assert len(tokens) == MAX_TOKENS
            assert _metric(b, "pdmesh_decode_kvstore_errors_total") >= 1
            reply = await _prefill(wa, "a3", other)
            assert reply.first_token_id == expected_other[0]
            for stub in (wa, wb):
                assert await until(lambda s=stub: _all_free(s), timeout=10)
    finally:
        for proc in (b, a):
            if proc is not None:
                proc.stop()
        store.stop()
    assert a is not None and a.proc.returncode == 0, a.log()[-3000:]


async def _at_least(fn, n: int) -> bool:
    return (await fn()) >= n


async def _all_free(stub) -> bool:
    s = await stub.GetStats(worker_pb2.StatsRequest())
    return s.num_kv_blocks_free == s.num_kv_blocks_total


def test_pdmesh_up_with_kvstore_offloads_to_its_store_and_stops_cleanly() -> None:
    """``pdmesh up --kvstore``: a store beside the mesh, the workers pointed at it; a long prompt's blocks
    reach it, and SIGTERM stops it with the rest."""
    import re

    from tests.test_cli_e2e import Up, _children

    up = Up("--num-kv-blocks", "256", "--kvstore", "--kvstore-memory-gb", "0.01")
    try:
        address = re.search(r"^\s+kvstore\s+(\S+)", up.text, re.M).group(1)
        assert len(_children(up.proc.pid)) == 4  # router, prefill, decode, kvstore
        body = {"model": "tiny-dense", "prompt": "offload me " * 60, "max_tokens": 4, "temperature": 0}
        assert up.complete(body)["usage"]["completion_tokens"] == 4

        async def stored() -> int:
            async with grpc.aio.insecure_channel(address) as channel:
                stats = await kvstore_pb2_grpc.KVStoreStub(channel).GetStats(
                    kvstore_pb2.KVStoreStatsRequest()
                )
                return stats.num_blocks_put

        async def wait_stored() -> bool:
            return await until(lambda: _at_least(stored, 600 // BS - 1), timeout=15)

        assert asyncio.run(wait_stored())
        up.stop_and_check()
    finally:
        up.kill()


@needs_redis
@async_test
async def test_a_worker_finds_the_store_in_the_registry() -> None:
    """With ``--redis-url`` and no ``--kvstore-address``, a worker uses the store registered for its model
    fingerprint (here one of the test's own: an engine-wide cache salt, the store started with the same).
    The worker stages the store's blocks through host blocks of its own (``--kvstore-staging on``, the
    default for GPU pools): the store reads its offer from the staging agent, found by name in the
    handshake, and its load lands in staging blocks first."""
    salt = uuid.uuid4().hex[:8]
    fp = salted_fingerprint(layout_for_model("tiny-dense").model_fingerprint, salt)
    prompt = _prompt(100, 4)
    (expected,) = _offline([prompt])
    store = ServiceProcess.start("kvstore_svc", "--metrics-port", "0", "--host-blocks", "32",
                                 "--redis-url", REDIS_URL, "--cache-salt", salt)  # fmt: skip
    worker = None
    try:
        worker = ServiceProcess.start(
            "decode_svc",
            *worker_args(
                "tiny-dense",
                64,
                "--redis-url",
                REDIS_URL,
                "--cache-salt",
                salt,
                "--kvstore-staging",
                "on",
                "--kvstore-staging-blocks",
                "8",
            ),  # fmt: skip
        )
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert (await stub.GetStats(worker_pb2.StatsRequest())).model_fingerprint == fp
            found = await until(lambda: "KV offload store: " + store.address in worker.log(), timeout=10)
            assert found, worker.log()[-2000:]
            tokens, _ = await _decode(stub, "d1", prompt)
            assert tokens == expected
            assert await until(
                lambda: _metric(worker, "pdmesh_decode_kv_offload_blocks_total") > 0, timeout=10
            )
            await stub.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())
            tokens, cached = await _decode(stub, "d2", prompt)
            assert tokens == expected and cached == (len(prompt) - 1) // BS * BS
            assert "staged through 8 page-locked host blocks" in worker.log()
            blocks = (len(prompt) - 1) // BS  # offered out through staging by d1, loaded in by d2
            staged = _metric(worker, "pdmesh_decode_kv_staging_copied_bytes_total")
            assert staged == 2 * blocks * layout_for_model("tiny-dense").block_nbytes
            assert _metric(worker, "pdmesh_decode_kv_staging_free_blocks") == 8
            assert await until(lambda: _all_free(stub), timeout=10)
    finally:
        if worker is not None:
            worker.stop()
        store.stop()
        await forget_model(fp)
