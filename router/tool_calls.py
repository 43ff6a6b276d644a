"""Tool calling on the chat API: OpenAI's ``tools`` and ``tool_choice``, served as vLLM serves them.

The tools go to the chat template (``tools=``), which tells the model how to call them. What the model
writes back is turned into ``tool_calls``:
- ``tool_choice: "auto"`` (the default with tools): the router's tool-call parser reads the text (vLLM's
  names). ``hermes`` (Qwen2.5/Qwen3, Hermes and others write calls so) takes each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block as a call; the text before the first
  block is the message's content. ``llama3_json`` (Llama 3.1-3.3's JSON tool calling) takes a reply that
  is JSON, ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (after an optional
  ``<|python_tag|>``), as its calls; any other reply is content. ``qwen3_coder`` (Qwen3-Coder) reads
  ``<tool_call>`` blocks of XML, ``<function=NAME>`` with one ``<parameter=P>value</parameter>`` per
  argument, each value typed by the function's parameters schema (a string stays text; integers, numbers,
  booleans, objects and arrays are parsed). ``pythonic`` (Llama 3.2 and 4, and models tuned to it) takes
  a reply that is a Python list of calls, ``[get_weather(city="Oslo"), get_time()]``, keyword arguments
  of literal values, as its calls (each streams once its head is read: ``PythonicCall``); any other reply
  is content. ``--tool-call-parser none`` refuses
  "auto" (400), as vLLM does without ``--enable-auto-tool-choice``.
- ``"required"``: the output is held (structured outputs) to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each, with its parameters' schema: vLLM's rule. Each item is a call.
- a named function: the output is held to that function's parameters schema and is its arguments
  (``finish_reason`` stays "stop", as OpenAI's).
  Both constraints are compact JSON (no whitespace between tokens): arguments are read by programs, and
  a model cannot then loop on whitespace until ``max_tokens``.
- ``"none"``: the text is the content; no parsing.

``ToolCallStream`` turns a choice's text deltas into content deltas and tool-call deltas in OpenAI's
streaming shape; a whole reply is the same machine fed the whole text, so streamed and whole replies
always agree. Nothing here does I/O.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured_outputs import StructuredOutputs
from router.errors import InvalidRequestError
from router.json_stream import JSON_NAMES
from router.text_stream import marker_prefix_length
from router.tool_call_blocks import HermesBlock, PythonicCall, Qwen3CoderBlock, arguments_text

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "pythonic", "none")
# The parsers whose reply is calls only or content only: one that opens as calls (a JSON object, a list) is
# held until its first call opens (its calls then stream) or cannot (it is then read whole at its end).
WHOLE_REPLY_PARSERS = ("llama3_json", "pythonic")
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a tool call (a special token: often not in the text)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around pythonic calls
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # as the client gave them: what the chat template reads
    schemas: dict[str, dict[str, Any]]  # each function's parameters schema
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # with choice "function": its name
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call
    parser: str = "hermes"  # with choice "auto": TOOL_CALL_PARSERS

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The structured output that "required" and a named function hold the output to."""
        if self.choice == "function":
            assert self.function is not None
            return StructuredOutputs(json=self.schemas[self.function], disable_any_whitespace=True)
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # nothing else is read
            }
            for name, schema in self.schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=array, disable_any_whitespace=True)


def parse_tools(body: dict[str, Any], parser: str) -> ToolRequest | None:
    """The request's tools and tool choice (None when it has no tools); 400s name the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be an array of tools", param="tools")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                param="tools",
            )
        params = fn.get("parameters")  # type: ignore[union-attr]
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema", param="tools")
        if name in schemas:
            raise InvalidRequestError(f"tools has two functions named {name!r}", param="tools")
        schemas[name] = params or {"type": "object", "properties": {}}
    if choice is None or choice == "auto":
        if parser == "none":
            raise InvalidRequestError(
                'tool_choice "auto" needs a tool-call parser; this router runs with --tool-call-parser none '
                "(or --no-enable-auto-tool-choice)",
                param="tool_choice",
            )
        return ToolRequest(tools, schemas, "auto", parallel=parallel, parser=parser)
    if choice in ("none", "required"):
        return ToolRequest(tools, schemas, choice, parallel=parallel)
    name = None
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in schemas:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return ToolRequest(tools, schemas, "function", name)


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a Llama 3 JSON reply (objects separated by ``;``), or None if it is not only calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append((obj["name"], arguments_text(args)))
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return calls or None


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a pythonic reply (``[f(a=1), g()]``), or None if the reply is not only calls."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                args[keyword.arg] = _literal(keyword.value)
            except ValueError:
                return None
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):  # a literal JSON has no form for (bytes, complex, sets)
            return None
        calls.append((node.func.id, arguments))
    return calls


def _literal(node: ast.expr) -> Any:
    """A Python literal, with JSON's true, false and null read as their Python values (models write both)."""
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


