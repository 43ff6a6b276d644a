"""LoRA adapters through the whole mesh: a Qwen3 checkpoint with PEFT adapters, real prefill and decode worker
processes (KV moved over real NIXL), a real router. A completion whose ``model`` names an adapter gives the
offline engine's tokens with that adapter (``LLM.generate(lora_request=...)``), the base model's name the
base tokens; unknown names are 404s; ``/v1/models`` lists the adapters as vLLM does; adapters load and
unload at run time on every worker, and a change that one worker refuses is undone on the others."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.service import RouterService
from tests.checkpoints import make_checkpoint
from tests.mesh_fixtures import ServiceProcess, worker_args, worker_pair
from tests.test_lora import ALL, ATTENTION, write_adapter

pytestmark = pytest.mark.e2e

BASE = "qwen3-base"  # the router's --served-model-name
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31, 64, 12, 8, 77, 140, 200, 19, 23, 61, 88, 4, 150]  # > one block
LORA_FLAGS = ("--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


@dataclass
class LoRAMesh:
    base: Path
    adapters: dict[str, Path]
    prefill: ServiceProcess
    decode: ServiceProcess
    router: ServiceProcess
    http: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def lora_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAMesh]:
    root = tmp_path_factory.mktemp("lora_mesh")
    base = make_checkpoint("qwen3", root / "base", seed=3)
    adapters = {
        "sql": write_adapter(base, root / "sql", seed=1, rank=8, targets=ALL),
        "chat": write_adapter(base, root / "chat", seed=2, rank=4, targets=ATTENTION),  # loaded at run time
    }
    with worker_pair("--model", str(base), *LORA_FLAGS, "--lora-modules", f"sql={adapters['sql']}") as (p, d):
        router = ServiceProcess.start(
            "router", "--model", str(base), "--served-model-name", BASE, "--http-port", "0",
            "--prefill-workers", p.address, "--decode-workers", d.address, "--pd-threshold-tokens", "0",
            "--allow-runtime-lora-updating",
        )  # fmt: skip
        try:
            match = re.search(r"http=(\S+)", next(line for line in router.lines if "ready:" in line))
            assert match is not None
            http = match.group(1)
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0)
            yield LoRAMesh(base, adapters, p, d, router, http, client)
        finally:
            assert router.stop() == 0, router.log()


@pytest.fixture(scope="module")
def offline(lora_mesh: LoRAMesh) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens of PROMPT with each adapter, and without (None)."""
    llm = LLM(
        str(lora_mesh.base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8
    )
    out: dict[str | None, list[int]] = {}
    for i, name in enumerate([None, *lora_mesh.adapters]):
        request = LoRARequest(name, i, str(lora_mesh.adapters[name])) if name else None
        out[name] = llm.generate([PROMPT], GREEDY, lora_request=request)[0].token_ids
    assert len({tuple(t) for t in out.values()}) == 3  # the adapters change the output
    return out


def _complete(mesh: LoRAMesh, model: str) -> Any:
    return mesh.client.completions.create(model=model, prompt="Hi", max_tokens=2)


def _post(http: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST a JSON body to a router's HTTP address; the status and the body's text."""
    request = urllib.request.Request(
        f"http://{http}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _metric_lines(proc: ServiceProcess, name: str) -> list[str]:
    with urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10) as resp:
        return [line for line in resp.read().decode().splitlines() if line.startswith(name)]


def _kv_bytes(mesh: LoRAMesh) -> float:
    (line,) = _metric_lines(mesh.decode, "pdmesh_decode_kv_transfer_bytes_total ")
    return float(line.split()[-1])


def _complete_ids(mesh: LoRAMesh, model: str) -> tuple[list[int], int]:
    """Greedy token ids (by their logprobs' token_id names) and the cached prompt tokens of one completion."""
    reply = mesh.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert reply.model == model
    tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
    return tokens, reply.usage.prompt_tokens_details.cached_tokens


def test_the_model_field_selects_the_adapter_through_prefill_and_decode_workers(
    lora_mesh: LoRAMesh, offline: dict[str | None, list[int]]
) -> None:
    """model=<adapter>: the offline engine's tokens with that adapter, its KV moved from the prefill to the
    decode worker; model=<base>: the base tokens. The prefix cache is the adapter's own: the same prompt
    again finds it cached, the base model finds nothing of it."""
    moved = _kv_bytes(lora_mesh)
    tokens, cached = _complete_ids(lora_mesh, "sql")
    assert tokens == offline["sql"] and cached == 0
    assert _kv_bytes(lora_mesh) > moved  # the decode worker pulled the adapter's KV from the prefill worker
    again, cached = _complete_ids(lora_mesh, "sql")
    assert again == offline["sql"] and cached == 16
    base, cached = _complete_ids(lora_mesh, BASE)
    assert base == offline[None] and cached == 0
    # vLLM's vllm:lora_requests_info: a series for the adapters the decode worker ran, max_lora its slots.
    info = _metric_lines(lora_mesh.decode, "vllm:lora_requests_info{")
    assert any('running_lora_adapters="sql"' in line and 'max_lora="2"' in line for line in info), info


def test_grpc_generate_selects_the_adapter_by_model_or_lora_name(
    lora_mesh: LoRAMesh, offline: dict[str | None, list[int]]
) -> None:
    async def run(**fields: str) -> list[int]:
        params = common_pb2.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=PROMPT), sampling_params=params,
                                             **fields)  # fmt: skip
        tokens: list[int] = []
        async with grpc.aio.insecure_channel(lora_mesh.router.address) as channel:
            async for msg in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
                tokens += msg.token_ids
        return tokens

    assert asyncio.run(run(model="sql")) == offline["sql"]
    assert asyncio.run(run(model=BASE, lora_name="sql")) == offline["sql"]
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        asyncio.run(run(model="nope"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_models_lists_each_adapter_and_an_unknown_model_is_a_404(lora_mesh: LoRAMesh) -> None:
    models = {m.id: m.model_dump() for m in lora_mesh.client.models.list()}
    assert list(models) == [BASE, "sql"]
    assert models["sql"]["parent"] == BASE and models["sql"]["root"] == str(lora_mesh.adapters["sql"])
    assert models[BASE]["parent"] is None
    assert lora_mesh.client.models.retrieve("sql").id == "sql"
    # The Responses API (a chat request underneath) selects the same way, and names the adapter.
    assert lora_mesh.client.responses.create(model="sql", input="Hi", max_output_tokens=2).model == "sql"
    with pytest.raises(openai.NotFoundError) as missing:
        lora_mesh.client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert "`nope` does not exist" in missing.value.message and "`sql`" in missing.value.message


def test_adapters_load_and_unload_at_run_time_on_every_worker(
    lora_mesh: LoRAMesh, offline: dict[str | None, list[int]]
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: the adapter is then served (its tokens
    equal the offline engine's), listed, refused a second load, and gone again after the unload."""
    path = str(lora_mesh.adapters["chat"])
    with pytest.raises(openai.NotFoundError):
        _complete(lora_mesh, "chat")
    status, text = _post(lora_mesh.http, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": path})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert [m.id for m in lora_mesh.client.models.list()] == [BASE, "chat", "sql"]
    assert _complete_ids(lora_mesh, "chat")[0] == offline["chat"]
    status, text = _post(lora_mesh.http, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": path})
    assert status == 400 and "has already been loaded" in text
    status, text = _post(lora_mesh.http, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(lora_mesh, "chat")
    status, text = _post(lora_mesh.http, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "cannot be found" in text
    # An adapter no worker can read: a 400 naming each worker and its reason; nothing was loaded.
    status, text = _post(
        lora_mesh.http, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent"}
    )
    error = json.loads(text)["error"]
    assert status == 400 and error["message"].count("INVALID_ARGUMENT") == 2
    assert "adapter_config.json not found" in error["message"]
    assert [m.id for m in lora_mesh.client.models.list()] == [BASE, "sql"]


def test_a_worker_without_lora_fails_the_load_and_the_others_unload_it(lora_mesh: LoRAMesh) -> None:
    """A mesh where one decode worker runs without --enable-lora (an in-process router over the module's
    workers and that one): the load is a 400 naming it (FAILED_PRECONDITION), and the workers that loaded
    the adapter unload it again; requests for an adapter only some workers serve go to those."""
    plain = ServiceProcess.start("decode_svc", *worker_args(str(lora_mesh.base), 256, "--dtype", "float32"))

    async def run() -> None:
        config = RouterConfig(
            model=str(lora_mesh.base), port=0, http_port=0, prefill_workers=[lora_mesh.prefill.address],
            decode_workers=[lora_mesh.decode.address, plain.address], routing="round_robin",
            allow_runtime_lora_updating=True,
        )  # fmt: skip
        svc = RouterService(config)
        await svc.start()
        http = f"127.0.0.1:{svc.http_port}"
        try:
            body = {"lora_name": "chat", "lora_path": str(lora_mesh.adapters["chat"])}
            status, text = await asyncio.to_thread(_post, http, "/v1/load_lora_adapter", body)
            message = json.loads(text)["error"]["message"]
            assert status == 400 and f"({plain.address}): FAILED_PRECONDITION" in message, message
            assert "--enable-lora" in message and "unloaded again on the 2 worker(s)" in message
            for address in (lora_mesh.prefill.address, lora_mesh.decode.address):
                async with grpc.aio.insecure_channel(address) as channel:
                    stats = await worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest())
                assert [a.name for a in stats.lora_adapters] == ["sql"]
            # "sql" is served by one decode worker of the two: round robin or not, its requests go there.
            for _ in range(2):
                request = {"model": "sql", "prompt": "Hi", "max_tokens": 2}
                status, text = await asyncio.to_thread(_post, http, "/v1/completions", request)
                assert status == 200 and json.loads(text)["model"] == "sql", text
        finally:
            await svc.stop(grace_s=0)

    try:
        asyncio.run(run())
    finally:
        plain.stop()


def test_workers_answer_adapter_changes_with_their_status_codes(lora_mesh: LoRAMesh) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(lora_mesh.decode.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.UnloadLoRAAdapter(worker_pb2.UnloadLoRAAdapterRequest(lora_name="nope"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "sql" in unknown.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.LoadLoRAAdapter(
                    worker_pb2.LoadLoRAAdapterRequest(lora_name="x", lora_path="/nonexistent")
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())
