"""Two decode workers that are the two expert-parallel ranks of one model, as real processes on the CPU.

Each rank (``--expert-parallel-size 2 --expert-parallel-rank R``, gloo over loopback) holds half of the
tiny MoE model's experts and serves its own requests; their MoE layers exchange tokens every step, so the
ranks' serving loops step together (``engine.data_parallel.Lockstep``), and a rank without work joins the
other's steps with idle passes. Requests reach each rank as in ``tests/test_disagg_e2e.py`` (prefill on a
prefill worker, KV pulled over NIXL on host memory): the tokens must equal the offline single-rank
engine's, also for requests that arrive while the other rank is mid-generation, and every KV block must
come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import grpc
import pytest

from engine import LLM, SamplingParams
from mesh.cli import free_port
from protos.pdmesh.v1 import worker_pb2
from tests.mesh_fixtures import ServiceProcess, start_expert_parallel_ranks, worker_args
from tests.test_disagg_e2e import _disaggregated, _free_blocks, _prompts, _proto_params, _sample, _stub

pytestmark = pytest.mark.e2e

BLOCKS = 256


@contextlib.contextmanager
def _prefill_and_two_decode_ranks(*rank_args: str) -> Iterator[tuple[ServiceProcess, list[ServiceProcess]]]:
    init = f"tcp://127.0.0.1:{free_port()}"
    ep = ("--expert-parallel-size", "2", "--distributed-init-method", init, *rank_args)
    prefill = ServiceProcess.start("prefill_svc", *worker_args("tiny-moe", BLOCKS))
    ranks: list[ServiceProcess] = []
    try:
        ranks = start_expert_parallel_ranks("decode_svc", worker_args("tiny-moe", BLOCKS, *ep))
        for r, svc in enumerate(ranks):  # each engine joined the group as its rank (half the experts)
            assert any(f"expert-parallel rank {r} of 2 (gloo)" in line for line in svc.lines), svc.log()
        yield prefill, ranks
    finally:
        ServiceProcess.stop_all([*ranks, prefill])


def test_two_decode_ranks_serve_their_own_requests_and_match_offline() -> None:
    with _prefill_and_two_decode_ranks() as (prefill, ranks):
        _check_ranks(prefill, ranks)


def test_two_decode_ranks_with_asynchronous_scheduling_match_offline() -> None:
    """The same traffic with ``--expert-parallel-async-scheduling``: the ranks run one step ahead."""
    with _prefill_and_two_decode_ranks("--async-scheduling", "--expert-parallel-async-scheduling") as (
        prefill,
        ranks,
    ):
        _check_ranks(prefill, ranks)
        for svc in ranks:  # both ranks decoded requests of their own one step ahead
            assert _sample(svc, "pdmesh_decode_lookahead_steps_total") > 0, svc.log()


def test_two_decode_ranks_with_ngram_drafts_match_offline() -> None:
    """The same traffic with speculative decoding on the ranks (n-gram drafts of 3 tokens): each rank drafts
    for its own requests and verifies in the ranks' lockstep; the tokens are still the offline engine's."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    with _prefill_and_two_decode_ranks("--speculative-config", spec) as (prefill, ranks):
        _check_ranks(prefill, ranks)
        drafted = sum(_sample(svc, "pdmesh_decode_spec_decode_draft_tokens_tokens_total") for svc in ranks)
        assert drafted > 0, "\n".join(svc.log()[-2000:] for svc in ranks)


def test_sigterm_drains_every_rank_before_the_group_stops() -> None:
    """Both ranks get SIGTERM while rank 0 streams a long generation and rank 1 has nothing to do: rank 1
    must keep joining rank 0's steps until rank 0 has drained (a rank that left at once would fail rank
    0's next step), then both exit cleanly."""
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0)
    expected = LLM("tiny-moe", num_kv_blocks=512).generate([prompt], params)[0].token_ids
    with _prefill_and_two_decode_ranks() as (prefill, ranks):

        async def run() -> list[int]:
            (pch, pstub), (dch, dstub) = _stub(prefill.address), _stub(ranks[0].address)
            async with pch, dch:
                task = asyncio.create_task(
                    _disaggregated(pstub, dstub, "drain-0", prompt, _proto_params(params))
                )
                for _ in range(500):  # until rank 0 decodes
                    if (await dstub.GetStats(worker_pb2.StatsRequest())).num_running:
                        break
                    await asyncio.sleep(0.01)
                for rank in ranks:
                    rank.proc.send_signal(signal.SIGTERM)
                return await task

        assert asyncio.run(run()) == expected
        assert [rank.proc.wait(60) for rank in ranks] == [0, 0], "\n".join(r.log()[-3000:] for r in ranks)