@dataclass
class ToolCallStream:
    """One choice's text as content and tool calls. ``add`` takes each text delta and returns the content
    delta and the tool-call deltas it settles; ``finish`` settles the rest."""

    request: ToolRequest
    # A whole (not streamed) reply: llama3_json's and pythonic's calls are checked against the whole text at
    # its end, so a reply whose call turns out broken after it opened is content, not a cut call (streamed,
    # what went out cannot be taken back); one cut short inside its last call keeps the calls as written.
    whole: bool = False
    content: str = ""  # every content delta so far
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, for a whole reply
    _buffer: str = ""
    _block: HermesBlock | Qwen3CoderBlock | PythonicCall | None = None  # the call being read
    _block_call: dict[str, Any] | None = None  # the call it opened
    _block_dropped: bool = False  # a call after the first with parallel_tool_calls false
    _deltas: list[dict[str, Any]] = field(default_factory=list)  # call deltas not yet returned
    _growing: dict[int, dict[str, Any]] = field(default_factory=dict)  # of those, each call's arguments
    _parts: dict[int, list[str]] = field(default_factory=dict)  # open calls' arguments, in pieces
    _seen_call: bool = False  # after the first call, text outside calls is not content (vLLM's rule)
    _calls_reply: bool | None = (
        None  # whole-reply parsers: whether the reply opens as calls (None: not known)
    )
    # llama3_json's and "required"'s call objects, and pythonic's calls, read as they stream (_objects_read):
    # where the unread text of the buffer starts, whether a call has opened (the reply is then calls), and
    # whether reading is over (the calls ended, or did not begin as calls: such a reply is read whole at its
    # end).
    _objects_pos: int = -1
    _objects_streaming: bool = False
    _objects_done: bool = False
    _whole_text: str = ""  # with ``whole``: every delta

    def add(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        choice = self.request.choice
        if choice == "function":
            return self._named(delta)
        self._buffer += delta
        if self.whole:
            self._whole_text += delta
        if choice == "required":  # the constrained array's objects, read as llama3_json's are
            self._objects_read(", \t\r\n", "[")
            return "", self._take_deltas()
        if self.request.parser in WHOLE_REPLY_PARSERS:
            return self._whole_reply_add()
        out_text = ""
        while True:
            if self._block is not None:
                end = self._buffer.find(CALL_END)
                if end < 0:  # the block goes on: what cannot be the start of its end is read now
                    keep = marker_prefix_length(self._buffer, CALL_END)
                    ready, self._buffer = (
                        self._buffer[: len(self._buffer) - keep],
                        self._buffer[len(self._buffer) - keep :],
                    )
                    self._feed_block(ready)
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END) :]
                self._feed_block(block)
                out_text += self._close_block(closed=True)
                continue
            start = self._buffer.find(CALL_START)
            if start < 0:
                keep = marker_prefix_length(self._buffer, CALL_START)  # may be the start of a call
                ready, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                out_text += self._outside(ready)
                break
            out_text += self._outside(self._buffer[:start])
            self._buffer = self._buffer[start + len(CALL_START) :]
            self._block = (
                Qwen3CoderBlock(self.request.schemas)
                if self.request.parser == "qwen3_coder"
                else HermesBlock()
            )
        self.content += out_text
        return out_text, self._take_deltas()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self._buffer = self._buffer, ""
        if self.request.choice == "function":
            if self.calls:
                self._seal(self.calls[0])
            return "", []
        if self.request.choice == "required":
            return self._required(rest)
        if self.request.parser in WHOLE_REPLY_PARSERS:
            return self._whole_reply_finish(rest)
        if self._block is not None:  # an unclosed last block (cut by max_tokens, say)
            self._feed_block(rest)
            text = self._close_block(closed=False)
        else:
            text = self._outside(rest)
        self.content += text
        return text, self._take_deltas()

    def _outside(self, text: str) -> str:
        return "" if self._seen_call else text

    def _feed_block(self, text: str) -> None:
        """Read more of the block: its call opens once its function's name is known, then grows."""
        block = self._block
        assert block is not None
        arguments = block.feed(text)
        if block.name is not None and self._block_call is None and not self._block_dropped:
            if self.calls and not self.request.parallel:
                self._block_dropped = True  # parallel_tool_calls false: the first call only
            else:
                self._block_call = self._open_call(block.name, "")
        if self._block_call is not None:
            self._extend_call(arguments, self._block_call)

    def _close_block(self, closed: bool) -> str:
        """The block's end: the rest of its call's arguments; a block that opened no call is a call if its
        whole text makes one, else the model's text, markers included."""
        block, call, dropped = self._block, self._block_call, self._block_dropped
        assert block is not None
        self._block, self._block_call, self._block_dropped = None, None, False
        arguments = block.close()
        if call is not None:
            self._extend_call(arguments, call)
            self._seal(call)
            return ""
        if dropped:
            return ""
        found = block.whole_call()
        if found is None:
            return self._outside(CALL_START + block.raw + (CALL_END if closed else ""))
        if self.calls and not self.request.parallel:
            return ""
        self._open_call(*found)
        return ""

    def _open_call(self, name: str, arguments: str) -> dict[str, Any]:
        """A call opens with a delta of its own: its name, and its arguments ("" for a call whose arguments
        stream: they follow in deltas of their own, as OpenAI's do)."""
        self._seen_call = True
        call = _call(len(self.calls), name, arguments)
        self.calls.append(call)
        self._deltas.append({**call, "function": dict(call["function"])})  # a copy: the call grows
        return call

    def _extend_call(self, arguments: str, call: dict[str, Any]) -> None:
        """More of ``call``'s arguments: into this add's delta, and into the call's parts (joined when it
        closes: a long argument grown one piece at a time would be copied whole each time)."""
        if not arguments:
            return
        self._parts.setdefault(call["index"], []).append(arguments)
        delta = self._growing.get(call["index"])
        if delta is None:
            delta = self._growing[call["index"]] = {"index": call["index"], "function": {"arguments": ""}}
            self._deltas.append(delta)
        delta["function"]["arguments"] += arguments

    def _seal(self, call: dict[str, Any]) -> None:
        """The call's arguments whole, once it closes."""
        call["function"]["arguments"] += "".join(self._parts.pop(call["index"], ()))

    def _take_deltas(self) -> list[dict[str, Any]]:
        deltas, self._deltas, self._growing = self._deltas, [], {}
        return deltas

    def _required(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._objects_streaming:  # its calls went out as they came: the last one ends here
            if self._block is not None:
                self._close_block(closed=False)
            return "", self._take_deltas()
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not (
            isinstance(items, list) and items and all(isinstance(i, dict) and "name" in i for i in items)
        ):
            self.content += text  # cut short (length): no calls, the text as it is
            return text, []
        for item in items:
            args = arguments_text(item.get("parameters", {}))
            self.calls.append(_call(len(self.calls), str(item["name"]), args))
        return "", list(self.calls)

    def _whole_reply_add(self) -> tuple[str, list[dict[str, Any]]]:
        """Content passes through at once unless the reply opens as calls (llama3_json: a JSON object,
        pythonic: a list); such a reply is held until its first call opens (its calls then stream) or
        cannot (it then waits for its end)."""
        if self._calls_reply is None:
            head = self._buffer.lstrip()
            tag = PYTHON_TAG if self.request.parser == "llama3_json" else PYTHON_START
            if not head or tag.startswith(head):
                return "", []  # not known yet
            self._calls_reply = head.startswith(("{" if self.request.parser == "llama3_json" else "[", tag))
        if self._calls_reply:
            if self.request.parser == "llama3_json":
                self._objects_read(" \t\r\n;", PYTHON_TAG)
            else:
                self._objects_read(", \t\r\n", PYTHON_START, pythonic=True)
            return "", self._take_deltas()
        text, self._buffer = self._buffer, ""
        self.content += text
        return text, []

    def _whole_reply_finish(self, rest: str) -> tuple[str, list[dict[str, Any]]]:
        if not self._calls_reply:
            self.content += rest
            return rest, []
        cut = self._block is not None and not self._block.error
        if self._objects_streaming and self.whole and not cut:
            # Nothing went out yet: unless the reply was cut inside its last call, it is what the whole
            # text is, calls or content.
            self.calls, self._deltas, self._growing, self._parts = [], [], {}, {}
            self._block, self._objects_streaming, rest = None, False, self._whole_text
        if self._objects_streaming:  # its calls went out as they came: the last one ends here
            if self._block is not None:
                self._close_block(closed=False)
            return "", self._take_deltas()
        if self.request.parser == "pythonic":
            found = _pythonic_calls(rest)
        else:
            found = _llama3_calls(rest.strip().removeprefix(PYTHON_TAG))
        if found is None:  # not calls after all: the reply is content
            self.content += rest
            return rest, []
        for name, arguments in found[: None if self.request.parallel else 1]:
            self.calls.append(_call(len(self.calls), name, arguments))
        return "", list(self.calls)

    def _objects_read(self, separators: str, opener: str, pythonic: bool = False) -> None:
        self._objects_scan(separators, opener, pythonic)
        if self._objects_streaming and self._objects_pos > 0:  # calls opened: what was read is not needed
            self._buffer, self._objects_pos = self._buffer[self._objects_pos :], 0

    def _objects_scan(self, separators: str, opener: str, pythonic: bool) -> None:
        """Read a reply of call objects (``{"name": ..., "parameters": {...}}``) as they come: llama3_json's
        (after an optional ``<|python_tag|>``, separated by ``;``) and "required"'s JSON array (after its
        ``[``, separated by ``,``). Each is a hermes-like block: a call opens at its name and its arguments
        stream. ``pythonic``: the calls of a list (after an optional ``<|python_start|>``, then ``[``), each
        a ``PythonicCall``. The whole reply stays in the buffer until a call opens (``_objects_read`` then
        drops what was read): one whose first object is not such a call is read whole at its end (calls, or
        content), as before; what follows the calls of one that is is not read."""
        if self._objects_done:
            return
        text = self._buffer
        if self._objects_pos < 0:  # after the leading space and the opener, once there is text to see it
            lead = len(text) - len(text.lstrip())
            if lead == len(text) or opener.startswith(text[lead:]) and len(text) - lead < len(opener):
                return
            start = lead + (len(opener) if text.startswith(opener, lead) else 0)
            if pythonic:  # then the list's "["
                head = text[start:].lstrip()
                if not head:
                    return
                if head[0] != "[":
                    self._objects_done = True
                    return
                start = len(text) - len(head) + 1
            self._objects_pos = start
        while not self._objects_done:
            if self._block is None:
                i = self._objects_pos
                while i < len(text) and text[i] in separators:
                    i += 1
                self._objects_pos = i
                if i == len(text):
                    return
                if not (text[i].isidentifier() if pythonic else text[i] == "{"):
                    self._objects_done = True
                    return
                self._block = PythonicCall() if pythonic else HermesBlock()
            chunk, self._objects_pos = text[self._objects_pos :], len(text)
            if chunk:
                self._feed_block(chunk)
            block = self._block
            assert isinstance(block, HermesBlock | PythonicCall)
            if block.name is None:
                if block.head_failed:  # not a call: the first such object makes the reply read whole
                    self._block, self._objects_done = None, True
                return
            self._objects_streaming = True
            rest = block.rest
            if rest is None:
                return  # the arguments go on
            if pythonic:  # the call ended with its ")"
                self._close_block(closed=True)
                self._objects_pos = len(text) - len(rest)
                continue
            j = len(rest) - len(rest.lstrip())
            if j == len(rest):
                return  # the object's closing brace is still to come
            self._close_block(closed=True)
            if rest[j] != "}":
                self._objects_done = True  # not the object's end: nothing more is read
                return
            self._objects_pos = len(text) - (len(rest) - j - 1)  # what followed the object is read again

    def _named(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The text is the named function's arguments: a first delta opens the call, the rest extend it."""
        if not delta:  # nothing yet (a reasoning model may still be thinking): no call opened
            return "", []
        self._parts.setdefault(0, []).append(delta)  # joined at the end (finish)
        if not self.calls:
            assert self.request.function is not None
            call = _call(0, self.request.function, "")
            self.calls.append(call)
            return "", [{**call, "function": {"name": call["function"]["name"], "arguments": delta}}]
        return "", [{"index": 0, "function": {"arguments": delta}}]
