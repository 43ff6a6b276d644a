"""Prefill/decode orchestration against scripted in-process workers: the happy path, every failure rule
(retry, fallback to local prefill, ReleaseKV after a failed decode, clean errors mid-stream), client
disconnects (HTTP and gRPC) that must abort the request on both workers, metrics and trace propagation.

The scripted workers speak the real ``pdmesh.v1.Worker`` protocol over real gRPC; they return fixed
tokens so the router's behaviour is checked, not the engine's (tests/test_router_e2e.py does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from mesh.grpc_server import service_name, start_server
from mesh.telemetry import read_spans_jsonl
from mesh.worker_service import REFUSAL_KEY
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from router.worker_pool import Health
from tests.mesh_fixtures import metric, until

WORKER = service_name(worker_pb2, "Worker")
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that answers with fixed tokens and fails when told to; it records every call."""

    def __init__(
        self,
        role: str,
        text: str = "BCD",
        first: str = "A",
        fail_with: grpc.StatusCode | None = None,
        fail_after: int | None = None,
        delay_s: float = 0.0,
        cached: int = 0,
        finish: int = LENGTH,
        refusal: int | None = None,
    ) -> None:
        self.role = role
        # Failures carry the pdmesh-refusal trailer, as a worker's refusal before doing anything does.
        self.trailers = () if refusal is None else ((REFUSAL_KEY, worker_pb2.Refusal.Name(refusal)),)
        self.tokens = list(text.encode())
        self.first = first.encode()[0]
        self.fail_with = fail_with
        self.fail_after = fail_after
        self.delay_s = delay_s
        self.cached = cached
        self.finish = finish
        self.calls: list[tuple[str, str]] = []
        self.decode_requests: list[worker_pb2.DecodeRequest] = []
        self.traceparents: list[str] = []
        self.address = ""
        self.server: grpc.aio.Server | None = None

    def names(self, rpc: str) -> list[str]:
        return [rid for name, rid in self.calls if name == rpc]

    def _record(self, rpc: str, rid: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((rpc, rid))
        for key, value in context.invocation_metadata() or ():
            if key == "traceparent":
                self.traceparents.append(value)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStats:  # noqa: N802
        role = common_pb2.WORKER_ROLE_PREFILL if self.role == "prefill" else common_pb2.WORKER_ROLE_DECODE
        return common_pb2.WorkerStats(
            role=role, worker_id=f"{self.role}-{self.address}", model_fingerprint="fake", block_size=16,
            max_model_len=256,
        )  # fmt: skip

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:  # noqa: N802
        self._record("Prefill", request.request_id, context)
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"scripted {self.fail_with.name}", self.trailers)
        handle = common_pb2.KVHandle(
            worker_id="p", worker_address=self.address, request_id=request.request_id
        )
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=self.first, kv_handle=handle,
            num_cached_tokens=self.cached,
        )  # fmt: skip

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:  # noqa: N802
        self._record("Decode", request.request_id, context)
        self.decode_requests.append(request)
        if self.fail_with is not None and self.fail_after is None:
            await context.abort(self.fail_with, f"scripted {self.fail_with.name}", self.trailers)
        tokens = self.tokens if request.HasField("kv_handle") else [self.first, *self.tokens]
        try:
            for i, token in enumerate(tokens):
                if self.fail_after is not None and i == self.fail_after:
                    await context.abort(
                        self.fail_with or grpc.StatusCode.INTERNAL, "scripted mid-stream failure"
                    )
                await asyncio.sleep(self.delay_s)
                last = i == len(tokens) - 1
                yield worker_pb2.DecodeResponse(
                    request_id=request.request_id, token_ids=[token], finish_reason=self.finish if last else 0
                )
        except asyncio.CancelledError:
            self.calls.append(("DecodeCancelled", request.request_id))
            raise

    async def Embed(self, request: worker_pb2.EmbedRequest, context: Any) -> worker_pb2.EmbedResponse:  # noqa: N802
        self._record("Embed", request.request_id, context)
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"scripted {self.fail_with.name}", self.trailers)
        value = 1.0 if self.role == "prefill" else 2.0  # says which role answered
        return worker_pb2.EmbedResponse(
            request_id=request.request_id, embedding=[value, float(len(request.prompt_token_ids))],
            num_prompt_tokens=len(request.prompt_token_ids),
        )  # fmt: skip

    async def Abort(self, request: worker_pb2.AbortRequest, context: Any) -> worker_pb2.AbortResponse:  # noqa: N802
        self._record("Abort", request.request_id, context)
        return worker_pb2.AbortResponse(found=True)

    async def ReleaseKV(
        self, request: worker_pb2.ReleaseKVRequest, context: Any
    ) -> worker_pb2.ReleaseKVResponse:  # noqa: N802
        self._record("ReleaseKV", request.request_id, context)
        return worker_pb2.ReleaseKVResponse(released=True)


