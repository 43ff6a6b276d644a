"""Start real pdmesh service processes on loopback ports for end-to-end tests.

``ServiceProcess.start("prefill_svc", ...)`` runs ``python -m prefill_svc --port 0 ...``, waits for its
``ready`` line and exposes the gRPC address it bound; ``stop()`` sends SIGTERM (drain) and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"pdmesh (\w+) ready: grpc=(\S+) metrics=(\S+)")


@dataclass
class ServiceProcess:
    module: str
    proc: subprocess.Popen
    address: str = ""
    metrics_address: str = ""
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        module: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> ServiceProcess:
        full_env = dict(os.environ)
        full_env.setdefault("NIXL_LOG_LEVEL", "WARN")
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", "0", *args],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        svc = cls(module, proc)
        ready = threading.Event()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                svc.lines.append(line.rstrip())
                m = READY.search(line)
                if m and not ready.is_set():
                    svc.address, svc.metrics_address = m.group(2), m.group(3)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not svc.address:
            svc.kill()
            raise RuntimeError(f"{module} did not become ready in {timeout}s:\n" + "\n".join(svc.lines[-40:]))
        return svc

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    @staticmethod
    def stop_all(services: list[ServiceProcess], timeout: float = 15.0) -> list[int]:
        """SIGTERM to every service first, then wait for each: the ranks of an expert-parallel group stop
        together, so stopping them one after another would wait for each one's timeout."""
        for svc in services:
            if svc.alive:
                svc.proc.send_signal(signal.SIGTERM)
        return [svc.stop(timeout) for svc in services]

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return "\n".join(self.lines)


def worker_args(model: str = "tiny-dense", num_kv_blocks: int = 256, *extra: str) -> list[str]:
    return ["--model", model, "--num-kv-blocks", str(num_kv_blocks), "--metrics-port", "0", *extra]


def start_expert_parallel_ranks(service: str, args: list[str], world: int = 2) -> list[ServiceProcess]:
    """``world`` processes of ``service``, ranks 0..world-1 of one expert-parallel group (``args`` carry
    its size and meeting point), started at once: each waits in the group's rendezvous for the others
    before it is ready."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(world) as pool:
        starts = [
            pool.submit(ServiceProcess.start, service, *args, "--expert-parallel-rank", str(r), timeout=120.0)
            for r in range(world)
        ]
        return [s.result() for s in starts]


@contextlib.contextmanager
def worker_pair(*extra: str) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """One prefill and one decode worker process on the tiny dense model, real NIXL on host memory;
    ``extra`` flags go to both."""
    prefill = ServiceProcess.start("prefill_svc", *worker_args("tiny-dense", 256, *extra))
    try:
        decode = ServiceProcess.start("decode_svc", *worker_args("tiny-dense", 256, *extra))
    except BaseException:
        prefill.kill()
        raise
    try:
        yield prefill, decode
    finally:
        for svc in (decode, prefill):
            svc.stop()


@pytest.fixture(scope="module")
def pd_workers() -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """``worker_pair()`` for a test module."""
    with worker_pair() as pair:
        yield pair


def router_generate(
    address: str, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], str, str]]:
    """Each prompt's greedy tokens (EOS ignored) through the router's gRPC ``Generate``, one request after
    another, with the prefill and decode workers that served it."""
    import grpc

    from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

    async def run() -> list[tuple[list[int], str, str]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            replies = []
            for prompt in prompts:
                request = router_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=prompt),
                    sampling_params=common_pb2.SamplingParams(
                        max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                    ),
                )
                tokens, prefill, decode = [], "", ""
                async for msg in stub.Generate(request, timeout=60):
                    tokens += list(msg.token_ids)
                    prefill, decode = prefill or msg.prefill_worker, decode or msg.decode_worker
                replies.append((tokens, prefill, decode))
            return replies

    return asyncio.run(run())


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """``wait_until`` on the running event loop: poll without blocking it. ``predicate`` may also return
    an awaitable (an async check), which is awaited."""

    async def check() -> bool:
        value = predicate()
        return bool(await value) if inspect.isawaitable(value) else bool(value)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await check():
            return True
        await asyncio.sleep(interval)
    return await check()


def metric(metrics: RouterMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of an in-process router's metrics (0 when absent), by exact name and labels."""
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


# ---- Redis (127.0.0.1:6379 on these machines; .ci/run starts one when none answers) ------------------

REDIS_URL = "redis://127.0.0.1:6379"


def redis_up() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")


async def forget_model(fp: str) -> None:
    """Remove everything a test wrote under its own model fingerprint ``fp`` (KV index, registry entries)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"pdmesh:{fp}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.srem("pdmesh:models", fp)
    finally:
        await client.aclose()


class ReadsFailWhileDown:
    """Mixin before a registry class: ``list_workers`` fails as an unreachable Redis does while ``down``."""

    down = False

    async def list_workers(self, role: str | None = None, model_fingerprint: str | None = None) -> Any:
        if self.down:
            import redis

            raise redis.ConnectionError("Connection refused")
        return await super().list_workers(role, model_fingerprint)  # type: ignore[misc]


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test function on its own event loop."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper
