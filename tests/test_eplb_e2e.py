"""EPLB end to end: real MoE worker processes (the built-in ``tiny-moe``, two redundant experts, EPLB on)
and a real controller process (``python -m eplb_svc``) with short intervals, over gRPC on loopback.

The worker starts before the controller (its watch retries, counted, and requests are served meanwhile);
after traffic the controller publishes a placement with replicas of the hot experts, the worker moves its
expert weights (its placement version rises on /metrics), and greedy outputs equal the offline engine's
(``engine.LLM`` without EPLB) before and after. Then the same with two expert-parallel ranks (gloo): both
ranks apply the same version together.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from engine import LLM, SamplingParams
from mesh.cli import free_port
from protos.pdmesh.v1 import common_pb2, worker_pb2
from tests.mesh_fixtures import (
    REDIS_URL,
    ServiceProcess,
    needs_redis,
    start_expert_parallel_ranks,
    worker_args,
)
from tests.test_disagg_e2e import _prompts, _stub

pytestmark = pytest.mark.e2e

EPLB_WORKER = ("--enable-eplb", "--num-redundant-experts", "2", "--eplb-report-interval-s", "0.2")
# One rank cannot gain balancedness (it is always 1.0): a negative threshold publishes the hot experts'
# replicas anyway. Few tokens suffice for the tiny model.
CONTROLLER = ("--rebalance-interval-s", "0.5", "--min-window-tokens", "50", "--min-improvement", "-1",
              "--metrics-port", "0")  # fmt: skip
MAX_TOKENS = 10


def metric(proc: ServiceProcess, name: str, labels: str = "") -> float:
    """The sum of a process's /metrics samples named ``name`` whose labels contain ``labels``."""
    with urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _expected(prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-moe", num_kv_blocks=512)
    try:
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()


def _generate(address: str, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """Each prompt prefilled and decoded on the worker itself (Decode without a KV handle), concurrently."""

    async def run() -> list[list[int]]:
        channel, stub = _stub(address)
        async with channel:

            async def one(i: int, prompt: list[int]) -> list[int]:
                req = worker_pb2.DecodeRequest(
                    request_id=f"{tag}-{i}",
                    prompt_token_ids=prompt,
                    sampling_params=common_pb2.SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    ),
                )
                tokens: list[int] = []
                async for msg in stub.Decode(req, timeout=60):
                    tokens += list(msg.token_ids)
                return tokens

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(run())


def _until_version(procs: list[ServiceProcess], prompts: list[list[int]], timeout: float = 60.0) -> None:
    """Send traffic until every worker runs a placement version above 0."""
    deadline = time.monotonic() + timeout
    round_ = 0
    while time.monotonic() < deadline:
        if all(metric(p, f"pdmesh_{_role(p)}_eplb_placement_version") >= 1 for p in procs):
            return
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p, n=round_: _generate(p.address, prompts, f"skew-{n}-{p.address}"), procs))
        round_ += 1
        time.sleep(0.2)
    logs = "\n\n".join(p.log()[-4000:] for p in procs)
    raise AssertionError(f"no placement above version 0 applied within {timeout}s:\n{logs}")


def _role(proc: ServiceProcess) -> str:
    return proc.module.removesuffix("_svc")


@contextlib.contextmanager
def _controller(port: int, *extra: str) -> Iterator[ServiceProcess]:
    proc = ServiceProcess.start("eplb_svc", "--port", str(port), *CONTROLLER, *extra)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.slow
def test_a_worker_applies_the_controllers_placement_and_its_outputs_do_not_change() -> None:
    prompts = _prompts(8, seed=31)
    skewed = [p[:8] * 6 for p in _prompts(4, seed=2)]  # repeated text: the same experts over and over
    expected = _expected(prompts)
    port = free_port()
    worker = ServiceProcess.start(
        "decode_svc", *worker_args("tiny-moe", 256, *EPLB_WORKER, "--eplb-address", f"127.0.0.1:{port}")
    )
    try:
        # No controller yet: requests are served, the watch fails and retries (logged and counted).
        assert _generate(worker.address, prompts, "before") == expected
        assert metric(worker, "pdmesh_decode_eplb_errors_total", 'call="watch"') >= 1
        assert metric(worker, "pdmesh_decode_eplb_placement_version") == 0
        with _controller(port) as controller:
            _until_version([worker], skewed)
            assert metric(worker, "pdmesh_decode_eplb_placements_applied_total") >= 1
            assert metric(worker, "pdmesh_decode_eplb_reports_total", 'outcome="accepted"') >= 1
            assert metric(controller, "pdmesh_eplb_rebalances_total", 'outcome="published"') >= 1
            assert metric(controller, "pdmesh_eplb_placement_version", "/decode/3x8e10p1r") >= 1
            assert _generate(worker.address, prompts, "after") == expected
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]


