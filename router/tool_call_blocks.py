"""The calls of a chat reply, each read as it streams: the ``<tool_call>`` blocks of hermes's JSON
(``{"name": ..., "arguments": {...}}``) and of Qwen3-Coder's XML (``<function=NAME>`` with one
``<parameter=P>value</parameter>`` per argument, typed by the function's parameters schema, vLLM's rules), and
the calls of a pythonic list (``get_weather(city="Oslo")``). ``router.tool_calls`` finds them in the text;
nothing here does I/O.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from typing import Any

import regex

from router.json_stream import CanonicalJson, CanonicalPython
from router.text_stream import marker_prefix_length


def arguments_text(args: Any) -> str:
    """A call's arguments as OpenAI gives them: JSON text (a model that wrote them as a string keeps it)."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one ``<tool_call>`` block's body, or None if it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], arguments_text(args)


def _is_string(kind: Any) -> bool:
    """A schema type Qwen3-Coder's values keep as text: a string, or no type at all."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    return kind is None or bool(kinds & {"string", "str", "text"})


def typed_value(text: str, kind: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type says (vLLM's rules): ``null`` is null; strings,
    and parameters the schema does not type, stay text; the rest is parsed (a number; a boolean; JSON, then
    a Python literal), and text that does not parse stays text."""
    value = text.strip()
    if value.lower() == "null":
        return None
    if _is_string(kind):
        return text
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {"integer", "number"}:
        for number in (int, float):
            try:
                return number(value)
            except ValueError:
                pass
        return text
    if "boolean" in kinds and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


# ---- reading a block as it streams ------------------------------------------------------------------
# A block's call opens once its function's name is known, and its arguments then stream in the canonical
# form of router.json_stream (what json.dumps writes), so a client sees a long argument as it is written.

# The head of a hermes block, up to its arguments' value: a name first, then "arguments" (or "parameters").
_HERMES_HEAD = regex.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*)"\s*,'
    r'\s*"(?:arguments|parameters)"\s*:\s*'
)


class HermesBlock:
    """One ``<tool_call>`` block of hermes JSON. ``feed`` takes its text and returns the arguments it settles
    (``name`` is set once the call opens); ``close`` returns the rest. A block whose head is not
    ``{"name": ..., "arguments": `` (the keys in another order, say) is read whole at its end:
    ``whole_call``."""

    def __init__(self) -> None:
        self.raw = ""  # the block's text until its call opens (after that it is not needed, nor kept)
        self.name: str | None = None
        self._head_failed = False
        self._json: CanonicalJson | None = None
        self._string: str | None = None  # arguments given as a JSON string: its text until it ends
        self._string_read = False

    @property
    def error(self) -> bool:
        """The arguments stopped being JSON (their call cannot be whole any more)."""
        return self._json is not None and self._json.error

    def feed(self, text: str) -> str:
        if self.name is None:
            self.raw += text
            if self._head_failed:
                return ""
            head = _HERMES_HEAD.match(self.raw)
            if head is None:
                self._head_failed = _HERMES_HEAD.fullmatch(self.raw, partial=True) is None
                return ""
            self.name = json.loads(f'"{head.group(1)}"')
            text = self.raw[head.end() :]
        return self._value(text)

    def _value(self, text: str) -> str:
        if self._json is None and self._string is None:
            text = text.lstrip()
            if not text:
                return ""
            if text[0] == '"':  # arguments written as a string: given as the string's text, once whole
                self._string = ""
            else:
                self._json = CanonicalJson()
        if self._json is not None:
            return self._json.feed(text)
        assert self._string is not None
        if self._string_read:
            return ""
        opening = not self._string  # the text starts with the string's opening quote
        self._string += text
        if '"' not in text[opening:]:
            return ""  # no closing quote came: the string has not ended
        try:
            value, _ = json.JSONDecoder().raw_decode(self._string)
        except ValueError:
            return ""
        self._string_read = True
        return str(value)

    def close(self) -> str:
        return self._json.finish() if self._json is not None else ""

    @property
    def head_failed(self) -> bool:
        """The block does not begin ``{"name": ..., "arguments": `` (it is read whole, if at all)."""
        return self._head_failed

    @property
    def rest(self) -> str | None:
        """The text after the arguments' value, once it has ended (JSON arguments only)."""
        return self._json.rest if self._json is not None and self._json.done else None

    def whole_call(self) -> tuple[str, str] | None:
        """A block whose call never opened: the call its whole text makes, if any."""
        return hermes_call(self.raw.strip()) if self._head_failed else None


