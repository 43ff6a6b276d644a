"""Background Responses API responses (``"background": true``, router/background_responses.py) over real
router and worker processes: a background response runs on after its POST answered and its record ends
as the same request run in the foreground would; a cancelled one stops on the workers with no KV block
held; a streaming client that leaves does not stop it; with Redis any router reads or cancels a response
another router runs.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from protos.pdmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.mesh_fixtures import REDIS_URL, ServiceProcess, needs_redis, pd_workers, wait_until  # noqa: F401

pytestmark = pytest.mark.e2e

MODEL = "tiny-dense"
KV_BLOCKS = 256  # what mesh_fixtures.worker_args gives each worker
LONG = {"max_output_tokens": 3000, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
SHORT = {"max_output_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _start_router(pd_workers: Any, *extra: str) -> ServiceProcess:  # noqa: F811
    prefill, decode = pd_workers
    return ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--pd-threshold-tokens", "0", *extra,
    )  # fmt: skip


def _http_address(proc: ServiceProcess) -> str:
    match = re.search(r"http=(\S+)", next(line for line in proc.lines if "ready:" in line))
    assert match is not None
    return match.group(1)


def _client(proc: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{_http_address(proc)}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def router(pd_workers: Any) -> Iterator[ServiceProcess]:  # noqa: F811
    proc = _start_router(pd_workers)  # responses stored in the router's process
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def _post(proc: ServiceProcess, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{_http_address(proc)}{path}", data=json.dumps(body or {}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _get(proc: ServiceProcess, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://{_http_address(proc)}{path}", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _replay(proc: ServiceProcess, response_id: str, starting_after: int | None = None,
            stop_after: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``GET /v1/responses/{id}?stream=true``: its events (each event's name checked against its type), all
    of them or the first ``stop_after`` (the connection then dropped, as a client that lost it)."""
    query = "" if starting_after is None else f"&starting_after={starting_after}"
    url = f"http://{_http_address(proc)}/v1/responses/{response_id}?stream=true{query}"
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(url, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        name = None
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                assert events[-1]["type"] == name
                if stop_after is not None and len(events) == stop_after:
                    break
    return events


def _text(events: list[Any]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _stats(pd_workers: Any) -> list[Any]:  # noqa: F811
    async def run() -> list[Any]:
        out = []
        for svc in pd_workers:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                out.append(await stub.GetStats(worker_pb2.StatsRequest(), timeout=5))
        return out

    return asyncio.run(run())


def _all_free(pd_workers: Any) -> bool:  # noqa: F811
    stats = _stats(pd_workers)
    return [s.num_kv_blocks_free for s in stats] == [KV_BLOCKS] * 2 and not any(
        s.num_running + s.num_waiting for s in stats
    )


def _finished(client: openai.OpenAI, response_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_a_background_response_ends_as_the_foreground_one(router: ServiceProcess) -> None:
    """POST answers at once (queued or in_progress); the record, polled, ends completed with the output and
    usage of the same request run in the foreground (greedy)."""
    client = _client(router)
    args = {"model": MODEL, "instructions": "Be brief.", "input": "Count to ten.", **SHORT}
    queued = client.responses.create(background=True, **args)
    assert queued.status in ("queued", "in_progress") and queued.background is True and queued.output == []
    done = _finished(client, queued.id)
    foreground = client.responses.create(**args)
    assert done.status == foreground.status == "incomplete"  # cut by max_output_tokens, as asked
    assert done.output_text == foreground.output_text and done.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens == 8
    assert done.usage.input_tokens == foreground.usage.input_tokens and foreground.background is False
    # It continues as any stored response does.
    follow = client.responses.create(model=MODEL, input="Go on.", previous_response_id=done.id, **SHORT)
    assert follow.status == "incomplete"


def test_cancel_in_flight_stops_it_on_the_workers(router: ServiceProcess, pd_workers: Any) -> None:  # noqa: F811
    """A long background response is in progress (GET says so, the decode worker holds its blocks); cancel
    makes it cancelled and frees every KV block; cancelling again returns the same object."""
    client = _client(router)
    queued = client.responses.create(model=MODEL, input="A long answer " * 20, background=True, **LONG)
    assert wait_until(lambda: _stats(pd_workers)[1].num_kv_blocks_free < KV_BLOCKS, timeout=30)
    assert client.responses.retrieve(queued.id).status == "in_progress"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert wait_until(lambda: _all_free(pd_workers), timeout=15), [str(s) for s in _stats(pd_workers)]
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent
    time.sleep(1.0)  # the run is over: nothing writes the record again
    assert client.responses.retrieve(queued.id).status == "cancelled"
    replayed = _replay(router, queued.id)  # ends, without a final event
    assert replayed[0]["type"] == "response.created" and replayed[-1]["type"] == "response.output_text.delta"


def test_what_cannot_be_cancelled_or_run_in_the_background(router: ServiceProcess) -> None:
    """background with store false: 400; cancel of an unknown id: 404, of a foreground response: 400; a
    background response that has ended is returned as it is."""
    status, body = _post(router, "/v1/responses", {"model": MODEL, "input": "x", "background": True,
                                                   "store": False})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "background"
    status, body = _post(router, "/v1/responses/resp_unknown/cancel")
    assert status == 404 and "not found" in body["error"]["message"]
    client = _client(router)
    foreground = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    status, body = _post(router, f"/v1/responses/{foreground.id}/cancel")
    assert status == 400 and "background" in body["error"]["message"]
    done = _finished(client, client.responses.create(model=MODEL, input="x", background=True, **SHORT).id)
    again = client.responses.cancel(done.id)
    assert again.status == done.status == "incomplete" and again.output_text == done.output_text


def test_a_streamed_background_response_outlives_its_client(router: ServiceProcess, pd_workers: Any) -> None:  # noqa: F811
    """background + stream: the events come as in the foreground (created says queued); a client that
    leaves after a few does not stop the run: its record completes with the foreground's output."""
    client = _client(router)
    # Long enough that the run is still going well after its client left (so a run that the client's
    # leaving stopped could not pass for one that finished first).
    args = {"model": MODEL, "input": "Tell a story.", "max_output_tokens": 400, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    stream = client.responses.create(background=True, stream=True, **args)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[1].type == "response.in_progress"
    time.sleep(0.3)  # the router has seen the client go
    assert client.responses.retrieve(events[0].response.id).status == "in_progress"
    done = _finished(client, events[0].response.id)
    foreground = client.responses.create(**args)
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    assert done.usage.output_tokens == 400
    # A client that stays hears the whole of it, the record stored before the last event.
    whole = list(client.responses.create(background=True, stream=True, **args))
    assert (
        whole[-1].type == "response.incomplete" and whole[-1].response.output_text == foreground.output_text
    )
    assert client.responses.retrieve(whole[-1].response.id).status == "incomplete"
    assert wait_until(lambda: _all_free(pd_workers), timeout=15)


def test_a_background_response_streams_again_from_any_point(router: ServiceProcess) -> None:
    """GET ?stream=true of a finished background response: at once, the events of the same greedy request
    streamed in the foreground (types, text, sequence numbers 0..n-1); starting_after=k: those after k."""
    client = _client(router)
    args = {"model": MODEL, "input": "Tell a story.", "max_output_tokens": 24, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    foreground = list(client.responses.create(stream=True, **args))
    done = _finished(client, client.responses.create(background=True, **args).id)
    start = time.monotonic()
    whole = _replay(router, done.id)
    assert time.monotonic() - start < 1.0  # a finished response's log is read whole, not followed
    assert [e["type"] for e in whole] == [e.type for e in foreground]
    assert (
        [e["sequence_number"] for e in whole]
        == list(range(len(whole)))
        == [e.sequence_number for e in foreground]
    )
    assert (
        _text(whole)
        == done.output_text
        == "".join(e.delta for e in foreground if e.type == "response.output_text.delta")
    )
    assert (
        whole[0]["response"]["status"] == "queued"
        and whole[-1]["response"]["output"][0]["content"][0]["text"] == done.output_text
    )
    for k in (0, 5, len(whole) - 2):
        assert _replay(router, done.id, starting_after=k) == whole[k + 1 :]


def test_a_client_that_lost_its_stream_resumes_it(router: ServiceProcess) -> None:
    """While the run goes on: a stream read in part and dropped, then resumed after its last sequence
    number, follows the live events to the end; together they are the whole response."""
    client = _client(router)
    args = {"model": MODEL, "input": "Tell a long story.", "max_output_tokens": 400, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    queued = client.responses.create(background=True, **args)
    first = _replay(router, queued.id, stop_after=6)
    assert client.responses.retrieve(queued.id).status == "in_progress"
    rest = _replay(router, queued.id, starting_after=first[-1]["sequence_number"])
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    done = client.responses.retrieve(queued.id)
    assert (
        done.status == "incomplete" and _text(events) == done.output_text and done.usage.output_tokens == 400
    )


def test_what_cannot_be_streamed_again(router: ServiceProcess) -> None:
    """stream=true of a foreground response: 400; of an unknown one: 404; a bad starting_after: 400; a
    deleted response's events are gone with it (404)."""
    client = _client(router)
    foreground = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    status, body = _get(router, f"/v1/responses/{foreground.id}?stream=true")
    assert status == 400 and "background" in body["error"]["message"]
    status, body = _get(router, f"/v1/responses/{foreground.id}?stream=false")
    assert status == 200 and body["id"] == foreground.id
    status, body = _get(router, "/v1/responses/resp_unknown?stream=true")
    assert status == 404 and "not found" in body["error"]["message"]
    done = _finished(client, client.responses.create(model=MODEL, input="x", background=True, **SHORT).id)
    status, body = _get(router, f"/v1/responses/{done.id}?stream=true&starting_after=abc")
    assert status == 400 and body["error"]["param"] == "starting_after"
    assert _replay(router, done.id)[-1]["type"] == "response.incomplete"
    client.responses.delete(done.id)
    assert _get(router, f"/v1/responses/{done.id}?stream=true")[0] == 404


@needs_redis
def test_any_router_streams_a_background_response_another_runs(pd_workers: Any) -> None:  # noqa: F811
    """With --redis-url: router B streams (from the start, live) a run router A owns; the log is a Redis
    stream with the record's TTL, deleted with the record."""
    import redis

    url = f"{REDIS_URL}/12"
    routers = [_start_router(pd_workers, "--redis-url", url) for _ in range(2)]
    keys = redis.Redis.from_url(url)
    try:
        a, b = (_client(p) for p in routers)
        args = {"model": MODEL, "input": "Tell a long story.", "max_output_tokens": 300, "temperature": 0.0,
                "extra_body": {"ignore_eos": True}}  # fmt: skip
        queued = a.responses.create(background=True, **args)
        assert b.responses.retrieve(queued.id).status in ("queued", "in_progress")  # followed live
        events = _replay(routers[1], queued.id)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
        done = b.responses.retrieve(queued.id)
        assert _text(events) == done.output_text and done.usage.output_tokens == 300
        log_key = f"pdmesh:response-events:{queued.id}"
        assert (
            keys.xlen(log_key) == len(events)
            and 0 < keys.pttl(log_key) <= keys.pttl(f"pdmesh:response:{queued.id}") + 1000
        )
        assert _replay(routers[0], queued.id, starting_after=len(events) - 3) == events[-2:]
        b.responses.delete(queued.id)
        assert (
            not keys.exists(log_key) and _get(routers[0], f"/v1/responses/{queued.id}?stream=true")[0] == 404
        )
    finally:
        for p in routers:
            if p.alive:
                assert p.stop() == 0, p.log()
        for key in keys.scan_iter("pdmesh:*"):
            keys.delete(key)
        keys.close()


@needs_redis
def test_any_router_reads_and_cancels_a_background_response(pd_workers: Any) -> None:  # noqa: F811
    """With --redis-url: a background response router A runs is read through router B, which cancels it;
    A notices (it polls the record) and stops it on the workers; one A completes, B reads; one A still runs
    when it stops is failed."""
    import redis

    url = f"{REDIS_URL}/12"  # a database of this test's own, emptied of its keys at the end
    routers = [_start_router(pd_workers, "--redis-url", url) for _ in range(2)]
    keys = redis.Redis.from_url(url)
    try:
        a, b = (_client(p) for p in routers)
        done = _finished(b, a.responses.create(model=MODEL, input="Hello.", background=True, **SHORT).id)
        assert done.status == "incomplete" and done.output_text == a.responses.retrieve(done.id).output_text
        running = a.responses.create(model=MODEL, input="A long answer " * 20, background=True, **LONG)
        assert wait_until(lambda: b.responses.retrieve(running.id).status == "in_progress", timeout=30)
        assert wait_until(lambda: _stats(pd_workers)[1].num_kv_blocks_free < KV_BLOCKS, timeout=30)
        assert b.responses.cancel(running.id).status == "cancelled"
        assert wait_until(lambda: _all_free(pd_workers), timeout=15), [str(s) for s in _stats(pd_workers)]
        assert a.responses.retrieve(running.id).status == "cancelled"
        # A router that stops fails what it still runs (its record does not stay in_progress) and frees it.
        orphan = a.responses.create(model=MODEL, input="A long answer " * 20, background=True, **LONG)
        assert wait_until(lambda: b.responses.retrieve(orphan.id).status == "in_progress", timeout=30)
        assert routers[0].stop() == 0, routers[0].log()
        failed = b.responses.retrieve(orphan.id)
        assert failed.status == "failed" and "stopped" in failed.error.message
        assert wait_until(lambda: _all_free(pd_workers), timeout=15), [str(s) for s in _stats(pd_workers)]
    finally:
        for p in routers:
            if p.alive:
                assert p.stop() == 0, p.log()
        for key in keys.scan_iter("pdmesh:*"):
            keys.delete(key)
        keys.close()
