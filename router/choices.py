"""One OpenAI request's choices: a generation per choice (``n`` per prompt of a batch), and their chunks
merged into one stream as they come. No HTTP here; ``router.http_api`` renders what this yields."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mesh.telemetry import extract_context
from protos.pdmesh.v1 import common_pb2
from router.openai_protocol import ParsedRequest
from router.orchestrator import Chunk, Generation, Orchestrator
from router.served_model import COMPLETIONS_DEFAULT_MAX_TOKENS, ServedModel


@dataclass
class ChoiceRequest:
    """One choice of a request: the generation the workers run, and the text its choice starts with."""

    index: int
    generation: Generation
    echo: str = ""


async def build_choices(
    model: ServedModel, parsed: ParsedRequest, request_id: str, headers: Any
) -> list[ChoiceRequest]:
    """Model check (and the LoRA adapter it selects), chat rendering, tokenization (off the event loop), length and sampling checks, then
    one generation per choice: ``n`` per prompt, choice ``i * n + j`` for sample ``j`` of prompt ``i``
    (as vLLM numbers them). With several choices each runs as a request of its own on the workers, id
    ``{index}_{request_id}``, and a seeded request's sample ``j`` takes seed + j (vLLM's parallel
    sampling rules), so every choice is reproducible and the samples differ."""
    lora_name = model.check_model(parsed.model) or ""  # the model field may name a LoRA adapter
    carrier = [(k.lower(), v) for k, v in headers.items()]
    trace_context = extract_context(carrier)
    prompts: list[tuple[list[int], str | list[int]]] = []  # token ids, and the prompt as given
    if parsed.kind == "chat_completions":
        ids = await model.tokenize_chat(
            parsed.messages,
            parsed.add_generation_prompt,
            parsed.add_special_tokens,
            parsed.template_kwargs,
            parsed.continue_final_message,
        )
        prompts.append((ids, ""))
    else:
        for prompt in parsed.prompts:
            ids = (
                await model.tokenize(prompt, parsed.add_special_tokens) if isinstance(prompt, str) else prompt
            )
            prompts.append((ids, prompt))
    param = "messages" if parsed.kind == "chat_completions" else "prompt"
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if parsed.kind == "completions" else None
    total = len(prompts) * parsed.n
    choices = []
    for i, (whole, given) in enumerate(prompts):
        ids = model.truncate_prompt(whole, parsed.truncate_prompt_tokens)
        model.check_prompt(ids, param=param)  # before echo decodes token ids: they are in the vocabulary
        echo = ""
        if parsed.echo and parsed.kind == "chat_completions":  # the last message, when it is the assistant's
            last = parsed.messages[-1] if parsed.messages else {}
            if last.get("role") == "assistant" and isinstance(last.get("content"), str):
                echo = last["content"]
        elif parsed.echo:  # the prompt as given, or the text of what is left of it
            echo = (
                given
                if isinstance(given, str) and len(ids) == len(whole)
                else model.tokenizer.decode(ids, skip_special_tokens=False)
            )
        max_tokens = model.resolve_max_tokens(parsed.sampling.max_tokens, len(ids), default)
        sampling = model.sampling_params(parsed.sampling, max_tokens)
        for j in range(parsed.n):
            index = i * parsed.n + j
            params = sampling
            if j and sampling.HasField("seed"):
                params = common_pb2.SamplingParams()
                params.CopyFrom(sampling)
                params.seed = (sampling.seed + j) % 2**64
            gen = Generation(
                request_id=request_id if total == 1 else f"{index}_{request_id}",
                prompt_token_ids=ids,
                sampling_params=params,
                endpoint=parsed.kind,
                session_id=parsed.session_id,
                cache_salt=parsed.cache_salt,
                lora_name=lora_name,
                trace_context=trace_context,
            )
            choices.append(ChoiceRequest(index, gen, echo))
    return choices


async def merged_chunks(
    orchestrator: Orchestrator, choices: list[ChoiceRequest]
) -> AsyncIterator[tuple[int, Chunk]]:
    """Every choice's chunks as they come, tagged with its index. The choices run concurrently; the first
    to fail raises here, and leaving (a failure, the caller closing this, a client gone) closes every
    choice's generation, which cancels it on the workers."""
    if len(choices) == 1:  # the common case: no tasks in between
        async with contextlib.aclosing(orchestrator.generate(choices[0].generation)) as chunks:
            async for chunk in chunks:
                yield choices[0].index, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | None | BaseException]] = asyncio.Queue()

    async def run(choice: ChoiceRequest) -> None:
        try:
            async with contextlib.aclosing(orchestrator.generate(choice.generation)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((choice.index, chunk))
            queue.put_nowait((choice.index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which raises it
            queue.put_nowait((choice.index, exc))

    tasks = [asyncio.create_task(run(c), name=c.generation.request_id) for c in choices]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
