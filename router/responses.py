"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat pipeline, as vLLM serves it.

A request is turned into a chat request (``chat_body``): ``instructions`` becomes the first (system)
message, ``input`` (a string, or a list of message, ``function_call`` and ``function_call_output``
items) the messages, ``max_output_tokens`` ``max_tokens``, flat function ``tools`` chat's nested ones,
``text.format`` chat's ``response_format``. The chat pipeline then runs unchanged: the same
tokenization, constraints, tool-call and reasoning parsers, workers and text. ``ResponseStream`` turns
the chat stream's events into the Responses API's output items and streaming events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.reasoning_text.delta``, ... ``response.completed``); a whole response is the same machine's
final state, so streamed and whole responses always agree.

With ``previous_response_id`` the stored conversation (``router.response_store``: the messages before the
previous response, then its output) comes before the input (``continue_from``); what a finished response
leaves to store is ``record``. ``conversation`` objects are 400s. A ``background`` request (it must be
stored) is run by ``router.background_responses``; here it is only parsed. Nothing here does I/O.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.errors import InvalidRequestError
from router.response_store import StoredResponse

# Responses fields that are chat fields of the same name and meaning (the vLLM extras among them too).
_SAME_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "user",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "min_tokens",
    "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "request_id", "cache_salt",
    "session_id", "chat_template_kwargs", "include_reasoning", "structured_outputs", "priority",
    "bad_words",
)  # fmt: skip
# Accepted and only echoed back: they change nothing here (no storage, no service tiers, no truncation).
_ECHOED = ("metadata", "truncation", "reasoning", "service_tier", "prompt_cache_key", "safety_identifier")
_NOT_STORED = "conversation objects are not kept here: use previous_response_id, or send the whole conversation as 'input'"


