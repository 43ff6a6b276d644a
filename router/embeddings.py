"""OpenAI's ``/v1/embeddings`` (vLLM's embedding API): each input's embedding from a worker
(``Orchestrator.embed``: the pooled last hidden states of its prompt, ``engine.pooling``).

Request: ``input`` (a string, an array of strings, an array of token ids, or an array of such arrays; or
vLLM's chat form, ``messages`` with the chat-completions fields that shape the prompt),
``model``, ``encoding_format`` (``float``, the default, or ``base64``: the float32 values' little-endian bytes,
which the ``openai`` client asks for by default), ``dimensions`` (Matryoshka models only), ``user`` (ignored);
and vLLM's ``add_special_tokens`` (default true), ``truncate_prompt_tokens``, ``normalize``, ``priority``,
``cache_salt``, plus ``pooling_type`` (``last``, ``mean``, ``cls``; default the model's). Inputs run
concurrently, one worker call each; the reply lists them in input order with ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from typing import Any

from aiohttp import web

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
) -> list[worker_pb2.EmbedResponse]:
    """Each prompt's embedding, one worker call each, concurrently; the request's pooling fields from ``f``.
    One failure cancels the others and is the request's error."""
    trace_context = extract_context([(k.lower(), v) for k, v in request.headers.items()])
    calls = [
        EmbedCall(
            request_id=f"{i}_{request_id}" if len(prompts) > 1 else request_id,
            prompt_token_ids=ids,
            pooling_type=f.str("pooling_type") or "",
            normalize=f.bool("normalize", True) if f.present("normalize") else None,
            dimensions=dimensions,
            priority=f.int("priority") or 0,
            cache_salt=f.str("cache_salt") or "",
            lora_name=lora_name,
            trace_context=trace_context,
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


async def serve_score(request: web.Request, model: ServedModel, orchestrator: Orchestrator) -> web.Response:
    """vLLM's ``/score`` for an embedding model: the cosine similarity of ``text_1``'s and ``text_2``'s
    embeddings; one ``text_1`` against each ``text_2``, or pairwise when both list as many texts."""
    f = JsonFields(parse_json_body(await request.read()))
    lora_name = model.check_model(f.str("model")) or ""
    first, second = _texts(f, "text_1"), _texts(f, "text_2")
    if len(first) == 1:
        pairs = [(0, j) for j in range(len(second))]
    elif len(first) == len(second):
        pairs = [(i, i) for i in range(len(first))]
    else:
        raise InvalidRequestError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_1",
        )
    prompts = [await _tokenized(f, model, t) for t in (*first, *second)]
    request_id = f"score-{uuid.uuid4().hex}"
    vecs = [
        list(r.embedding) for r in await _embed_all(request, f, orchestrator, lora_name, prompts, request_id)
    ]
    data = [
        {"index": k, "object": "score", "score": _cosine(vecs[a], vecs[len(first) + b])}
        for k, (a, b) in enumerate(pairs)
    ]
    return _list_reply(request_id, model.reply_name(f.str("model")), data, prompts)


async def serve_rerank(request: web.Request, model: ServedModel, orchestrator: Orchestrator) -> web.Response:
    """vLLM's ``/rerank`` (Jina's and Cohere's API) for an embedding model: ``documents`` (strings, or
    objects with a ``text``) by the cosine similarity of their embeddings to ``query``'s, best first, the
    first ``top_n`` (default: all)."""
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
    prompts = [await _tokenized(f, model, t) for t in (query, *texts)]
    request_id = f"rerank-{uuid.uuid4().hex}"
    vecs = [
        list(r.embedding) for r in await _embed_all(request, f, orchestrator, lora_name, prompts, request_id)
    ]
    scores = [_cosine(vecs[0], v) for v in vecs[1:]]
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


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


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
