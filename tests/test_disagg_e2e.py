"""Prefill and decode workers as real processes, KV moved over real NIXL (host memory), real gRPC.

Disaggregated output must equal the offline engine's, token for token; aborts and failures must give
every KV block back.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from engine import LLM, SamplingParams
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.mesh_fixtures import ServiceProcess, pd_workers, worker_args, worker_pair  # noqa: F401

pytestmark = pytest.mark.e2e


def _stub(address: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, worker_pb2_grpc.WorkerStub(channel)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(0, 256) for _ in range(rng.choice([3, 15, 16, 17, 40, 100, 180]))] for _ in range(n)
    ]


def _proto_params(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


async def _disaggregated(
    prefill,
    decode,
    rid: str,
    prompt: list[int],
    params: common_pb2.SamplingParams,
) -> list[int]:
    first = await prefill.Prefill(
        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params), timeout=60
    )
    tokens = [first.first_token_id]
    if first.finish_reason:
        return tokens
    req = worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        kv_handle=first.kv_handle,
        first_token_id=first.first_token_id,
    )
    async for msg in decode.Decode(req, timeout=60):
        tokens += list(msg.token_ids)
    return tokens


async def _free_blocks(stub) -> int:
    return (await stub.GetStats(worker_pb2.StatsRequest())).num_kv_blocks_free


@pytest.fixture(scope="module")
def pd_workers_lookahead() -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """The same two workers with asynchronous scheduling on (the default on GPUs; off on the CPU)."""
    with worker_pair("--async-scheduling") as pair:
        yield pair


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_disaggregated_equals_offline_for_32_concurrent_requests(pd_workers, seeded) -> None:  # noqa: F811
    _check_32_concurrent(*pd_workers, seeded)


def test_disaggregated_with_lookahead_equals_offline(pd_workers_lookahead) -> None:
    """Both workers one decode step ahead (imports, held KV and arrivals drain it): the same tokens as the
    offline synchronous engine, every block given back, and the decode worker really ran ahead."""
    _, decode_proc = pd_workers_lookahead
    before = _sample(decode_proc, "pdmesh_decode_lookahead_steps_total")
    _check_32_concurrent(*pd_workers_lookahead, seeded=True)
    assert _sample(decode_proc, "pdmesh_decode_lookahead_steps_total") > before
    assert _sample(decode_proc, "pdmesh_decode_lookahead_drains_total") > 0


def _sample(proc: ServiceProcess, name: str) -> float:
    """One unlabelled sample of a worker's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def _check_32_concurrent(prefill_proc: ServiceProcess, decode_proc: ServiceProcess, seeded: bool) -> None:
    prompts = _prompts(32, seed=7 if seeded else 8)
    params = [
        SamplingParams(
            max_tokens=random.Random(i).choice([1, 5, 24]),
            ignore_eos=True,
            temperature=0.8 if seeded else 0.0,
            top_p=0.9 if seeded else 1.0,
            seed=1000 + i if seeded else None,
        )
        for i in range(32)
    ]
    llm = LLM("tiny-dense", num_kv_blocks=512)
    expected = [o.token_ids for o in llm.generate(prompts, params)]

    async def run() -> tuple[list[list[int]], int, int]:
        pch, prefill = _stub(prefill_proc.address)
        dch, decode = _stub(decode_proc.address)
        async with pch, dch:
            results = await asyncio.gather(
                *[
                    _disaggregated(prefill, decode, f"req-{seeded}-{i}", p, _proto_params(sp))
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                ]
            )
            for _ in range(100):  # notifications reach the prefill worker's lease keeper
                if await _free_blocks(prefill) == 256:
                    break
                await asyncio.sleep(0.05)
            return results, await _free_blocks(prefill), await _free_blocks(decode)

    results, prefill_free, decode_free = asyncio.run(run())
    assert results == expected
    assert prefill_free == 256 and decode_free == 256


