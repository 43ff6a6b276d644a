"""OpenAI's ``/v1/embeddings`` (vLLM's embedding API): each input's embedding from a worker
(``Orchestrator.embed``: the pooled last hidden states of its prompt, ``engine.pooling``).

Request: ``input`` (a string, an array of strings, an array of token ids, or an array of such arrays),
``model``, ``encoding_format`` (``float``, the default, or ``base64``: the float32 values' little-endian bytes,
which the ``openai`` client asks for by default), ``dimensions`` (Matryoshka models only), ``user`` (ignored);
and vLLM's ``add_special_tokens`` (default true), ``truncate_prompt_tokens``, ``normalize``, ``priority``,
``cache_salt``, plus ``pooling_type`` (``last``, ``mean``, ``cls``; default the model's). Inputs run
concurrently, one worker call each; the reply lists them in input order with ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from aiohttp import web

from mesh.telemetry import extract_context
from router.errors import InvalidRequestError
from router.openai_protocol import JsonFields, parse_json_body
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
        replies = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    n_tokens = sum(len(ids) for ids in prompts)
    return web.json_response(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model.reply_name(f.str("model")),
            "data": [
                {"object": "embedding", "index": i, "embedding": _encode(list(r.embedding), encoding)}
                for i, r in enumerate(replies)
            ],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


async def _prompts(f: JsonFields, model: ServedModel) -> list[list[int]]:
    """``input`` as token ids, one list per input, each checked (and truncated when asked)."""
    value = f.body.get("input")
    if value is None:
        raise InvalidRequestError("'input' is required", param="input")
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
