"""OpenAI's ``/v1/embeddings`` (vLLM's embedding API): each input's embedding from a worker
(``Orchestrator.embed``: the pooled last hidden states of its prompt, ``engine.pooling``).

Request: ``input`` (a string, an array of strings, an array of token ids, or an array of such arrays; or
vLLM's chat form, ``messages`` with the chat-completions fields that shape the prompt),
``model``, ``encoding_format`` (``float``, the default, or ``base64``: the float32 values' little-endian bytes,
which the ``openai`` client asks for by default), ``dimensions`` (Matryoshka models only), ``user`` (ignored);
and vLLM's ``add_special_tokens`` (default true), ``truncate_prompt_tokens``, ``normalize``, ``priority``,
``cache_salt``, plus ``pooling_type`` (``last``, ``mean``, ``cls``; default the model's). Inputs run
concurrently, one worker call each; the reply lists them in input order with ``usage.prompt_tokens``.

A sequence classifier (a ``*ForSequenceClassification`` checkpoint) also serves vLLM's ``/classify``: each
input's class probabilities, its most probable label and ``num_classes`` (``activation`` false: the raw
logits); ``/pooling`` answers either task's vector as it is. A classifier of a single label is a
cross-encoder: ``/score`` and ``/rerank`` then read each (query, document) pair as one prompt (the
tokenizer's pair template) and answer the classifier's sigmoid, as vLLM does; for an embedding model they
answer the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from aiohttp import web

from engine.errors import InvalidRequestError as EngineInvalidRequest
from engine.pooling import cosine, score_pairs, top_label
from mesh.telemetry import extract_context
from protos.pdmesh.v1 import worker_pb2
from router.errors import InvalidRequestError
from router.openai_protocol import JsonFields, parse_chat, parse_json_body
from router.orchestrator import EmbedCall, Orchestrator
from router.served_model import ServedModel

ENCODINGS = ("float", "base64")


async def serve_embeddings(
    request: web.Request, model: ServedModel, orchestrator: Orchestrator
) -> web.Response:
    """The reply to one ``/v1/embeddings`` request (errors raise ``RouterError``s)."""
    body = parse_json_body(await request.read())
    f = JsonFields(body)
    lora_name = model.check_model(f.str("model")) or ""
    encoding = f.str("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise InvalidRequestError(
            f"encoding_format must be 'float' or 'base64', got {encoding!r}", param="encoding_format"
        )
    dimensions = f.int("dimensions")
    if dimensions is not None and dimensions < 1:
        raise InvalidRequestError(f"dimensions must be at least 1, got {dimensions}", param="dimensions")
    prompts = await _prompts(f, model)
    request_id = f"embd-{uuid.uuid4().hex}"
    replies = await _embed_all(request, f, orchestrator, lora_name, prompts, request_id, dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(list(r.embedding), encoding)}
        for i, r in enumerate(replies)
    ]
    return _list_reply(request_id, model.reply_name(f.str("model")), data, prompts)


async def _embed_all(
    request: web.Request,
    f: JsonFields,
    orchestrator: Orchestrator,
    lora_name: str,
    prompts: list[list[int]],
    request_id: str,
    dimensions: int | None = None,
    task: str = "embed",
) -> list[worker_pb2.EmbedResponse]:
    """Each prompt's embedding (or, ``task`` "classify", class probabilities), one worker call each,
    concurrently; the request's pooling fields from ``f``. One failure cancels the others and is the
    request's error."""
    classify = task == "classify"
    trace_context = extract_context([(k.lower(), v) for k, v in request.headers.items()])
    calls = [
        EmbedCall(
            request_id=f"{i}_{request_id}" if len(prompts) > 1 else request_id,
            prompt_token_ids=ids,
            pooling_type=f.str("pooling_type") or "",
            normalize=None if classify or not f.present("normalize") else f.bool("normalize", True),
            dimensions=dimensions,
            priority=f.int("priority") or 0,
            cache_salt=f.str("cache_salt") or "",
            lora_name=lora_name,
            trace_context=trace_context,
            task=task,
            activation=_activation(f) if classify else None,
        )
        for i, ids in enumerate(prompts)
    ]
    tasks = [asyncio.ensure_future(orchestrator.embed(c)) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def serve_classify(
    request: web.Request, model: ServedModel, orchestrator: Orchestrator
) -> web.Response:
    """vLLM's ``/classify``: each input's class probabilities by a sequence classifier, in input order."""
    f = JsonFields(parse_json_body(await request.read()))
    lora_name = model.check_model(f.str("model")) or ""
    need_classifier(model, "/classify")
    prompts = await _prompts(f, model)
    request_id = f"classify-{uuid.uuid4().hex}"
    replies = await _embed_all(request, f, orchestrator, lora_name, prompts, request_id, task="classify")
    labels = model.config.labels
    data = []
    for i, r in enumerate(replies):
        probs = list(r.embedding)
        data.append(
            {"index": i, "label": top_label(labels, probs), "probs": probs, "num_classes": len(probs)}
        )
    return _list_reply(request_id, model.reply_name(f.str("model")), data, prompts)


async def serve_pooling(request: web.Request, model: ServedModel, orchestrator: Orchestrator) -> web.Response:
    """vLLM's ``/pooling``: each input's pooled output as the model's task gives it, a classifier's class
    probabilities (``activation`` false: its logits), else the embedding (``normalize``, ``dimensions``,
    ``pooling_type`` as for ``/v1/embeddings``)."""
    f = JsonFields(parse_json_body(await request.read()))
    lora_name = model.check_model(f.str("model")) or ""
    dimensions = f.int("dimensions")
    prompts = await _prompts(f, model)
    request_id = f"pool-{uuid.uuid4().hex}"
    task = "classify" if model.config.num_labels else "embed"
    replies = await _embed_all(request, f, orchestrator, lora_name, prompts, request_id, dimensions, task)
    data = [{"index": i, "object": "pooling", "data": list(r.embedding)} for i, r in enumerate(replies)]
    return _list_reply(request_id, model.reply_name(f.str("model")), data, prompts)


async def serve_score(request: web.Request, model: ServedModel, orchestrator: Orchestrator) -> web.Response:
    """vLLM's ``/score``: the relevance of each ``text_2`` to ``text_1`` (one ``text_1`` against each
    ``text_2``, or pairwise when both list as many texts): a cross-encoder's, else the cosine similarity of
    the two embeddings."""
    f = JsonFields(parse_json_body(await request.read()))
    lora_name = model.check_model(f.str("model")) or ""
    try:
        firsts, seconds = score_pairs(_texts(f, "text_1"), _texts(f, "text_2"))
    except EngineInvalidRequest as exc:
        raise InvalidRequestError(str(exc), param="text_1") from None
    request_id = f"score-{uuid.uuid4().hex}"
    scores, prompts = await _relevance(
        request, f, model, orchestrator, lora_name, firsts, seconds, request_id
    )
    data = [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)]
    return _list_reply(request_id, model.reply_name(f.str("model")), data, prompts)