def _check_ranks(prefill_proc: ServiceProcess, ranks: list[ServiceProcess]) -> None:
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (24, 3, 9, 1, 16, 5)]
    # Rank 0 takes requests 0-2 at once; rank 1 takes 3-5, the first after rank 0 has started, the rest
    # one after another (so rank 1 idles between them while rank 0 still generates).
    llm = LLM("tiny-moe", num_kv_blocks=512)
    expected = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]

    async def run() -> tuple[list[list[int]], list[int]]:
        pch, prefill = _stub(prefill_proc.address)
        channels_and_stubs = [_stub(r.address) for r in ranks]
        decodes = [stub for _, stub in channels_and_stubs]

        async def one(i: int, rank: int) -> list[int]:
            return await _disaggregated(
                prefill, decodes[rank], f"ep-{i}", prompts[i], _proto_params(params[i])
            )

        async def rank_1_later() -> list[list[int]]:
            await asyncio.sleep(0.3)
            out = []
            for i in (3, 4, 5):
                out.append(await one(i, 1))
                await asyncio.sleep(0.1)
            return out

        async with pch:
            first, later = await asyncio.gather(
                asyncio.gather(*(one(i, 0) for i in range(3))), rank_1_later()
            )
            free = [await _free_blocks(d) for d in decodes]
            for _ in range(100):  # notifications reach the prefill worker's lease keeper
                if await _free_blocks(prefill) == BLOCKS:
                    break
                await asyncio.sleep(0.05)
            free.append(await _free_blocks(prefill))
        for channel, _ in channels_and_stubs:
            await channel.close()
        return [*first, *later], free

    results, free = asyncio.run(run())
    assert results == expected
    assert free == [BLOCKS, BLOCKS, BLOCKS]
    assert all(r.alive for r in ranks)
    # Rank 1 idled between its requests while rank 0 generated: its idle passes and both ranks' time in
    # the per-step agreement show on /metrics.
    assert _sample(ranks[1], "pdmesh_decode_expert_parallel_idle_passes_total") > 0
    for rank in ranks:
        assert _sample(rank, "pdmesh_decode_expert_parallel_sync_seconds_total") > 0
        # On the CPU every pass (idle ones too) runs eagerly, and the workers count them so.
        passes = 'pdmesh_decode_forward_passes_total{kind="%s"}'
        assert _sample(rank, passes % "eager") > 0
        assert _sample(rank, passes % "decode_graph") == _sample(rank, passes % "prefill_graph") == 0


def test_a_rank_whose_group_broke_takes_itself_out_of_rotation() -> None:
    """Rank 1's process dies: rank 0's next step fails (its group can run no pass), so rank 0 turns its
    health NOT_SERVING and refuses requests with the engine-down refusal instead of hanging them."""
    from grpc_health.v1 import health_pb2

    from mesh.grpc_server import check_health, insecure_channel
    from mesh.worker_service import refusal_of

    with _prefill_and_two_decode_ranks() as (prefill, ranks):
        ranks[1].kill()

        async def run() -> tuple[bool, object]:
            async with insecure_channel(ranks[0].address) as channel:
                for _ in range(200):
                    if await check_health(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.05)
                else:
                    return False, None
            (pch, pstub), (dch, dstub) = _stub(prefill.address), _stub(ranks[0].address)
            async with pch, dch:
                params = _proto_params(SamplingParams(max_tokens=4, temperature=0.0))
                try:
                    await _disaggregated(pstub, dstub, "after-break", _prompts(1, seed=3)[0], params)
                except grpc.aio.AioRpcError as exc:
                    # as the router does: the prefill worker's held KV goes back
                    assert (await pstub.Abort(worker_pb2.AbortRequest(request_id="after-break"))).found
                    return True, exc
            return True, None

        not_serving, exc = asyncio.run(run())
        assert not_serving, ranks[0].log()[-3000:]
        assert isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        refusal = refusal_of(exc)
        assert refusal == worker_pb2.REFUSAL_ENGINE_DOWN, exc