@dataclass
class ResponsesRequest:
    chat_body: dict[str, Any]  # the same request as a chat completions body
    echo: dict[str, Any]  # the request's fields as a Response object repeats them
    previous_id: str | None = None  # previous_response_id: the conversation it ended goes first
    given: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as chat messages
    system: list[dict[str, Any]] = field(default_factory=list)  # its instructions, as a system message
    history: list[dict[str, Any]] = field(default_factory=list)  # the stored conversation before ``given``
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the input as items, with ids
    background: bool = False  # run on in the router, the client polls (router.background_responses)

    def continue_from(self, previous: StoredResponse) -> None:
        """Put the stored conversation and the previous response's output before this input (the previous
        instructions are not inherited: OpenAI's rule)."""
        output = [item for item in previous.response.get("output", []) if item.get("type") != "reasoning"]
        self.history = previous.messages + (_input_messages(output) if output else [])
        self.chat_body["messages"] = self.system + self.history + self.given

    def record(self, response: dict[str, Any]) -> StoredResponse:
        """What storing ``response`` keeps: it, and the conversation it answered (no instructions)."""
        return StoredResponse(
            response=response, messages=self.history + self.given, input_items=self.input_items
        )


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    """The Responses request as a chat request; 400s name the Responses field. With
    ``previous_response_id`` the chat's messages are completed by ``continue_from`` (the stored
    conversation first)."""
    if body.get("conversation") is not None:
        raise InvalidRequestError(f"'conversation' is not supported: {_NOT_STORED}", param="conversation")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequestError("'previous_response_id' must be a string", param="previous_response_id")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise InvalidRequestError("'store' must be a boolean", param="store")
    background = body.get("background", False)
    if background is None:
        background = False
    if not isinstance(background, bool):
        raise InvalidRequestError("'background' must be a boolean", param="background")
    if background and not store:  # its result is only ever read from the store (OpenAI's and vLLM's rule)
        raise InvalidRequestError("background can only be used when 'store' is true", param="background")
    chat: dict[str, Any] = {k: body[k] for k in _SAME_FIELDS if k in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("'instructions' must be a string", param="instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    given = _input_messages(body.get("input"))
    chat["messages"] = system + given
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object with 'format'", param="text")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    include = body.get("include") or []
    if not isinstance(include, list):
        raise InvalidRequestError("'include' must be an array of strings", param="include")
    top = body.get("top_logprobs")
    if "message.output_text.logprobs" in include or top is not None:  # OpenAI's (and vLLM's) switches
        chat["logprobs"] = True
        chat["top_logprobs"] = top or 0
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools or [],
        "text": {"format": fmt or {"type": "text"}},
        "previous_response_id": previous,
        "store": store,
        "background": background,
        "user": body.get("user"),
        "top_logprobs": body.get("top_logprobs"),
        **{k: body.get(k) for k in _ECHOED},
    }
    echo["metadata"] = echo["metadata"] or {}
    echo["truncation"] = echo["truncation"] or "disabled"
    items = _input_items(body.get("input"))
    return ResponsesRequest(chat, echo, previous, given, system, input_items=items, background=background)


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` as the input items ``GET /v1/responses/{id}/input_items`` lists: a string is one user
    message; every item gets an ``id`` if it has none. (Called after ``_input_messages`` checked it.)"""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        items.append({"type": kind, **item, "id": item.get("id") or _id(_ITEM_ID_PREFIX.get(kind, "item"))})
    return items


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls become one assistant message's tool calls,
    each function_call_output a tool message; earlier reasoning items are dropped (vLLM's rule)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a string or a non-empty array of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"), "content": _message_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if not (isinstance(call["id"], str) and isinstance(item.get("name"), str)):
                raise InvalidRequestError(
                    f"{where}: a function_call needs 'call_id' and 'name'", param="input"
                )
            last = out[-1] if out else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise InvalidRequestError(
                    f"{where}: a function_call_output needs 'call_id' and 'output' (a string)", param="input"
                )
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param="input",
            )
    return out


def _message_text(content: Any, where: str) -> Any:
    """A message item's content as chat content: a string, or its text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or an array of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") in ("input_text", "output_text", "text")
            and isinstance(part.get("text"), str)
        ):
            raise InvalidRequestError(
                f"{where}.content[{j}]: only text parts (input_text, output_text) are supported",
                param="input",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be an array of tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError(
        "text.format.type must be text, json_object or json_schema", param="text.format"
    )


def _copy(part: dict[str, Any]) -> dict[str, Any]:
    """A content part as an event shows it then (its lists grow later)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in part.items()}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseStream:
    """One response's output items, built from the chat stream's events (``add``) and closed by
    ``finish``; each call returns the Responses streaming events it makes."""

    response_id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # a failed response's {"code", "message"}
    _sequence: int = 0
    _open: dict[str, Any] | None = None  # the item being written (the last of ``output``)
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # chat tool-call index -> item
    _logprobs: list[dict[str, Any]] = field(default_factory=list)  # come, not yet given to message text

    def response(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "model": self.model,
            "output": self.output,
            "usage": self.usage,
            **self.echo,
        }

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` (with the status so far: ``queued`` for a background response) and
        ``response.in_progress``."""
        created = self._event("response.created", response={**self.response(), "output": []})
        self.status = "in_progress"
        return [created, self._event("response.in_progress", response={**self.response(), "output": []})]

    def add(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat.completion.chunk event (its one choice's delta and finish reason)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # A chunk's token logprobs go with the message text that follows them (its tokens' text may
            # come later, held back by the chat stream); those of reasoning or tool-call text are dropped.
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content") or delta.get("tool_calls"):
                logprobs, self._logprobs = [], []
            self._logprobs += logprobs
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"], self._logprobs)
                self._logprobs = []
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") == "length":
                self.incomplete_details = {"reason": "max_output_tokens"}
        return events

    def finish(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The last item closed and the response done: ``response.completed`` (or ``.incomplete`` when
        ``max_output_tokens`` cut it)."""
        events = self._close()
        if usage is not None:
            self.usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        self.status = "incomplete" if self.incomplete_details else "completed"
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """The response failed after it began (a background response: its record keeps the error):
        ``response.failed``."""
        self.status = "failed"
        self.error = {"code": code, "message": message}
        return [self._event("response.failed", response=self.response())]

    # ---- items ---------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _index(self) -> int:
        return len(self.output) - 1

    def _opened(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self._open = item
        shown = {**item, "content": [_copy(p) for p in item["content"]]} if "content" in item else dict(item)
        return events + [self._event("response.output_item.added", output_index=self._index(), item=shown)]

    def _text(
        self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Text of a message (output_text) or of a reasoning item (reasoning_text), opening one if the
        item being written is not of that kind."""
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}  # fmt: skip
                events += self._opened(item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item["content"].append(part)
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=self._index(), content_index=0, part=_copy(part)))  # fmt: skip
            else:
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
                events += self._opened(item)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": list(logprobs or [])} if kind == "message" else {}
        if kind == "message":
            item["content"][0]["logprobs"] += extra["logprobs"]
        events.append(self._event(kind_event, item_id=item["id"], output_index=self._index(), content_index=0,
                                  delta=text, **extra))  # fmt: skip
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: one with an id opens a function_call item; the rest extend its
        arguments (a named function's call streams them token by token)."""
        events: list[dict[str, Any]] = []
        item = self._calls.get(call.get("index", 0))
        fn = call.get("function") or {}
        if call.get("id") is not None or item is None:
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                    "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}  # fmt: skip
            self._calls[call.get("index", 0)] = item
            events += self._opened(item)
        arguments = fn.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=arguments))  # fmt: skip
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=part["logprobs"]))  # fmt: skip
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_copy(part)))  # fmt: skip
        elif item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))  # fmt: skip
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))  # fmt: skip
        # A message cut by max_output_tokens is incomplete (OpenAI's item status); the rest are whole.
        cut = self.incomplete_details is not None and item["type"] == "message"
        item["status"] = "incomplete" if cut else "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
