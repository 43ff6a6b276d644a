"""A DeepSeek-V3 checkpoint (latent attention, grouped routing, shared experts) over the real mesh: the
prefill worker computes the prompt, its latent KV blocks move to the decode worker over NIXL, and the
streamed tokens equal the offline engine's (which tests/test_parity.py holds to transformers')."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint
from tests.mesh_fixtures import ServiceProcess, router_generate, worker_pair

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds") / "ds", seed=7)


@pytest.fixture(scope="module")
def router(deepseek: Path) -> Iterator[str]:
    model = str(deepseek)
    with worker_pair("--model", model) as (prefill, decode):
        proc = ServiceProcess.start(
            "router", "--model", model, "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address, "--pd-threshold-tokens", "0",
        )  # fmt: skip
        try:
            yield proc.address
        finally:
            assert proc.stop() == 0, proc.log()


def test_disaggregated_tokens_equal_offline(router: str, deepseek: Path) -> None:
    prompts = [[5 + i for i in range(n)] for n in (9, 40)]
    llm = LLM(str(deepseek), dtype="float32", num_kv_blocks=64)
    want = [
        o.token_ids
        for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ]

    replies = router_generate(router, prompts, 16)
    assert [r[0] for r in replies] == want
    assert all(prefill and decode and prefill != decode for _, prefill, decode in replies)


def test_float8_weights_and_latent_kv_move_between_workers(tmp_path: Path) -> None:
    """A DeepSeek-V3 float8 checkpoint (its weights kept in float8) served with a float8 latent pool on
    both workers: the prefill worker's float8 latent blocks move to the decode worker over NIXL (the
    pool's dtype in the layout both sides compare), and the streamed tokens equal the offline engine's with
    the same settings."""
    from tests.checkpoints import quantize_checkpoint

    src = make_checkpoint("deepseek_v3", tmp_path / "src", seed=7)
    quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=(16, 128))
    model = str(tmp_path / "fp8")
    prompts = [[5 + i for i in range(n)] for n in (9, 40)]
    llm = LLM(model, dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    with worker_pair("--model", model, "--kv-cache-dtype", "fp8") as (prefill, decode):
        proc = ServiceProcess.start(
            "router", "--model", model, "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address, "--pd-threshold-tokens", "0",
        )  # fmt: skip
        try:
            replies = router_generate(proc.address, prompts, 16)
        finally:
            assert proc.stop() == 0, proc.log()
    assert [r[0] for r in replies] == want
    assert all(prefill and decode and prefill != decode for _, prefill, decode in replies)


@pytest.mark.parametrize("spec", [[], ["--speculative-config", '{"method": "mtp"}']], ids=["plain", "mtp"])
def test_latent_blocks_go_through_the_kv_offload_store(tmp_path: Path, spec: list[str]) -> None:
    """``tiny-deepseek``'s latent KV blocks, offered to the KV offload store when a prefill worker's lease
    ends, load into a decode worker that never saw the prompt; its tokens are the offline engine's. With
    the MTP draft on the workers and the store (its KV one layer more in every block) too."""
    from protos.pdmesh.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2_grpc
    from tests.mesh_fixtures import until, worker_args
    from tests.test_kv_offload_e2e import BS, MAX_TOKENS, _decode, _prefill

    prompt = [(i * 37) % 250 + 3 for i in range(100)]
    offline = LLM("tiny-deepseek", num_kv_blocks=256, enable_prefix_caching=False)
    expected = offline.generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    store = ServiceProcess.start(
        "kvstore_svc",
        "--model",
        "tiny-deepseek",
        "--metrics-port",
        "0",
        "--host-blocks",
        "32",
        "--disk-blocks",
        "0",
        *spec,
    )
    flags = [
        "--kvstore-address",
        store.address,
        "--kvstore-retry-s",
        "0.5",
        "--kvstore-timeout-s",
        "0.5",
        *spec,
    ]
    procs = [store]
    try:
        a = ServiceProcess.start("prefill_svc", *worker_args("tiny-deepseek", 128, *flags))
        procs.append(a)
        b = ServiceProcess.start("decode_svc", *worker_args("tiny-deepseek", 128, *flags))
        procs.append(b)

        async def run() -> tuple[list[int], int]:
            async with (
                grpc.aio.insecure_channel(a.address) as ca,
                grpc.aio.insecure_channel(b.address) as cb,
                grpc.aio.insecure_channel(store.address) as cs,
            ):
                ks = kvstore_pb2_grpc.KVStoreStub(cs)

                async def stored() -> bool:
                    stats = await ks.GetStats(kvstore_pb2.KVStoreStatsRequest())
                    return stats.num_blocks_put >= len(prompt) // BS

                await _prefill(worker_pb2_grpc.WorkerStub(ca), "a1", prompt)
                assert await until(stored, timeout=10)
                return await _decode(worker_pb2_grpc.WorkerStub(cb), "b1", prompt)

        tokens, cached = asyncio.run(run())
        assert tokens == expected[0].token_ids
        assert cached == (len(prompt) - 1) // BS * BS
    finally:
        for p in reversed(procs):
            assert p.stop() == 0, p.log()[-3000:]