def test_local_prefill_on_decode_worker_equals_offline(pd_workers) -> None:  # noqa: F811
    _, decode_proc = pd_workers
    prompt = _prompts(1, seed=3)[0]
    expected = (
        LLM("tiny-dense", num_kv_blocks=64)
        .generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        .token_ids
    )

    async def run() -> list[int]:
        ch, decode = _stub(decode_proc.address)
        async with ch:
            tokens: list[int] = []
            req = worker_pb2.DecodeRequest(
                request_id="local-1",
                prompt_token_ids=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            )
            async for msg in decode.Decode(req, timeout=30):
                tokens += list(msg.token_ids)
            return tokens

    assert asyncio.run(run()) == expected


def test_abort_mid_stream_returns_every_block(pd_workers) -> None:  # noqa: F811
    """A client that goes away mid-stream (CANCELLED on its side) and a request stopped by the Abort RPC
    (its stream ends OK on a FINISH_REASON_ABORT message) both give every block back, on both workers."""
    prefill_proc, decode_proc = pd_workers
    unfinished = common_pb2.FINISH_REASON_UNSPECIFIED

    async def run() -> None:
        pch, prefill = _stub(prefill_proc.address)
        dch, decode = _stub(decode_proc.address)
        async with pch, dch:
            params = common_pb2.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            prompt = _prompts(1, seed=5)[0]
            first = await prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="abort-me", prompt_token_ids=prompt, sampling_params=params
                )
            )
            assert first.finish_reason == unfinished and first.kv_handle.block_ids
            call = decode.Decode(
                worker_pb2.DecodeRequest(
                    request_id="abort-me",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    kv_handle=first.kv_handle,
                    first_token_id=first.first_token_id,
                )
            )
            got = 0
            async for msg in call:
                assert msg.finish_reason == unfinished
                got += len(msg.token_ids)
                if got >= 5:
                    break
            assert call.cancel()  # the client goes away mid-stream
            assert await call.code() == grpc.StatusCode.CANCELLED

            # A second request (prefilled on the decode worker) stopped through the Abort RPC instead.
            call2 = decode.Decode(
                worker_pb2.DecodeRequest(
                    request_id="abort-rpc", prompt_token_ids=prompt, sampling_params=params
                )
            )
            async for msg in call2:
                assert msg.finish_reason == unfinished
                break
            assert (await decode.Abort(worker_pb2.AbortRequest(request_id="abort-rpc"))).found
            reasons = [msg.finish_reason async for msg in call2]  # raises if the stream ends in an error
            assert reasons and reasons[-1] == common_pb2.FINISH_REASON_ABORT
            assert set(reasons[:-1]) <= {unfinished}
            assert await call2.code() == grpc.StatusCode.OK

            for _ in range(100):
                if await _free_blocks(decode) == 256 and await _free_blocks(prefill) == 256:
                    break
                await asyncio.sleep(0.05)
            assert await _free_blocks(prefill) == 256
            assert await _free_blocks(decode) == 256
            # Neither request lingers anywhere: aborting them again finds nothing.
            for stub, rid in ((decode, "abort-me"), (decode, "abort-rpc"), (prefill, "abort-me")):
                assert not (await stub.Abort(worker_pb2.AbortRequest(request_id=rid))).found, rid
            stats = await decode.GetStats(worker_pb2.StatsRequest())
            assert stats.num_running == 0 and stats.num_waiting == 0

    asyncio.run(run())


