"""The router's side of LoRA adapters, without workers: the ``model`` field's selection (base model, adapter,
404) as both front ends apply it, the adapters a worker's stats announce, the candidates for an adapter's
request, prefix hashes rooted at the adapter as the workers' KV events are, and the runtime-update
endpoints' switch (off: a 404 saying how to turn them on) and checks."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from mesh.block_hash import block_hashes, root_hash
from mesh.kv_events import BlocksStored, Tier
from mesh.kv_index import InProcessKVIndex
from protos.pdmesh.v1 import common_pb2
from router.chooser import RouteRequest
from router.config import VLLM_RUNTIME_LORA_ENV, RouterConfig
from router.errors import InvalidRequestError, ModelNotFoundError
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.scored_chooser import ScoredChooser
from router.served_model import ServedModel
from router.worker_pool import DECODE, PREFILL, WorkerPool
from tests.mesh_fixtures import async_test
from tests.test_router_api import NOWHERE, running_router

FINGERPRINT = "model-fp"


def _stats(worker_id: str, *adapters: str) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        worker_id=worker_id,
        model_fingerprint=FINGERPRINT,
        block_size=16,
        lora_adapters=[common_pb2.LoRAAdapter(name=a, path=f"/adapters/{a}") for a in adapters],
    )


def _pool() -> WorkerPool:
    """Two decode workers, one serving "sql"; one prefill worker serving "sql" and "chat". Stats arrive as a
    poll would hand them over."""
    pool = WorkerPool(["127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"], block_size=16)
    for w, adapters in zip(pool.workers, (("sql", "chat"), ("sql",), ()), strict=True):
        pool._accept_stats(w, _stats(w.address, *adapters))
    return pool


@async_test
async def test_the_model_field_selects_the_base_model_or_an_adapter() -> None:
    pool = _pool()
    model = ServedModel("tiny-dense", pool, ["base", "alias"], max_model_len=64)
    try:
        assert model.lora_adapters() == {"chat": "/adapters/chat", "sql": "/adapters/sql"}
        for requested in (None, "", "base", "alias"):
            assert model.check_model(requested) is None
        assert model.check_model("sql") == "sql"
        with pytest.raises(
            ModelNotFoundError, match="serves `base`, `alias` and the LoRA adapters `chat`, `sql`"
        ):
            model.check_model("nope")
        # gRPC's lora_name: beside a base model name, or the same adapter as the model field.
        assert model.check_model("base", "sql") == model.check_model("sql", "sql") == "sql"
        assert model.check_model(None, "chat") == "chat"
        with pytest.raises(InvalidRequestError, match="name one"):
            model.check_model("sql", "chat")
        with pytest.raises(ModelNotFoundError, match="`nope` does not exist"):
            model.check_model("base", "nope")
        assert [model.reply_name(n) for n in (None, "alias", "sql", "nope")] == [
            "base",
            "alias",
            "sql",
            "base",
        ]
    finally:
        model.close()
        await pool.close()


@async_test
async def test_adapters_come_from_stats_and_change_replies_and_steer_the_candidates() -> None:
    pool = _pool()
    try:
        prefill, sql_decode, plain_decode = pool.workers
        assert pool.candidates(DECODE, lora_name="sql") == [sql_decode]
        assert pool.candidates(DECODE) == [sql_decode, plain_decode]
        # No worker serves it (stats not yet caught up): every candidate; the worker's refusal says why.
        assert pool.candidates(DECODE, lora_name="new") == [sql_decode, plain_decode]
        # A load's reply is the router's view at once; a poll that began before it does not undo it.
        plain_decode.set_lora_adapters([common_pb2.LoRAAdapter(name="new", path="/adapters/new")])
        pool._accept_stats(plain_decode, _stats(plain_decode.address), lora_current=False)
        assert pool.candidates(DECODE, lora_name="new") == [plain_decode]
        pool._accept_stats(plain_decode, _stats(plain_decode.address))  # a later poll is the truth
        assert "new" not in pool.lora_adapters()
        # A worker of another model is no part of the mesh: its adapters are not the mesh's.
        other = common_pb2.WorkerStats(worker_id="x", model_fingerprint="other", block_size=16,
                                       lora_adapters=[common_pb2.LoRAAdapter(name="alien", path="/a")])  # fmt: skip
        pool._accept_stats(prefill, other)
        assert prefill.excluded_reason and list(pool.lora_adapters()) == ["sql"]
    finally:
        await pool.close()


@async_test
async def test_prefix_hashes_of_an_adapters_request_are_rooted_at_the_adapter() -> None:
    """The router hashes a request with an adapter as the worker's engine does (``root_hash(fingerprint,
    salt, lora_id)``), so the blocks the worker announced for that adapter match, and the base model's
    request with the same prompt matches none of them."""
    pool = WorkerPool(["127.0.0.1:2"], ["127.0.0.1:3"], block_size=16)
    for w in pool.workers:
        pool._accept_stats(w, _stats(w.address, "sql"))
    index = InProcessKVIndex()
    metrics = RouterMetrics()
    chooser = ScoredChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=index))
    prompt = list(range(3, 50))
    announced = block_hashes(prompt, 16, root_hash(FINGERPRINT, None, "sql"))
    index.apply_sync("127.0.0.1:2", [BlocksStored(tuple(announced), Tier.GPU)])
    try:
        with_adapter = RouteRequest("r1", prompt, lora_name="sql")
        choice = await chooser.choose(PREFILL, with_adapter, pool.candidates(PREFILL, lora_name="sql"))
        memo = with_adapter.routing.request
        assert memo.block_hashes == announced and memo.prefix_matches["127.0.0.1:2"]
        assert choice.worker is pool.workers[0]
        base = RouteRequest("r2", prompt)
        await chooser.choose(PREFILL, base, pool.candidates(PREFILL))
        assert not base.routing.request.prefix_matches
    finally:
        await pool.close()


def test_runtime_updating_is_off_unless_the_flag_or_vllms_variable_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VLLM_RUNTIME_LORA_ENV, raising=False)
    assert not RouterConfig().runtime_lora_updating()
    assert RouterConfig(allow_runtime_lora_updating=True).runtime_lora_updating()
    for value, on in (("true", True), ("True", True), ("1", True), ("0", False), ("false", False)):
        monkeypatch.setenv(VLLM_RUNTIME_LORA_ENV, value)
        assert RouterConfig().runtime_lora_updating() is on


def test_the_update_endpoints_refuse_without_the_flag_and_check_their_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VLLM_RUNTIME_LORA_ENV, raising=False)

    async def post(http_port: int, path: str, body: dict[str, str]) -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{http_port}{path}"
        async with aiohttp.ClientSession() as session, session.post(url, data=json.dumps(body)) as resp:
            return resp.status, await resp.json()

    async def run() -> None:
        async with running_router() as svc:
            status, body = await post(
                svc.http_port, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}
            )
            assert status == 404 and "--allow-runtime-lora-updating" in body["error"]["message"]  # type: ignore[index]
        async with running_router(allow_runtime_lora_updating=True) as svc:
            cases = [
                ("/v1/load_lora_adapter", {"lora_name": "a"}, 400, "Both 'lora_name' and 'lora_path'"),
                ("/v1/load_lora_adapter", {"lora_name": "tiny-dense", "lora_path": "/a"}, 400, "base model"),
                ("/v1/unload_lora_adapter", {}, 400, "'lora_name' needs to be provided"),
                ("/v1/unload_lora_adapter", {"lora_name": "a"}, 404, "cannot be found"),
                # Nothing answers at the worker addresses: a 502 naming each worker and its status.
                (
                    "/v1/load_lora_adapter",
                    {"lora_name": "a", "lora_path": "/a"},
                    502,
                    f"({NOWHERE}): UNAVAILABLE",
                ),
            ]
            for path, request, code, fragment in cases:
                status, body = await post(svc.http_port, path, request)
                assert status == code and fragment in body["error"]["message"], (path, body)  # type: ignore[index]

    asyncio.run(run())