async def serve_rerank(request: web.Request, model: ServedModel, orchestrator: Orchestrator) -> web.Response:
    """vLLM's ``/rerank`` (Jina's and Cohere's API): ``documents`` (strings, or objects with a ``text``) by
    their relevance to ``query`` (a cross-encoder's, else the cosine similarity of the embeddings), best
    first, the first ``top_n`` (default: all)."""
    f = JsonFields(parse_json_body(await request.read()))
    lora_name = model.check_model(f.str("model")) or ""
    query = f.str("query")
    if not query:
        raise InvalidRequestError("'query' is required, a non-empty string", param="query")
    documents = f.body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequestError("'documents' must be a non-empty array", param="documents")
    texts = []
    for d in documents:
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(
                "each document must be a non-empty string or an object with a 'text' string",
                param="documents",
            )
        texts.append(text)
    top_n = f.int("top_n") or len(texts)
    if top_n < 0:
        raise InvalidRequestError(f"top_n must be >= 0, got {top_n}", param="top_n")
    request_id = f"rerank-{uuid.uuid4().hex}"
    scores, prompts = await _relevance(
        request, f, model, orchestrator, lora_name, [query] * len(texts), texts, request_id
    )
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:top_n]
    n_tokens = sum(map(len, prompts))
    return web.json_response(
        {
            "id": request_id,
            "model": model.reply_name(f.str("model")),
            "usage": {"total_tokens": n_tokens},
            "results": [
                {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]} for i in order
            ],
        }
    )