def test_malformed_requests_get_invalid_argument(pd_workers) -> None:  # noqa: F811
    prefill_proc, decode_proc = pd_workers

    async def run() -> list[tuple[grpc.StatusCode, str]]:
        pch, prefill = _stub(prefill_proc.address)
        dch, decode = _stub(decode_proc.address)
        errors = []
        async with pch, dch:
            bad = [
                (prefill.Prefill, worker_pb2.PrefillRequest(request_id="e1", prompt_token_ids=[])),
                (prefill.Prefill, worker_pb2.PrefillRequest(request_id="e2", prompt_token_ids=[1, 9999])),
                (
                    prefill.Prefill,
                    worker_pb2.PrefillRequest(
                        request_id="e3",
                        prompt_token_ids=[1],
                        sampling_params=common_pb2.SamplingParams(top_p=0.0),
                    ),
                ),
                (prefill.Prefill, worker_pb2.PrefillRequest(request_id="e4", prompt_token_ids=[1] * 5000)),
            ]
            for fn, req in bad:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await fn(req, timeout=10)
                errors.append((info.value.code(), info.value.details()))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in decode.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="e5",
                        prompt_token_ids=[1, 2],
                        sampling_params=common_pb2.SamplingParams(temperature=-1.0),
                    ),
                    timeout=10,
                ):
                    pass
            errors.append((info.value.code(), info.value.details()))
            assert await _free_blocks(prefill) == 256 and await _free_blocks(decode) == 256
        return errors

    errors = asyncio.run(run())
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors), errors
    messages = [m for _, m in errors]
    assert "prompt is empty" in messages[0]
    assert "outside the vocabulary" in messages[1]
    assert "top_p must be in (0, 1]" in messages[2]
    assert "max_model_len is 4096" in messages[3]
    assert "temperature must be >= 0" in messages[4]


def test_fingerprint_mismatch_is_clear_error_and_moves_no_bytes(pd_workers) -> None:  # noqa: F811
    prefill_proc, _ = pd_workers
    other = ServiceProcess.start("decode_svc", *worker_args("tiny-dense", 256, "--dtype", "bfloat16"))
    try:

        async def run() -> tuple[grpc.StatusCode, str, int]:
            pch, prefill = _stub(prefill_proc.address)
            dch, decode = _stub(other.address)
            async with pch, dch:
                params = common_pb2.SamplingParams(max_tokens=5, temperature=0.0)
                prompt = list(range(40))
                first = await prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="fp-1", prompt_token_ids=prompt, sampling_params=params
                    )
                )
                req = worker_pb2.DecodeRequest(
                    request_id="fp-1",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    kv_handle=first.kv_handle,
                    first_token_id=first.first_token_id,
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in decode.Decode(req, timeout=20):
                        pass
                # The prefill worker still holds the blocks (nothing was read); the router would release them.
                held = 256 - await _free_blocks(prefill)
                released = await prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="fp-1"))
                assert released.released and released.num_blocks_freed == held
                return info.value.code(), info.value.details(), held

        code, message, held = asyncio.run(run())
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "fingerprint mismatch" in message
        assert held == 3
    finally:
        other.stop()


def test_killed_decode_worker_and_lease_expiry(pd_workers) -> None:  # noqa: F811
    prefill_proc = ServiceProcess.start("prefill_svc", *worker_args("tiny-dense", 128, "--kv-lease-s", "1.5"))
    decode_proc = ServiceProcess.start("decode_svc", *worker_args("tiny-dense", 128))
    try:

        async def run() -> tuple[grpc.StatusCode, int, int]:
            pch, prefill = _stub(prefill_proc.address)
            dch, decode = _stub(decode_proc.address)
            async with pch, dch:
                params = common_pb2.SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
                prompt = list(range(60))
                # One handed-off request whose decode worker dies before pulling: the lease frees it.
                orphan = await prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="orphan", prompt_token_ids=prompt, sampling_params=params
                    )
                )
                held = 128 - await _free_blocks(prefill)
                # One request streaming when the decode worker is killed.
                live = await prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="live", prompt_token_ids=prompt, sampling_params=params
                    )
                )
                call = decode.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="live",
                        prompt_token_ids=prompt,
                        sampling_params=params,
                        kv_handle=live.kv_handle,
                        first_token_id=live.first_token_id,
                    )
                )
                code = None
                try:
                    n = 0
                    async for msg in call:
                        n += len(msg.token_ids)
                        if n >= 3:
                            decode_proc.kill()
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                assert orphan.kv_handle.block_ids
                for _ in range(60):
                    if await _free_blocks(prefill) == 128:
                        break
                    await asyncio.sleep(0.1)
                return code, held, await _free_blocks(prefill)

        code, held, free_after = asyncio.run(run())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert held == 4
        assert free_after == 128  # the orphan's lease ended; the live request's blocks went on notification
        assert prefill_proc.alive
    finally:
        decode_proc.kill()
        prefill_proc.stop()
