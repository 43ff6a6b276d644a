"""A request's chunks as OpenAI JSON: each choice's text, logprobs, reasoning and tool calls as they come
(``ChoiceReply``), rendered as stream events or as one reply (``ReplyWriter``). Used by the HTTP API
(``router.http_api``) for completions and chat, and under the Responses API's own events; nothing here does
I/O.
"""

from __future__ import annotations

import time
from typing import Any

from protos.pdmesh.v1 import common_pb2
from router.choices import ChoiceRequest
from router.openai_protocol import (
    FINISH_REASONS,
    CompletionLogprobs,
    ParsedRequest,
    chat_logprobs,
    usage_json,
    vllm_prompt_logprobs,
)
from router.orchestrator import Chunk
from router.reasoning import ReasoningStream
from router.served_model import ServedModel
from router.tool_calls import ToolCallStream


class ChoiceReply:
    """One choice's text, logprobs and finish, as its chunks come."""

    def __init__(self, model: ServedModel, parsed: ParsedRequest, request: ChoiceRequest) -> None:
        sp = parsed.sampling
        self.index = request.index
        self.echo = request.echo  # the text before the generated text
        self.prompt_token_ids = request.generation.prompt_token_ids
        self.prompt_logprobs: list[Any] | None = None  # vLLM's prompt_logprobs field, once they came
        self.started = False  # a chunk came (the first carries the echo and the prompt's logprobs)
        self.text = model.text_stream(
            sp.stop, sp.skip_special_tokens, sp.include_stop_str_in_output, sp.stop_token_ids, sp.ignore_eos
        )
        self.last_token_id: int | None = None  # for the stop reason of a stop token
        self.num_tokens = 0  # generated so far (continuous_usage_stats)
        self.completion_logprobs = CompletionLogprobs(model.tokenizer, parsed.tokens_as_ids)
        self.logprob_parts: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.usage: common_pb2.Usage | None = None
        self.stop_token_ids = set(sp.stop_token_ids)
        # Chat with a reasoning parser: the text read as reasoning and content (router.reasoning).
        self.reasoning = (
            ReasoningStream(model.reasoning_parser)
            if parsed.kind == "chat_completions" and model.reasoning_parser != "none"
            else None
        )
        self.content = ""  # with a reasoning parser: the content part of the text
        # Chat with tools: the content read as content and tool calls (router.tool_calls).
        tools = parsed.tools
        self.tools = (
            ToolCallStream(tools, whole=not parsed.stream)
            if tools is not None and tools.parses_output
            else None
        )

    def stop_reason_now(self) -> str | int | None:
        if self.finish_reason != "stop":
            return None
        if self.text.stopped_on is not None:
            return self.text.stopped_on
        if self.last_token_id in self.stop_token_ids:
            return self.last_token_id
        return None