async def _relevance(
    request: web.Request,
    f: JsonFields,
    model: ServedModel,
    orchestrator: Orchestrator,
    lora_name: str,
    firsts: list[str],
    seconds: list[str],
    request_id: str,
) -> tuple[list[float], list[list[int]]]:
    """Each (first, second) pair's relevance, and the prompts computed for them: a cross-encoder's sigmoid
    of each pair as one prompt, else the cosine of the two texts' embeddings (each distinct text once)."""
    if model.config.num_labels == 1:
        keep = f.int("truncate_prompt_tokens")
        prompts = []
        for a, b in zip(firsts, seconds, strict=True):
            ids = model.truncate_prompt(await model.tokenize_pair(a, b), keep)
            check_input(model, ids)
            prompts.append(ids)
        replies = await _embed_all(request, f, orchestrator, lora_name, prompts, request_id, task="classify")
        return [r.embedding[0] for r in replies], prompts
    if model.config.num_labels:
        raise InvalidRequestError(
            f"this model is a classifier of {model.config.num_labels} labels: score and rerank need a "
            "cross-encoder (a classifier of one label) or an embedding model"
        )
    unique = list(dict.fromkeys([*firsts, *seconds]))
    prompts = [await _tokenized(f, model, t) for t in unique]
    replies = await _embed_all(request, f, orchestrator, lora_name, prompts, request_id)
    vectors = {text: list(r.embedding) for text, r in zip(unique, replies, strict=True)}
    return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds, strict=True)], prompts


def need_classifier(model: ServedModel, endpoint: str) -> None:
    """A 400 / INVALID_ARGUMENT before any worker call when the model has no classification head."""
    if not model.config.num_labels:
        raise InvalidRequestError(
            f"{endpoint} needs a sequence classifier (a *ForSequenceClassification checkpoint); this model "
            "has no classification head"
        )


def _activation(f: JsonFields) -> bool | None:
    """vLLM's ``activation`` (``use_activation`` in newer releases): None leaves it on."""
    for name in ("activation", "use_activation"):
        if f.present(name):
            return f.bool(name, True)
    return None


def _list_reply(
    request_id: str, model_name: str, data: list[dict[str, Any]], prompts: list[list[int]]
) -> web.Response:
    """OpenAI's list reply (embeddings, vLLM's scores), with the prompts' tokens as usage."""
    n_tokens = sum(map(len, prompts))
    return web.json_response(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model_name,
            "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


def _texts(f: JsonFields, name: str) -> list[str]:
    texts = f.str_list(name)
    if not texts or not all(texts):
        raise InvalidRequestError(f"'{name}' must be a non-empty string or an array of them", param=name)
    return texts


async def _tokenized(f: JsonFields, model: ServedModel, text: str) -> list[int]:
    ids = model.truncate_prompt(
        await model.tokenize(text, f.bool("add_special_tokens", True)), f.int("truncate_prompt_tokens")
    )
    check_input(model, ids)
    return ids


async def _prompts(f: JsonFields, model: ServedModel) -> list[list[int]]:
    """``input`` as token ids, one list per input, each checked (and truncated when asked); or vLLM's chat
    form, ``messages`` rendered with the chat template (no generation prompt unless asked), one input."""
    value = f.body.get("input")
    if value is None and "messages" in f.body:
        chat = parse_chat({**f.body, "add_generation_prompt": f.bool("add_generation_prompt", False)})
        ids = await model.tokenize_chat(
            chat.messages,
            chat.add_generation_prompt,
            chat.add_special_tokens,
            chat.template_kwargs,
            chat.continue_final_message,
        )
        ids = model.truncate_prompt(ids, f.int("truncate_prompt_tokens"))
        check_input(model, ids)
        return [ids]
    if value is None:
        raise InvalidRequestError("'input' (or 'messages') is required", param="input")
    if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            "'input' must be a string, an array of strings, an array of token ids or an array of such arrays",
            param="input",
        )
    texts = all(isinstance(item, str) for item in value)
    if not texts and not all(isinstance(item, list) and all(_is_int(t) for t in item) for item in value):
        raise InvalidRequestError(
            "'input' must be a string, an array of strings, an array of token ids or an array of such arrays "
            "(not a mix)",
            param="input",
        )
    add_special = f.bool("add_special_tokens", True)
    keep = f.int("truncate_prompt_tokens")
    prompts = []
    for item in value:
        if texts and not item:
            raise InvalidRequestError("an input is an empty string", param="input")
        ids = await model.tokenize(item, add_special) if texts else list(item)
        ids = model.truncate_prompt(ids, keep)
        check_input(model, ids)
        prompts.append(ids)
    return prompts


def check_input(model: ServedModel, ids: list[int]) -> None:
    """An embedding's prompt: at least one token, every id in the vocabulary, at most ``max_model_len``
    tokens (it generates nothing), else a 400 / INVALID_ARGUMENT."""
    if not ids:
        raise InvalidRequestError("an input is empty: it must have at least one token", param="input")
    model.check_token_ids(ids, "input token ids", "input")
    if len(ids) > model.max_model_len:
        raise InvalidRequestError(
            f"an input has {len(ids)} tokens, more than max_model_len ({model.max_model_len})", param="input"
        )


def _encode(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
