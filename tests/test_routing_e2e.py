"""Routing end to end: real router, prefill and decode processes, real gRPC and NIXL, and a private
redis-server per test (never the shared one), on the tiny dense model with 256 KV blocks per worker.

- workers join (a decode worker started by hand gets traffic), drain (the Drain RPC: the request in
  flight completes, no new request goes there, it deregisters and exits) and leave (killed: its
  registration expires and the router forgets it), without a router restart;
- Redis stopped under load: requests keep succeeding, routed by load with the metrics saying so, and
  prefix routing comes back by itself once Redis is restarted;
- failover without Redis (in-process index fed by StreamKVEvents): a repeated prefix goes to the worker
  that cached it; a dead prefill worker is replaced by the next best, a dead decode worker by another
  one, a decode worker dying mid-stream is a clean error, and no KV block stays held anywhere.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import redis

from engine import LLM, SamplingParams
from mesh.cli import free_port
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.mesh_fixtures import ServiceProcess, wait_until, worker_args

pytestmark = pytest.mark.e2e

MODEL = "tiny-dense"
KV_BLOCKS = 256
LONG = 600  # tokens of the request in flight while its decode worker drains


# ---- harness --------------------------------------------------------------------------------------------


class PrivateRedis:
    """A redis-server of this test's own, on a free port, that the test may stop and restart."""

    def __init__(self) -> None:
        self.port = free_port()  # below the ephemeral range: the restart can bind it again
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        assert wait_until(lambda: _pings(client), timeout=10), "redis-server did not start"
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis()
    try:
        yield server
    finally:
        server.stop()


def start_workers(*specs: tuple[str, tuple[str, ...]]) -> list[ServiceProcess]:
    """Start workers side by side: (module, extra args) each."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(ServiceProcess.start, m, *worker_args(MODEL, KV_BLOCKS), *a) for m, a in specs]
        started, errors = [], []
        for f in futures:
            try:
                started.append(f.result())
            except Exception as exc:  # stop the ones that did start, then fail
                errors.append(exc)
    if errors:
        for svc in started:
            svc.kill()
        raise errors[0]
    return started


def worker_id(svc: ServiceProcess) -> str:
    match = re.search(r"worker_id=(\S+)", "\n".join(svc.lines))
    assert match is not None
    return match.group(1)


@dataclass
class Router:
    proc: ServiceProcess

    @property
    def http(self) -> str:
        match = re.search(r"http=(\S+)", next(line for line in self.proc.lines if "ready:" in line))
        assert match is not None
        return match.group(1)

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://{self.http}/health", timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when absent), by exact name and labels."""
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            match = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
            if (
                match
                and match.group(1) == name
                and dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")) == labels
            ):
                return float(match.group(3))
        return 0.0

    def generate(self, prompt: list[int], max_tokens: int = 8, **extra: Any) -> Result:
        return Result.collect(self.stream(prompt, max_tokens, **extra))

    def stream(
        self, prompt: list[int], max_tokens: int = 8, **extra: Any
    ) -> Iterator[router_pb2.GenerateResponse]:
        params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params, **extra
        )
        with grpc.insecure_channel(self.proc.address) as channel:
            yield from router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120)


@dataclass
class Result:
    tokens: list[int]
    prefill_worker: str
    decode_worker: str
    usage: common_pb2.Usage

    @classmethod
    def collect(cls, stream: Iterator[router_pb2.GenerateResponse], until_decode: bool = False) -> Result:
        """Read ``stream`` to its end, or only until the decode worker is known."""
        out = cls([], "", "", common_pb2.Usage())
        out.read(stream, until_decode)
        return out

    def read(self, stream: Iterator[router_pb2.GenerateResponse], until_decode: bool = False) -> None:
        for msg in stream:
            self.tokens += list(msg.token_ids)
            self.prefill_worker = self.prefill_worker or msg.prefill_worker
            self.decode_worker = self.decode_worker or msg.decode_worker
            if msg.finish_reason:
                self.usage = msg.usage
            if until_decode and self.decode_worker:
                return


