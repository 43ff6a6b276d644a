"""Sequence classifiers over the real mesh (router, prefill and decode worker processes) on a random-weight
cross-encoder written with transformers' ``Qwen3ForSequenceClassification`` (one label): vLLM's
``/classify``, ``/score`` and ``/rerank`` (each pair one prompt by the tokenizer's pair template, the
classifier's sigmoid), and ``pdmesh.v1.Router/Classify`` give the offline engine's numbers; the classifier
still embeds and refuses to generate; a model without a classification head refuses ``/classify``."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine import LLM
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.mesh_fixtures import ServiceProcess, worker_pair
from tests.test_classify import classifier, with_pair_template

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_pair_template(classifier("qwen3", tmp_path_factory.mktemp("ce") / "ce", num_labels=1))


@pytest.fixture(scope="module")
def mesh(cross_encoder: Path) -> Iterator[tuple[str, str]]:
    """The HTTP and gRPC addresses of a router over one prefill and one decode worker."""
    model = str(cross_encoder)
    with worker_pair("--model", model) as (prefill, decode):
        proc = ServiceProcess.start(
            "router", "--model", model, "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address,
        )  # fmt: skip
        try:
            line = next(line for line in proc.lines if "ready:" in line)
            yield line.split("http=")[1].split()[0], proc.address
        finally:
            assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def llm(cross_encoder: Path) -> LLM:
    return LLM(str(cross_encoder), dtype="float32", num_kv_blocks=128)


def _post(http: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{http}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_classify_score_and_rerank_equal_offline(mesh: tuple[str, str], llm: LLM) -> None:
    http, _ = mesh
    texts = ["a cat is a small animal", "stocks fell today"]
    want = llm.classify(texts)
    got = _post(http, "/classify", {"model": "ce", "input": texts})
    assert [d["index"] for d in got["data"]] == [0, 1]
    for d, w in zip(got["data"], want, strict=True):
        assert d["probs"] == pytest.approx(w.probs, abs=1e-5) and d["num_classes"] == 1
        assert d["label"] == "LABEL_0"
    assert got["usage"]["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want)
    pooled = _post(http, "/pooling", {"input": texts})
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert [d["data"] for d in pooled["data"]] == [pytest.approx(w.probs, abs=1e-5) for w in want]
    logits = _post(http, "/v1/classify", {"input": texts[0], "activation": False})["data"][0]["probs"]
    assert logits == pytest.approx(llm.classify(texts[0], activation=False)[0].probs, abs=1e-5)

    query, docs = "what is a cat", ["stocks fell today", "a cat is a small animal", "cats purr"]
    scores = [s.score for s in llm.score(query, docs)]
    one_to_many = _post(http, "/score", {"text_1": query, "text_2": docs})
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(scores, abs=1e-5)
    pairs = [llm.tokenizer.encode_pair(query, d) for d in docs]
    assert one_to_many["usage"]["prompt_tokens"] == sum(map(len, pairs))
    pairwise = _post(http, "/v1/score", {"text_1": [query, "stocks"], "text_2": docs[:2]})
    assert pairwise["data"][1]["score"] == pytest.approx(llm.score("stocks", docs[1])[0].score, abs=1e-5)
    reranked = _post(http, "/rerank", {"query": query, "documents": docs, "top_n": 2})
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx(
        [scores[i] for i in order], abs=1e-5
    )


def test_grpc_classify_equals_offline(mesh: tuple[str, str], llm: LLM) -> None:
    """``Router/Classify`` from text, from token ids, and from a text pair (a cross-encoder's score); a
    pair without a text prompt or an empty prompt is INVALID_ARGUMENT."""
    _, address = mesh
    ids = llm.tokenizer.encode("classified over gRPC")

    async def run() -> tuple[list[router_pb2.ClassificationResponse], list[grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            replies = [
                await stub.Classify(
                    router_pb2.ClassificationRequest(text="classified over gRPC"), timeout=30
                ),
                await stub.Classify(
                    router_pb2.ClassificationRequest(
                        token_ids=common_pb2.TokenIds(ids=ids), activation=False
                    ),
                    timeout=30,
                ),
                await stub.Classify(
                    router_pb2.ClassificationRequest(text="what is a cat", text_pair="cats purr"), timeout=30
                ),
            ]
            codes = []
            for bad in (
                router_pb2.ClassificationRequest(token_ids=common_pb2.TokenIds(ids=ids), text_pair="x"),
                router_pb2.ClassificationRequest(text=""),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Classify(bad, timeout=30)
                codes.append(err.value.code())
            return replies, codes

    (by_text, logits, pair), codes = asyncio.run(run())
    assert list(by_text.probs) == pytest.approx(llm.classify([ids])[0].probs, abs=1e-5)
    assert by_text.label == "LABEL_0" and by_text.usage.prompt_tokens == len(ids)
    assert list(logits.probs) == pytest.approx(llm.classify([ids], activation=False)[0].probs, abs=1e-5)
    assert pair.probs[0] == pytest.approx(llm.score("what is a cat", "cats purr")[0].score, abs=1e-5)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT]


def test_a_classifier_embeds_and_refuses_to_generate(mesh: tuple[str, str], llm: LLM) -> None:
    http, _ = mesh
    got = _post(http, "/v1/embeddings", {"input": "hello", "encoding_format": "float"})
    assert got["data"][0]["embedding"] == pytest.approx(llm.embed("hello")[0].embedding, abs=1e-5)
    for path, body, words in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "no LM head"),
        ("/classify", {"input": [[5, 10**6]]}, "vocabulary"),
        ("/classify", {}, "'input'"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(http, path, body)
        assert err.value.code == 400 and words in json.loads(err.value.read())["error"]["message"], body
