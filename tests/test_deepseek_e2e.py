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
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.mesh_fixtures import ServiceProcess, worker_pair

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

    async def run() -> list[tuple[list[int], str, str]]:
        async with grpc.aio.insecure_channel(router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            replies = []
            for prompt in prompts:
                request = router_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=prompt),
                    sampling_params=common_pb2.SamplingParams(
                        max_tokens=16, temperature=0.0, ignore_eos=True
                    ),
                )
                tokens, prefill, decode = [], "", ""
                async for msg in stub.Generate(request, timeout=60):
                    tokens += list(msg.token_ids)
                    prefill, decode = prefill or msg.prefill_worker, decode or msg.decode_worker
                replies.append((tokens, prefill, decode))
            return replies

    replies = asyncio.run(run())
    assert [r[0] for r in replies] == want
    assert all(prefill and decode and prefill != decode for _, prefill, decode in replies)