def _polled(router: Router, svc: ServiceProcess) -> bool:
    """The router has the worker in its pool and has read its stats."""
    return router.health()["workers"].get(svc.address, {}).get("health") == "up"


def start_router(*args: str) -> Router:
    return Router(ServiceProcess.start("router", "--model", MODEL, "--http-port", "0", *args))


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 250 + 1 for i in range(n)]


def worker_stats(svc: ServiceProcess) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(svc.address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10)


def settled(svc: ServiceProcess) -> bool:
    """Nothing running, waiting or held: every KV block is free (or cached and evictable)."""
    s = worker_stats(svc)
    return s.num_kv_blocks_free == s.num_kv_blocks_total and s.num_running == 0 and s.num_waiting == 0


@contextlib.contextmanager
def stopping(*services: ServiceProcess | Router) -> Iterator[None]:
    try:
        yield
    finally:
        for svc in services:
            (svc.proc if isinstance(svc, Router) else svc).stop()


# ---- tests ----------------------------------------------------------------------------------------------


def test_workers_join_drain_and_leave_without_a_router_restart(private_redis: PrivateRedis) -> None:
    reg = ("--redis-url", private_redis.url, "--registry-ttl-s", "1.5")
    prefill, d1 = start_workers(("prefill_svc", reg), ("decode_svc", reg))
    router = start_router("--redis-url", private_redis.url, "--pd-threshold-tokens", "0")
    joined: list[ServiceProcess] = []
    with stopping(router, prefill, d1):
        try:
            assert router.generate(prompt_of(40, 1)).decode_worker == worker_id(d1)
            # Join: a decode worker started by hand is in the pool within a discovery interval.
            d2 = ServiceProcess.start("decode_svc", *worker_args(MODEL, KV_BLOCKS), *reg)
            joined.append(d2)
            assert wait_until(lambda: _polled(router, d2), timeout=5)
            # A long request on one decode worker; the next request goes to the other (less load), so
            # both serve traffic, whichever took the long one.
            long_stream = router.stream(prompt_of(48, 2), max_tokens=LONG)
            long = Result.collect(long_stream, until_decode=True)
            busy = long.decode_worker
            other = worker_id(d2) if busy == worker_id(d1) else worker_id(d1)
            assert router.generate(prompt_of(40, 3)).decode_worker == other
            # Drain the busy one: its request completes, nothing new goes there, it deregisters and exits.
            draining = d1 if busy == worker_id(d1) else d2
            assert worker_stats(draining).num_running == 1  # the long request is in flight there
            with grpc.insecure_channel(draining.address) as channel:
                worker_pb2_grpc.WorkerStub(channel).Drain(worker_pb2.DrainRequest(), timeout=10)
            assert wait_until(lambda: not router.health()["workers"][draining.address]["usable"], timeout=5)
            after = [router.generate(prompt_of(40, 10 + i)) for i in range(3)]
            assert {r.decode_worker for r in after} == {other}
            long.read(long_stream)
            assert len(long.tokens) == LONG and long.usage.completion_tokens == LONG
            assert draining.proc.wait(30) == 0
            assert wait_until(lambda: draining.address not in router.health()["workers"], timeout=5)
            # Leave by expiry: a worker killed outright is forgotten once its registration expires.
            d3 = ServiceProcess.start("decode_svc", *worker_args(MODEL, KV_BLOCKS), *reg)
            joined.append(d3)
            assert wait_until(lambda: _polled(router, d3), timeout=5)
            d3.kill()
            for i in range(3):  # whichever decode worker it picks, every request is served
                assert len(router.generate(prompt_of(40, 20 + i)).tokens) == 8
            assert wait_until(lambda: d3.address not in router.health()["workers"], timeout=10)
            assert router.metric("pdmesh_router_pool_workers", role="decode", usable="true") == 1
        finally:
            for svc in joined:
                svc.kill()