async def _serve(worker: ScriptedWorker) -> str:
    worker.server, port = await start_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, worker)], [WORKER]
    )
    worker.address = f"127.0.0.1:{port}"
    return worker.address


@contextlib.asynccontextmanager
async def mesh(
    prefill: Sequence[ScriptedWorker], decode: Sequence[ScriptedWorker], **overrides: Any
) -> AsyncIterator[RouterService]:
    for w in [*prefill, *decode]:
        await _serve(w)
    settings: dict[str, Any] = {
        "port": 0,
        "http_port": 0,
        "prefill_workers": [w.address for w in prefill],
        "decode_workers": [w.address for w in decode],
        "control_timeout_s": 2.0,
        "request_timeout_s": 20.0,
        "pd_threshold_tokens": 0,  # these prompts are short: disaggregate them all the same
    }
    settings.update(overrides)
    service = RouterService(RouterConfig(**settings))
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=0)
        for w in [*prefill, *decode]:
            assert w.server is not None
            await w.server.stop(0)


async def _complete(
    svc: RouterService, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{svc.http_port}{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _sse(svc: RouterService, body: dict[str, Any], path: str = "/v1/completions") -> list[Any]:
    """Every event of a streamed completion; the ``[DONE]`` marker as the string "[DONE]"."""
    events: list[Any] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{svc.http_port}{path}", json={**body, "stream": True}) as r,
    ):
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- the happy paths --------------------------------------------------------------------------------


def test_disaggregated_request_sends_first_token_then_decode_stream() -> None:
    prefill, decode = ScriptedWorker("prefill", cached=16), ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            status, body = await _complete(svc, {"prompt": "hello", "max_tokens": 4})
            assert status == 200, body
            assert body["choices"][0]["text"] == "ABCD" and body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {
                "prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 16},
            }  # fmt: skip
            (req,) = decode.decode_requests
            assert (
                req.HasField("kv_handle") and req.first_token_id == ord("A") and req.num_cached_tokens == 16
            )
            assert req.sampling_params.max_tokens == 4 and list(req.prompt_token_ids) == [256, *b"hello"]
            assert metric(svc.metrics, "pdmesh_router_prefix_hit_tokens_total", {"tier": "gpu"}) == 16
            assert metric(svc.metrics, "pdmesh_router_generated_tokens_total") == 4
            assert metric(svc.metrics, "pdmesh_router_ttft_seconds_count") == 1
            assert (
                metric(
                    svc.metrics, "pdmesh_router_decisions_total", {"role": "pd", "reason": "long_uncached"}
                )
                == 1
            )
            assert (
                metric(
                    svc.metrics, "pdmesh_router_requests_total", {"endpoint": "completions", "status": "ok"}
                )
                == 1
            )
        assert prefill.names("Abort") == [] and prefill.names("ReleaseKV") == []

    asyncio.run(run())


def test_without_prefill_workers_the_decode_worker_prefills() -> None:
    decode = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([], [decode]) as svc:
            events = await _sse(svc, {"prompt": "x", "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "ABCD"
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
            assert not decode.decode_requests[0].HasField("kv_handle")
            assert (
                metric(
                    svc.metrics,
                    "pdmesh_router_decisions_total",
                    {"role": "pd", "reason": "no_prefill_worker"},
                )
                == 1
            )

    asyncio.run(run())


def test_stop_string_is_cut_from_the_text() -> None:
    decode = ScriptedWorker("decode", text="bcSTOP", first="a", finish=STOP)

    async def run() -> None:
        async with mesh([], [decode]) as svc:
            _, body = await _complete(svc, {"prompt": "x", "stop": ["STOP"]})
            assert body["choices"][0]["text"] == "abc" and body["choices"][0]["stop_reason"] == "STOP"
            events = await _sse(svc, {"prompt": "x", "stop": "STOP"})
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
            assert events[-2]["choices"][0]["finish_reason"] == "stop"

    asyncio.run(run())


def test_stop_token_is_the_stop_reason() -> None:
    decode = ScriptedWorker("decode", text="bc!", first="a", finish=STOP)

    async def run() -> None:
        async with mesh([], [decode]) as svc:
            _, body = await _complete(svc, {"prompt": "x", "stop_token_ids": [ord("!")]})
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["stop_reason"] == ord("!")
            events = await _sse(svc, {"prompt": "x", "stop_token_ids": [ord("!")]})
            assert events[-2]["choices"][0]["stop_reason"] == ord("!")
            # Stopped on a token that is not a stop token (an EOS): no stop reason.
            _, body = await _complete(svc, {"prompt": "x", "stop_token_ids": [ord("?")]})
            assert body["choices"][0]["stop_reason"] is None

    asyncio.run(run())


# ---- failures ---------------------------------------------------------------------------------------


def test_failed_prefill_worker_is_replaced_by_the_next() -> None:
    bad = ScriptedWorker("prefill", fail_with=grpc.StatusCode.UNAVAILABLE)
    good = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode")

    async def run() -> None:
        # Round-robin makes the bad worker certain to be tried first for one of the two requests.
        async with mesh([bad, good], [decode], routing="round_robin") as svc:
            for _ in range(2):
                status, body = await _complete(svc, {"prompt": "x"})
                assert status == 200 and body["choices"][0]["text"] == "ABCD"
            assert len(bad.names("Prefill")) >= 1 and len(good.names("Prefill")) == 2
            assert all(r.HasField("kv_handle") for r in decode.decode_requests)
            assert metric(svc.metrics, "pdmesh_router_retries_total", {"role": "prefill"}) >= 1

    asyncio.run(run())


def test_when_every_prefill_worker_fails_the_decode_worker_prefills() -> None:
    bad = ScriptedWorker("prefill", fail_with=grpc.StatusCode.INTERNAL)
    decode = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([bad], [decode]) as svc:
            status, body = await _complete(svc, {"prompt": "x"})
            assert status == 200 and body["choices"][0]["text"] == "ABCD"
            assert not decode.decode_requests[0].HasField("kv_handle")
            assert await until(lambda: bad.names("Abort") != [])
            assert (
                metric(
                    svc.metrics, "pdmesh_router_decisions_total", {"role": "pd", "reason": "prefill_failed"}
                )
                == 1
            )

    asyncio.run(run())


def test_decode_refusal_before_any_token_is_retried_with_the_same_kv_handle() -> None:
    prefill = ScriptedWorker("prefill")
    bad = ScriptedWorker("decode", fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)
    good = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([prefill], [bad, good], stats_interval_s=60.0) as svc:
            for _ in range(2):
                svc.pool.workers[-1].health = Health.DOWN  # the first attempt goes to `bad`
                status, body = await _complete(svc, {"prompt": "x"})
                assert status == 200 and body["choices"][0]["text"] == "ABCD"
            assert len(bad.names("Decode")) == 2 and len(good.names("Decode")) == 2
            handles = {r.kv_handle.request_id for r in good.decode_requests}
            assert handles == set(prefill.names("Prefill"))
            assert await until(lambda: len(bad.names("Abort")) == len(bad.names("Decode")))
            assert prefill.names("ReleaseKV") == []

    asyncio.run(run())


def test_decode_failure_that_may_have_spent_the_kv_is_retried_with_a_local_prefill() -> None:
    """INTERNAL may come after the worker read the blocks (and the prefill worker freed them): the retry
    prefills on the next decode worker, whose first token equals the one the client already has."""
    prefill = ScriptedWorker("prefill")
    bad = ScriptedWorker("decode", fail_with=grpc.StatusCode.INTERNAL)
    good = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([prefill], [bad, good], stats_interval_s=60.0) as svc:
            svc.pool.workers[-1].health = Health.DOWN  # the first attempt goes to `bad`
            events = await _sse(svc, {"prompt": "x", "max_tokens": 4})
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ABCD"
            (retry,) = good.decode_requests
            assert not retry.HasField("kv_handle") and not retry.HasField("first_token_id")
            assert await until(lambda: prefill.names("ReleaseKV") == prefill.names("Prefill"))
            # Another first token on the retry (unseeded sampling would do that): a clean error.
            good.first = ord("Z")
            svc.pool.workers[-1].health = Health.DOWN
            status, body = await _complete(svc, {"prompt": "x", "max_tokens": 4})
            assert status == 502 and "another first token" in body["error"]["message"]

    asyncio.run(run())


def test_decode_failure_with_no_other_worker_releases_the_prefill_kv() -> None:
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            status, body = await _complete(svc, {"prompt": "x"})
            assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
            assert "RESOURCE_EXHAUSTED" in body["error"]["message"]
            assert await until(lambda: prefill.names("ReleaseKV") == prefill.names("Prefill"))

    asyncio.run(run())


def test_invalid_argument_from_a_worker_is_a_400_with_its_message() -> None:
    prefill = ScriptedWorker("prefill", fail_with=grpc.StatusCode.INVALID_ARGUMENT)

    async def run() -> None:
        async with mesh([prefill], [ScriptedWorker("decode")]) as svc:
            status, body = await _complete(svc, {"prompt": "x"})
            assert status == 400 and body["error"]["message"] == "scripted INVALID_ARGUMENT"

    asyncio.run(run())


def test_decode_failure_mid_stream_is_a_clean_error_and_not_retried() -> None:
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", text="BCDEFG", fail_after=2, fail_with=grpc.StatusCode.INTERNAL)
    spare = ScriptedWorker("decode", text="xyz")

    async def run() -> None:
        async with mesh([prefill], [decode, spare], stats_interval_s=60.0) as svc:
            svc.pool.workers[
                -1
            ].health = Health.DOWN  # only `decode` takes requests; `spare` could take a retry
            events = await _sse(svc, {"prompt": "x", "max_tokens": 10})
            assert "[DONE]" not in events
            assert events[-1]["error"]["type"] == "BadGatewayError"
            assert "after streaming had begun" in events[-1]["error"]["message"]
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ABC"
            status, body = await _complete(svc, {"prompt": "x", "max_tokens": 10})
            assert status == 502 and "after streaming had begun" in body["error"]["message"]
            assert len(decode.names("Decode")) == 2 and spare.names("Decode") == []
            labels = {"endpoint": "completions", "status": "upstream_error"}
            assert metric(svc.metrics, "pdmesh_router_requests_total", labels) == 2

    asyncio.run(run())


def test_a_responses_stream_that_fails_mid_stream_ends_with_an_error_event() -> None:
    """The Responses API: a decode failure after its first text is an ``error`` event (no
    response.completed); before any event, the whole request is a 502 with the same message."""
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", text="BCDEFG", fail_after=2, fail_with=grpc.StatusCode.INTERNAL)

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            body = {"input": "x", "max_output_tokens": 10}
            events = await _sse(svc, body, "/v1/responses")
            kinds = [e["type"] for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "error"
            assert "response.completed" not in kinds and "after streaming had begun" in events[-1]["message"]
            assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "ABC"
            status, reply = await _complete(svc, body, "/v1/responses")
            assert status == 502 and "after streaming had begun" in reply["error"]["message"]
            labels = {"endpoint": "responses", "status": "upstream_error"}
            assert metric(svc.metrics, "pdmesh_router_requests_total", labels) == 2

    asyncio.run(run())


def test_mid_stream_failure_is_not_retried() -> None:
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", text="BCDEFG", fail_after=2, fail_with=grpc.StatusCode.UNAVAILABLE)

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            status, body = await _complete(svc, {"prompt": "x", "max_tokens": 10})
            assert status == 502 and "after streaming had begun" in body["error"]["message"]
            assert len(decode.names("Decode")) == 1

    asyncio.run(run())


# ---- cancellation -----------------------------------------------------------------------------------


def test_http_client_disconnect_aborts_the_request_on_both_workers() -> None:
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", text="B" * 200, delay_s=0.02)

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            url = f"http://127.0.0.1:{svc.http_port}/v1/completions"
            body = {"prompt": "x", "max_tokens": 200, "stream": True}
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
                await resp.content.readline()  # the first event
                resp.close()
            assert await until(lambda: decode.names("Abort") != [] and prefill.names("Abort") != [])
            assert decode.names("DecodeCancelled") == decode.names("Decode")
            assert await until(lambda: svc.metrics.in_flight._value.get() == 0)
            assert (
                metric(
                    svc.metrics,
                    "pdmesh_router_requests_total",
                    {"endpoint": "completions", "status": "cancelled"},
                )
                == 1
            )
            # Non-streaming: the client gives up before the reply.
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
                    await session.post(url, json={"prompt": "y", "max_tokens": 200})
            assert await until(lambda: len(decode.names("Abort")) == 2 and len(prefill.names("Abort")) == 2)

    asyncio.run(run())


def test_cancelled_grpc_generate_aborts_the_request_on_both_workers() -> None:
    prefill = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode", text="B" * 200, delay_s=0.02)

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                call = stub.Generate(
                    router_pb2.GenerateRequest(
                        request_id="g1", text="x", sampling_params=common_pb2.SamplingParams(max_tokens=200)
                    )
                )
                first = await call.read()
                second = await call.read()
                assert list(first.token_ids) == [ord("A")] and first.prefill_worker
                assert list(second.token_ids) == [ord("B")] and second.decode_worker
                call.cancel()
            assert await until(lambda: decode.names("Abort") == ["g1"] and prefill.names("Abort") == ["g1"])
            assert decode.names("DecodeCancelled") == ["g1"]

    asyncio.run(run())


def test_disconnect_between_prefill_and_decode_releases_the_kv() -> None:
    class SlowPrefill(ScriptedWorker):
        async def Prefill(self, request: Any, context: Any) -> worker_pb2.PrefillResponse:  # noqa: N802
            await asyncio.sleep(0.5)
            return await super().Prefill(request, context)

    prefill = SlowPrefill("prefill")
    decode = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([prefill], [decode]) as svc:
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
                    await session.post(
                        f"http://127.0.0.1:{svc.http_port}/v1/completions", json={"prompt": "x"}
                    )
            assert await until(lambda: prefill.names("ReleaseKV") != [] and prefill.names("Abort") != [])
            assert decode.names("Decode") == []

    asyncio.run(run())


# ---- tracing ----------------------------------------------------------------------------------------


def test_one_trace_per_request_reaches_the_workers(tmp_path: Path) -> None:
    prefill, decode = ScriptedWorker("prefill"), ScriptedWorker("decode")
    trace_file = tmp_path / "spans.jsonl"
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"

    async def run() -> None:
        async with (
            mesh([prefill], [decode], trace_file=str(trace_file)) as svc,
            aiohttp.ClientSession() as session,
        ):
            headers = {"traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"}
            url = f"http://127.0.0.1:{svc.http_port}/v1/completions"
            async with session.post(url, json={"prompt": "x"}, headers=headers) as resp:
                assert resp.status == 200

    asyncio.run(run())
    spans = {s["name"]: s for s in read_spans_jsonl(trace_file)}
    assert {"generate", "route", "prefill", "decode"} <= set(spans)
    assert {s["trace_id"] for s in spans.values()} == {parent_trace}
    for child in ("route", "prefill", "decode"):
        assert spans[child]["parent_id"] == spans["generate"]["span_id"]
    assert spans["generate"]["service"] == "pdmesh-router"
    assert prefill.traceparents[0].split("-")[1] == parent_trace
    assert prefill.traceparents[0].split("-")[2] == spans["prefill"]["span_id"]
    assert decode.traceparents[0].split("-")[2] == spans["decode"]["span_id"]


def test_a_refused_decode_keeps_its_kv_handle_and_a_broken_one_does_not() -> None:
    """UNAVAILABLE counts as "KV untouched" only with a worker's refusal in its trailing metadata (or in
    gRPC's words for a channel that never connected); any other UNAVAILABLE may have come after the pull
    started, whatever its text says."""
    from grpc.aio import AioRpcError

    from router.orchestrator import _kv_untouched

    def error(code: grpc.StatusCode, details: str, refusal: str | None = None) -> AioRpcError:
        trailers = grpc.aio.Metadata() if refusal is None else grpc.aio.Metadata((REFUSAL_KEY, refusal))
        return AioRpcError(code, grpc.aio.Metadata(), trailers, details=details)

    unavailable = grpc.StatusCode.UNAVAILABLE
    assert _kv_untouched(error(unavailable, "worker d-1 is draining", "REFUSAL_DRAINING"))
    assert _kv_untouched(error(unavailable, "worker d-1: engine is not running", "REFUSAL_ENGINE_DOWN"))
    assert _kv_untouched(error(unavailable, "a newer worker's reason", "REFUSAL_FROM_THE_FUTURE"))
    assert _kv_untouched(error(unavailable, "failed to connect to all addresses"))
    assert _kv_untouched(error(grpc.StatusCode.FAILED_PRECONDITION, "fingerprint mismatch"))
    assert not _kv_untouched(error(unavailable, "Socket closed"))
    assert not _kv_untouched(error(unavailable, "worker d-1 is draining"))  # the words alone say nothing
    assert not _kv_untouched(error(grpc.StatusCode.INTERNAL, "worker d-1 is draining", "REFUSAL_DRAINING"))


@pytest.mark.parametrize("refused", [True, False])
def test_an_unavailable_decode_is_retried_with_the_same_kv_handle_only_when_refused(refused: bool) -> None:
    prefill = ScriptedWorker("prefill")
    refusal = worker_pb2.REFUSAL_DRAINING if refused else None
    bad = ScriptedWorker("decode", fail_with=grpc.StatusCode.UNAVAILABLE, refusal=refusal)
    good = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([prefill], [bad, good], stats_interval_s=60.0) as svc:
            svc.pool.workers[-1].health = Health.DOWN  # the first attempt goes to `bad`
            status, body = await _complete(svc, {"prompt": "x"})
            assert status == 200 and body["choices"][0]["text"] == "ABCD"
            (retry,) = good.decode_requests
            assert retry.HasField("kv_handle") == refused
            if not refused:  # the handle may be spent: the prefill worker's blocks are let go
                assert await until(lambda: prefill.names("ReleaseKV") == prefill.names("Prefill"))

    asyncio.run(run())


def test_embeddings_go_to_a_prefill_worker_and_are_retried_on_the_next() -> None:
    """An embedding goes to a prefill worker; one that fails with a retryable status is replaced by the
    next; with every prefill worker failing, a decode worker computes it; INVALID_ARGUMENT is the
    request's 400, not retried. The inputs of one request run as one call each."""
    bad = ScriptedWorker("prefill", fail_with=grpc.StatusCode.UNAVAILABLE)
    good = ScriptedWorker("prefill")
    decode = ScriptedWorker("decode")

    async def run() -> None:
        async with mesh([bad, good], [decode], routing="round_robin") as svc:
            for _ in range(2):
                status, body = await _complete(svc, {"input": ["x", "yz"]}, "/v1/embeddings")
                assert status == 200, body
                assert [d["embedding"] for d in body["data"]] == [[1.0, 2.0], [1.0, 3.0]]  # BOS + bytes
                assert body["usage"]["prompt_tokens"] == 5
            assert bad.names("Embed") and len(good.names("Embed")) == 4 and not decode.names("Embed")
        async with mesh([ScriptedWorker("prefill", fail_with=grpc.StatusCode.UNAVAILABLE)], [decode]) as svc:
            status, body = await _complete(svc, {"input": "x"}, "/v1/embeddings")
            assert status == 200 and body["data"][0]["embedding"] == [2.0, 2.0]
        refusing = ScriptedWorker("prefill", fail_with=grpc.StatusCode.INVALID_ARGUMENT)
        other = ScriptedWorker("prefill")
        async with mesh([refusing, other], [ScriptedWorker("decode")], routing="round_robin") as svc:
            status, body = await _complete(svc, {"input": "x"}, "/v1/embeddings")
            if status == 400:  # round robin picked the refusing worker first: its status, not a retry
                assert body["error"]["message"] == "scripted INVALID_ARGUMENT" and not other.names("Embed")
            else:
                assert status == 200 and not refusing.names("Embed")
            status, body = await _complete(svc, {"input": "x"}, "/v1/embeddings")
            assert {len(refusing.names("Embed")), len(other.names("Embed"))} == {1}

    asyncio.run(run())