class ReplyWriter:
    """Turns a request's chunks into OpenAI JSON: stream events as they come, or one reply at the end.
    Each chunk belongs to one choice (its index); a streamed event carries that choice alone."""

    def __init__(
        self,
        model: ServedModel,
        parsed: ParsedRequest,
        request_id: str,
        kind: str,
        requests: list[ChoiceRequest],
    ) -> None:
        self.model = model
        self.parsed = parsed
        self.request_id = request_id
        self.kind = kind
        self.created = int(time.time())
        self.want_logprobs = parsed.sampling.logprobs is not None
        self.n = parsed.n
        self.choices = {r.index: ChoiceReply(model, parsed, r) for r in requests}
        self.model_name = model.reply_name(parsed.model)  # named once: adapters may come and go meanwhile

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "completions" else "chat.completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object_name + (".chunk" if chunk else ""),
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }

    def add(self, index: int, chunk: Chunk) -> list[dict[str, Any]]:
        """Take one chunk of choice ``index``; return the stream events it makes (ignored when not
        streaming)."""
        c = self.choices[index]
        if chunk.token_ids:
            c.last_token_id = chunk.token_ids[-1]
            c.num_tokens += len(chunk.token_ids)
        delta = c.text.add(chunk.token_ids, stopped=chunk.finish_reason == common_pb2.FINISH_REASON_STOP)
        logprobs: Any = None
        echoed: dict[str, Any] | None = None
        if not c.started:  # the echo and the prompt's logprobs, when asked for
            c.started = True
            if self.kind == "completions":  # (a chat's echo is an event of its own: ``opening``)
                delta = c.echo + delta
            if self.parsed.prompt_logprobs is not None:
                c.prompt_logprobs = vllm_prompt_logprobs(
                    self.model.tokenizer, chunk.prompt_logprobs, self.parsed.prompt_logprobs
                )
            if self.want_logprobs and self.parsed.echo and self.kind == "completions":
                top_n = self.parsed.sampling.logprobs or 0
                echoed = c.completion_logprobs.prompt_part(c.prompt_token_ids, chunk.prompt_logprobs, top_n)
                c.logprob_parts.append(echoed)
        if self.want_logprobs and chunk.logprobs:
            logprobs = (
                c.completion_logprobs.part(chunk.logprobs)
                if self.kind == "completions"
                else chat_logprobs(self.model.tokenizer, chunk.logprobs, self.parsed.tokens_as_ids)
            )
            c.logprob_parts.append(logprobs)
        if echoed is not None:  # one event: the echoed prompt's logprobs, then its first token's
            logprobs = CompletionLogprobs.merge([echoed, logprobs] if logprobs is not None else [echoed])
        if chunk.finished:
            delta += c.text.finish()
            c.finish_reason = FINISH_REASONS.get(chunk.finish_reason, "stop")
            c.stop_reason = c.stop_reason_now()
            c.usage = chunk.usage
        reasoning = ""
        if c.reasoning is not None:
            reasoning, delta = c.reasoning.add(delta)
            if chunk.finished:
                more_reasoning, rest = c.reasoning.finish()
                reasoning, delta = reasoning + more_reasoning, delta + rest
            c.content += delta
            if not self.parsed.include_reasoning:
                reasoning = ""
        calls: list[dict[str, Any]] = []
        if c.tools is not None:
            delta, calls = c.tools.add(delta)
            if chunk.finished:
                rest, more = c.tools.finish()
                delta, calls = delta + rest, calls + more
                if c.tools.calls and c.finish_reason == "stop" and c.tools.request.choice != "function":
                    c.finish_reason = "tool_calls"  # OpenAI's; a named function's call ends on "stop"
        if not delta and logprobs is None and not chunk.finished and not calls and not reasoning:
            return []
        choice = self._choice(c, delta, logprobs, stream=True, calls=calls)
        if reasoning:
            body = {"reasoning_content": reasoning, **choice["delta"]}
            if not body.get("content"):
                body.pop("content", None)
            choice["delta"] = body
        return [self._chunk(c, choice)]

    def _chunk(self, c: ChoiceReply, choice: dict[str, Any], generated: int | None = None) -> dict[str, Any]:
        """One choice's stream event; with continuous_usage_stats, that choice's usage so far (vLLM's)."""
        event = self._envelope([choice], chunk=True)
        if self.parsed.continuous_usage:
            prompt = len(c.prompt_token_ids)
            done = c.num_tokens if generated is None else generated
            event["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        return event

    def _choice(
        self,
        c: ChoiceReply,
        text: str,
        logprobs: Any,
        stream: bool,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        finish = c.finish_reason
        if self.kind == "completions":
            choice: dict[str, Any] = {"index": c.index, "text": text, "logprobs": logprobs}
            if self.parsed.prompt_logprobs is not None and not stream:
                choice["prompt_logprobs"] = c.prompt_logprobs
        else:
            key = "delta" if stream else "message"
            body: dict[str, Any] = {"content": text} if stream else {"role": "assistant", "content": text}
            if c.tools is not None:
                if stream:
                    if calls:
                        body = {"content": text, "tool_calls": calls} if text else {"tool_calls": calls}
                else:
                    body["content"] = c.tools.content or None if c.tools.calls else c.tools.content
                    body["tool_calls"] = c.tools.calls
            choice = {
                "index": c.index,
                key: body,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
            }
        choice["finish_reason"] = finish
        choice["stop_reason"] = c.stop_reason if finish is not None else None
        return choice

    def opening(self) -> list[dict[str, Any]]:
        """Events sent before the first tokens' (chat: the assistant role for every choice, then with echo
        the last message's text, as vLLM streams it)."""
        if self.kind == "completions":
            return []
        events = []
        for index in sorted(self.choices):
            c = self.choices[index]
            opened = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            events.append(self._chunk(c, opened, generated=0))  # the role event comes before any token
            if c.echo:
                echoed = {
                    "index": index,
                    "delta": {"content": c.echo},
                    "logprobs": None,
                    "finish_reason": None,
                }
                events.append(self._chunk(c, echoed, generated=0))
        return events

    def usage(self) -> dict[str, Any] | None:
        """The request's usage: each prompt's tokens once (however many choices it has), every choice's
        completion tokens, and of each prompt the tokens every one of its choices found cached."""
        done = [c for c in self.choices.values() if c.usage is not None]
        if not done:
            return None
        total = common_pb2.Usage()
        by_prompt: dict[int, list[common_pb2.Usage]] = {}
        for c in done:
            by_prompt.setdefault(c.index // self.n, []).append(c.usage)
            total.completion_tokens += c.usage.completion_tokens
        for usages in by_prompt.values():
            total.prompt_tokens += usages[0].prompt_tokens
            total.cached_prompt_tokens += min(u.cached_prompt_tokens for u in usages)
        return usage_json(total)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    def full_response(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            logprobs: Any = None
            if self.want_logprobs:
                if self.kind == "completions":
                    logprobs = CompletionLogprobs.merge(c.logprob_parts)
                else:
                    logprobs = [entry for part in c.logprob_parts for entry in part]
            if self.kind == "completions":
                text = c.echo + c.text.text
            else:
                text = c.content if c.reasoning is not None else c.text.text
            choice = self._choice(c, text, logprobs, stream=False)
            if self.kind != "completions" and c.echo:  # vLLM's chat echo: the last message, then the reply
                choice["message"]["content"] = c.echo + (choice["message"]["content"] or "")
            if c.reasoning is not None and self.parsed.include_reasoning:
                choice["message"]["reasoning_content"] = c.reasoning.reasoning or None
            choices.append(choice)
        out = {**self._envelope(choices, chunk=False), "usage": self.usage()}
        if self.kind != "completions" and self.parsed.prompt_logprobs is not None:
            first = self.choices[
                min(self.choices)
            ]  # a chat has one prompt: its logprobs go beside the choices
            out["prompt_logprobs"] = first.prompt_logprobs
        return out