_FUNCTION_HEAD = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_HEAD = "<parameter="
_VALUE_ENDS = ("</parameter>", _PARAMETER_HEAD, "</function>")  # where a value ends (vLLM's rule)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    return max(marker_prefix_length(text, marker) for marker in markers)


class Qwen3CoderBlock:
    """One ``<tool_call>`` block of Qwen3-Coder XML, read as ``HermesBlock`` reads hermes's. The call opens
    at ``<function=NAME>`` (``{``); each parameter adds ``"P": value``: a value the schema types as a string
    (or does not type) streams as it is written, any other once it ends; ``</function>`` closes it (``}``).
    The canonical form keeps a parameter given twice twice."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.raw = ""  # the block's text until its call opens
        self.name: str | None = None
        self._schemas = schemas
        self._types: dict[str, Any] = {}
        self._failed = False
        self._text = ""  # text after the function's head not yet read
        self._state = "between"  # "between" parameters, in a parameter's "value", or "end" of the function
        self._count = 0  # parameters so far
        self._kind: Any = None  # the parameter's schema type
        # A parameter's value: its text while it is not known to be a streamed string (a typed value, or one
        # that could still be null); once streaming, only whether a newline is held back (it may be the
        # value's last, which is not part of it).
        self._value: list[str] = []
        self._streaming = False
        self._held_newline = False

    def feed(self, text: str) -> str:
        if self.name is None:
            self.raw += text
            if self._failed:
                return ""
            head = _FUNCTION_HEAD.search(self.raw)
            if head is None:
                return ""
            if not head.group(1).strip():
                self._failed = True
                return ""
            self.name = head.group(1).strip()
            properties = self._schemas.get(self.name, {}).get("properties")
            self._types = properties if isinstance(properties, dict) else {}
            self._text = self.raw[head.end() :]
            return "{" + self._read(end=False)
        self._text += text
        return self._read(end=False)

    def close(self) -> str:
        if self.name is None:
            return ""
        out = self._read(end=True)
        if self._state == "value":
            out += self._end_value()
        if self._state != "end":
            self._state = "end"
            out += "}"
        return out

    def whole_call(self) -> tuple[str, str] | None:
        return None  # a block without a function's head is not a call

    def _read(self, end: bool) -> str:
        out = ""
        while self._state != "end":
            text = self._text
            if self._state == "between":
                param, fn_end = text.find(_PARAMETER_HEAD), text.find("</function>")
                if fn_end >= 0 and (param < 0 or fn_end < param):
                    self._text, self._state = "", "end"
                    return out + "}"
                if param < 0:
                    self._text = text[len(text) - _held(text, (_PARAMETER_HEAD, "</function>")) :]
                    return out
                close = text.find(">", param)
                newline = text.find("\n", param)
                if 0 <= newline < (close if close >= 0 else len(text)):  # not a parameter's head
                    self._text = text[param + 1 :]
                    continue
                if close < 0:
                    self._text = text[param:]
                    return out
                name = text[param + len(_PARAMETER_HEAD) : close].strip()
                self._text = text[close + 1 :]
                spec = self._types.get(name)
                self._kind = spec.get("type") if isinstance(spec, dict) else None
                self._value, self._streaming, self._held_newline, self._state = [], False, False, "value"
                out += (", " if self._count else "") + json.dumps(name, ensure_ascii=False) + ": "
                self._count += 1
                continue
            ends = [i for i in (text.find(m) for m in _VALUE_ENDS) if i >= 0]
            if ends:
                stop = min(ends)
                out += self._take(text[:stop])
                self._text = text[stop:].removeprefix("</parameter>")
                out += self._end_value()
                continue
            held = 0 if end else _held(text, _VALUE_ENDS)
            self._text = text[len(text) - held :]
            return out + self._take(text[: len(text) - held])
        return out

    def _take(self, text: str) -> str:
        """More of the value's text: a string value's part that is settled streams (not its first or last
        newline, neither part of it; nothing while it could still be ``null``); other values wait whole."""
        if self._streaming:
            return self._emit(text)
        self._value.append(text)
        if not _is_string(self._kind):
            return ""
        body = "".join(self._value).removeprefix("\n")
        if "null".startswith(body.strip().lower()):
            return ""
        self._streaming, self._value = True, []
        return '"' + self._emit(body)

    def _emit(self, text: str) -> str:
        text = ("\n" if self._held_newline else "") + text
        self._held_newline = text.endswith("\n")
        return json.dumps(text.removesuffix("\n") if self._held_newline else text, ensure_ascii=False)[1:-1]

    def _end_value(self) -> str:
        self._state = "between"
        if self._streaming:  # a newline still held back was the value's last
            return '"'
        value = "".join(self._value).removeprefix("\n").removesuffix("\n")
        typed = typed_value(value, self._kind)
        try:
            return json.dumps(typed, ensure_ascii=False)
        except (TypeError, ValueError):  # a Python literal JSON has no form for (a set, bytes)
            return json.dumps(value, ensure_ascii=False)


# The head of a pythonic call, up to where it is known to be one: its name and "(", then ")" or a keyword
# argument whose value begins as a literal (not a positional argument, a variable or **kwargs).
_PYTHONIC_HEAD = regex.compile(
    r"""\s*([^\W\d]\w*)\s*\(\s*(?:\)|[^\W\d]\w*\s*=(?!=)\s*"""
    r"""(?:[rRuU]?["']|[-+]?\s*\.?\d|[\[{(]|(?:True|False|None|true|false|null)(?=[\s,)\]}])))"""
)


class PythonicCall:
    """One call of a pythonic list, ``name(key=value, ...)``, read as ``HermesBlock`` reads a hermes block:
    the call opens at its head (``_PYTHONIC_HEAD``) and its arguments stream as a JSON object, each value
    read by ``CanonicalPython``; ``rest`` is the text after its ``)``. Text that does not go on as a call
    stops the arguments where they are (``error``)."""

    def __init__(self) -> None:
        self.raw = ""  # the call's text until it opens
        self.name: str | None = None
        self.rest: str | None = None
        self.error = False
        self._head_failed = False
        self._state = "key_or_end"  # or "key" (in its name), "equals", "comma_or_end" (after a value)
        self._key = ""
        self._value: CanonicalPython | None = None  # the keyword's value being read
        self._count = 0  # keyword arguments so far

    @property
    def head_failed(self) -> bool:
        return self._head_failed

    def feed(self, text: str) -> str:
        if self.name is None:
            self.raw += text
            if self._head_failed:
                return ""
            head = _PYTHONIC_HEAD.match(self.raw)
            if head is None:
                self._head_failed = _PYTHONIC_HEAD.fullmatch(self.raw, partial=True) is None
                return ""
            self.name = unicodedata.normalize("NFKC", head.group(1))  # as Python reads a name
            text = self.raw[self.raw.index("(", head.end(1)) + 1 :]
            return "{" + self._read(text)
        return self._read(text)

    def close(self) -> str:
        return self._value.finish() if self._value is not None and not self.error else ""

    def whole_call(self) -> tuple[str, str] | None:
        return None  # a call that never opened is read with the whole reply

    def _read(self, text: str) -> str:
        out: list[str] = []
        i = 0
        while i < len(text) and self.rest is None and not self.error:
            if self._value is not None:
                out.append(self._value.feed(text[i:]))
                self.error = self._value.error
                if not self._value.done:
                    break
                text, i, self._value, self._state = self._value.rest, 0, None, "comma_or_end"
                continue
            ch = text[i]
            i += 1
            if self._state == "key":
                if ("_" + ch).isidentifier():  # the name goes on
                    self._key += ch
                    continue
                self._state = "equals"
            state = self._state
            if ch in " \t\r\n\f":
                continue
            if state == "equals" and ch == "=":
                key = json.dumps(unicodedata.normalize("NFKC", self._key), ensure_ascii=False)
                out.append((", " if self._count else "") + key + ": ")
                self._count += 1
                self._value = CanonicalPython()
            elif state == "key_or_end" and ch.isidentifier():
                self._key, self._state = ch, "key"
            elif state == "comma_or_end" and ch == ",":
                self._state = "key_or_end"  # a trailing comma may follow
            elif state in ("key_or_end", "comma_or_end") and ch == ")":
                out.append("}")
                self.rest = text[i:]
            else:
                self.error = True
        return "".join(out)