def test_redis_restart_under_load_falls_back_to_load_and_recovers(private_redis: PrivateRedis) -> None:
    reg = ("--redis-url", private_redis.url, "--registry-ttl-s", "1.5")
    workers = start_workers(("prefill_svc", reg), ("prefill_svc", reg), ("decode_svc", reg))
    router = start_router("--redis-url", private_redis.url, "--pd-threshold-tokens", "0")
    with stopping(router, *workers):
        assert wait_until(lambda: len(router.health()["workers"]) == 3, timeout=5)
        failures: list[str] = []
        served = [0]
        stop = threading.Event()

        def load(seed: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    result = router.generate(prompt_of(64, seed * 1000 + i), max_tokens=4)
                    assert len(result.tokens) == 4
                    served[0] += 1
                except Exception as exc:  # the test reports every failure at the end
                    failures.append(repr(exc))

        threads = [threading.Thread(target=load, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        try:
            assert wait_until(lambda: served[0] >= 4, timeout=30)
            private_redis.stop()
            assert wait_until(lambda: router.metric("pdmesh_router_index_up") == 0, timeout=10)
            down_at = served[0]
            assert wait_until(lambda: served[0] >= down_at + 6, timeout=30)  # served while Redis is down
            assert router.metric("pdmesh_router_index_unavailable_total") >= 6
            assert wait_until(lambda: router.metric("pdmesh_router_registry_up") == 0, timeout=5)
            assert len(router.health()["workers"]) == 3  # the last known list stays in use
            private_redis.start()
            assert wait_until(lambda: router.metric("pdmesh_router_index_up") == 1, timeout=10)
            assert wait_until(lambda: router.metric("pdmesh_router_registry_up") == 1, timeout=10)
            up_at = served[0]
            assert wait_until(lambda: served[0] >= up_at + 4, timeout=30)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert failures == []
        assert len(router.health()["workers"]) == 3  # the workers registered again; none was dropped
        # Prefix routing is back: a repeated long prompt goes where it was cached, and hits the cache.
        hits = router.metric("pdmesh_router_prefix_hit_tokens_total", tier="gpu")
        prefix_decisions = router.metric("pdmesh_router_decisions_total", role="prefill", reason="prefix")
        prompt = prompt_of(320, 77)
        first = router.generate(prompt, max_tokens=4)

        def decided_by_prefix() -> float:
            return router.metric("pdmesh_router_decisions_total", role="prefill", reason="prefix")

        def repeated_hits() -> bool:
            # Past the router's own memory of recent routes (settle lag 0.5 s): the hit must come from the
            # index, refilled by the workers' events after the restart, and count as a prefix decision.
            time.sleep(0.8)
            before = decided_by_prefix()
            again = router.generate(prompt, max_tokens=4)
            return (
                again.prefill_worker == first.prefill_worker
                and again.usage.cached_prompt_tokens >= 304
                and decided_by_prefix() > before
            )

        assert wait_until(repeated_hits, timeout=15, interval=0.0)
        assert router.metric("pdmesh_router_prefix_hit_tokens_total", tier="gpu") >= hits + 304
        assert (
            router.metric("pdmesh_router_decisions_total", role="prefill", reason="prefix") > prefix_decisions
        )


def test_prefix_routing_and_failover_without_redis() -> None:
    p1, p2, d1, d2 = start_workers(
        ("prefill_svc", ()), ("prefill_svc", ()), ("decode_svc", ()), ("decode_svc", ())
    )
    router = start_router(
        "--prefill-workers", p1.address, p2.address, "--decode-workers", d1.address, d2.address,
        "--stats-interval-s", "60", "--pd-threshold-tokens", "0",
    )  # fmt: skip
    llm = LLM(MODEL, num_kv_blocks=KV_BLOCKS)
    by_id = {worker_id(s): s for s in (p1, p2, d1, d2)}
    with stopping(router, p1, p2, d1, d2):
        # Prefix routing: the second request with the same long prefix goes where the first was cached.
        prompt = prompt_of(200, 5)
        first = router.generate(prompt + [7])
        hits = router.metric("pdmesh_router_prefix_hit_tokens_total", tier="gpu")
        # Past the router's memory of recent routes (settle lag 0.5 s): only the worker's KV events, in
        # the router's index, can send the second request to the first one's worker.
        time.sleep(0.8)
        decisions = router.metric("pdmesh_router_decisions_total", role="prefill", reason="prefix")
        second = router.generate(prompt + [9])
        assert second.prefill_worker == first.prefill_worker and second.usage.cached_prompt_tokens >= 192
        assert (
            router.metric("pdmesh_router_decisions_total", role="prefill", reason="prefix") == decisions + 1
        )
        assert router.metric("pdmesh_router_prefix_hit_tokens_total", tier="gpu") >= hits + 192
        # Prefill failover: the worker holding the prefix dies; the next best one serves, same tokens.
        holder = by_id[first.prefill_worker]
        spare = p2 if holder is p1 else p1
        holder.kill()
        third = router.generate(prompt + [11], max_tokens=12)
        assert third.prefill_worker == worker_id(spare)
        expected = llm.generate(
            [prompt + [11]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        assert third.tokens == expected[0].token_ids
        assert router.metric("pdmesh_router_retries_total", role="prefill") >= 1
        # Decode failover: a long request keeps one decode worker busy; the other, idle one dies; the
        # next request is routed to the idle (dead) one and retried on the live one, same tokens.
        long_stream = router.stream(prompt_of(48, 6), max_tokens=4000)
        busy = Result.collect(long_stream, until_decode=True).decode_worker
        dead = d2 if busy == worker_id(d1) else d1
        dead.kill()
        fourth = router.generate(prompt_of(60, 8), max_tokens=12)
        assert fourth.decode_worker == busy
        expected = llm.generate(
            [prompt_of(60, 8)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        assert fourth.tokens == expected[0].token_ids
        assert router.metric("pdmesh_router_retries_total", role="decode") >= 1
        # After tokens reached the client, a dying decode worker is a clean error, not a retry.
        by_id[busy].kill()
        with pytest.raises(grpc.RpcError) as err:
            for _ in long_stream:
                pass
        assert err.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNKNOWN,
        )
        # Nothing leaked: the live prefill worker holds no block, the router no request.
        assert wait_until(lambda: settled(spare), timeout=15)
        assert wait_until(lambda: router.metric("pdmesh_router_in_flight_requests") == 0, timeout=10)
        assert router.proc.alive


def test_stored_responses_while_redis_is_down(private_redis: PrivateRedis) -> None:
    """Responses stored in Redis: while it is down a response is still served (its record is lost, logged
    and counted), continuing a stored one is a 503 that says why, and once Redis is back both work."""
    import openai

    workers = start_workers(("prefill_svc", ()), ("decode_svc", ()))
    router = start_router("--redis-url", private_redis.url, "--prefill-workers", workers[0].address,
                          "--decode-workers", workers[1].address, "--index-timeout-s", "0.2")  # fmt: skip
    with stopping(router, *workers):
        client = openai.OpenAI(base_url=f"http://{router.http}/v1", api_key="x", max_retries=0)
        first = client.responses.create(model=MODEL, input="Remember me.", max_output_tokens=3)
        assert client.responses.retrieve(first.id).id == first.id
        private_redis.stop()
        unstored = client.responses.create(model=MODEL, input="Not kept.", max_output_tokens=3)
        assert (
            unstored.status == "incomplete"
            and router.metric("pdmesh_router_response_store_errors_total") == 1
        )
        with pytest.raises(openai.APIStatusError) as down:
            client.responses.create(
                model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=3
            )
        assert down.value.status_code == 503 and "response store is unavailable" in down.value.message
        private_redis.start()
        assert wait_until(
            lambda: _pings(redis.Redis(port=private_redis.port, socket_connect_timeout=0.2)), timeout=10
        )
        with pytest.raises(openai.NotFoundError):  # Redis keeps nothing on disk: the record went with it
            client.responses.retrieve(first.id)
        again = client.responses.create(model=MODEL, input="Kept again.", max_output_tokens=3)
        follow = client.responses.create(
            model=MODEL, input="And on.", previous_response_id=again.id, max_output_tokens=3
        )
        assert follow.previous_response_id == again.id