@needs_redis
def test_a_worker_finds_the_controller_in_the_registry_and_versions_survive_its_restart() -> None:
    """No --eplb-address: the worker finds the controller through --redis-url (role eplb). The controller
    keeps its versions in Redis under its own prefix: a restarted one goes on from them, and the worker keeps
    applying newer ones (after the first restart it finds the new address itself)."""
    prefix = f"pdmesh:eplb-e2e-{uuid.uuid4().hex[:8]}"
    store = ("--redis-url", REDIS_URL, "--redis-key-prefix", prefix, "--registry-ttl-s", "1")
    prompts = [p[:8] * 4 for p in _prompts(3, seed=8)]
    other = [p[:5] * 6 for p in _prompts(3, seed=77)]
    worker = ServiceProcess.start(
        "decode_svc", *worker_args("tiny-moe", 256, *EPLB_WORKER, "--redis-url", REDIS_URL)
    )
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with _controller(free_port(), *store) as controller:
            _until_version([worker], prompts)
            first = metric(controller, "pdmesh_eplb_placement_version", "/decode/3x8e10p1r")
            assert first >= 1
            assert client.smembers(f"{prefix}:groups"), "the placement was not stored under its own prefix"
        with _controller(free_port(), *store) as controller:
            # Restored at once, before any report: the version goes on from the stored one.
            assert metric(controller, "pdmesh_eplb_placement_version", "/decode/3x8e10p1r") >= first
            deadline = time.monotonic() + 60
            while metric(controller, "pdmesh_eplb_placement_version", "/decode/3x8e10p1r") <= first:
                assert time.monotonic() < deadline, controller.log()[-3000:] + worker.log()[-3000:]
                # Other text than before: the placement tuned to the first traffic would stay as it is.
                _generate(worker.address, other, f"restart-{time.monotonic()}")
                time.sleep(0.2)
            latest = metric(controller, "pdmesh_eplb_placement_version", "/decode/3x8e10p1r")
            deadline = time.monotonic() + 30
            while metric(worker, "pdmesh_decode_eplb_placement_version") < latest:
                assert time.monotonic() < deadline, worker.log()[-3000:]
                _generate(worker.address, other, f"follow-{time.monotonic()}")
                time.sleep(0.2)
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]
        for key in client.keys(f"{prefix}:*"):
            client.delete(key)
        assert not client.keys(f"{prefix}:*")
        client.close()


def test_two_expert_parallel_ranks_apply_the_same_placement_together() -> None:
    prompts = _prompts(6, seed=41)
    skewed = [p[:8] * 6 for p in _prompts(3, seed=4)]
    expected = _expected(prompts)
    port = free_port()
    init = f"tcp://127.0.0.1:{free_port()}"
    with _controller(port) as controller:
        args = worker_args(
            "tiny-moe", 256, *EPLB_WORKER, "--eplb-address", f"127.0.0.1:{port}",
            "--expert-parallel-size", "2", "--distributed-init-method", init,
        )  # fmt: skip
        ranks: list[ServiceProcess] = []
        try:
            ranks = start_expert_parallel_ranks("decode_svc", args)
            with ThreadPoolExecutor(2) as pool:
                before = list(pool.map(lambda r: _generate(r.address, prompts, f"b-{r.address}"), ranks))
            assert before == [expected, expected]
            _until_version(ranks, skewed)
            # The ranks apply a placement in the same pass; each rank's gauge follows at its next load
            # report, so a newer version can show on one rank a moment before the other: wait for both.
            deadline = time.monotonic() + 30
            while True:
                versions = [metric(r, "pdmesh_decode_eplb_placement_version") for r in ranks]
                if versions[0] == versions[1] >= 1 or time.monotonic() > deadline:
                    break
                with ThreadPoolExecutor(2) as pool:
                    list(
                        pool.map(
                            lambda r: _generate(r.address, skewed, f"s-{r.address}-{time.monotonic()}"), ranks
                        )
                    )
                time.sleep(0.2)
            assert versions[0] == versions[1] >= 1, versions
            # Both ranks' reports landed in one group of 2 ranks.
            assert metric(controller, "pdmesh_eplb_reports_total", "/decode/3x8e10p2r") >= 2
            with ThreadPoolExecutor(2) as pool:
                after = list(pool.map(lambda r: _generate(r.address, prompts, f"a-{r.address}"), ranks))
            assert after == [expected, expected]
        finally:
            for r in ranks:  # together: the ranks of a group stop together
                r.proc.send_signal(signal.SIGTERM)
            codes = [r.proc.wait(60) for r in ranks]
            assert codes == [0] * len(ranks), "\n".join(r.log()[-3000:] for r in ranks)


@pytest.mark.slow
def test_pdmesh_up_with_eplb_starts_a_controller_the_workers_follow() -> None:
    """``pdmesh up --eplb``: a controller beside the workers, which run with EPLB on and point at it; after
    some traffic both fleets (prefill and decode, balanced as separate groups) run a new placement, and the
    answers are the offline engine's."""
    from tests.test_cli_e2e import Up

    prompt = "balance the experts: " + "mesh " * 60  # past the router's threshold: prefilled on prefill-0
    llm = LLM("tiny-moe", num_kv_blocks=256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompt, params)[0].text
    llm.close()
    up = Up(
        "--model", "tiny-moe", "--num-kv-blocks", "256", "--eplb", "--num-redundant-experts", "2",
        "--eplb-arg=--rebalance-interval-s=0.5", "--eplb-arg=--min-window-tokens=20",
        "--eplb-arg=--min-improvement=-1", "--worker-arg=--eplb-report-interval-s=0.2", quiet=False,
    )  # fmt: skip
    try:
        assert re.search(r"^\s+eplb\s+127\.0\.0\.1:\d+", up.text, re.M), up.text
        workers = dict(re.findall(r"pdmesh (prefill|decode) ready: grpc=\S+ metrics=(\S+)", up.text))
        assert sorted(workers) == ["decode", "prefill"], up.text
        body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        deadline = time.monotonic() + 60
        versions: dict[str, float] = {}
        while time.monotonic() < deadline:
            assert up.complete(body)["choices"][0]["text"] == want
            versions = {
                role: _scrape(address, f"pdmesh_{role}_eplb_placement_version")
                for role, address in workers.items()
            }
            if all(v >= 1 for v in versions.values()):
                break
            time.sleep(0.3)
        assert all(v >= 1 for v in versions.values()), (versions, up.text[-4000:])
        assert up.complete(body)["choices"][0]["text"] == want
        up.stop_and_check()
    finally:
        up.kill()


def _scrape(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0
