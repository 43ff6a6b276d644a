"""The ``<tool_call>`` blocks of a chat reply: hermes's JSON (``{"name": ..., "arguments": {...}}``) and
Qwen3-Coder's XML (``<function=NAME>`` with one ``<parameter=P>value</parameter>`` per argument, typed by the
function's parameters schema, vLLM's rules). ``router.tool_calls`` finds the blocks in the text; nothing
here does I/O.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any


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


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
# A value ends at its closing tag, or where the next parameter or the function's end begins (vLLM's rule).
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)


def qwen3_coder_call(block: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one Qwen3-Coder ``<tool_call>`` body, or None if it is not one."""
    match = _FUNCTION.search(block)
    if match is None or not match.group(1).strip():
        return None
    name = match.group(1).strip()
    properties = schemas.get(name, {}).get("properties")
    types = properties if isinstance(properties, dict) else {}
    args = {}
    for param, raw in _PARAMETER.findall(match.group(2)):
        value = raw.removeprefix("\n").removesuffix("\n")  # the model writes each value on lines of its own
        spec = types.get(param.strip())
        args[param.strip()] = typed_value(value, spec.get("type") if isinstance(spec, dict) else None)
    return name, json.dumps(args, ensure_ascii=False)


def typed_value(text: str, kind: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type says (vLLM's rules): ``null`` is null; strings,
    and parameters the schema does not type, stay text; the rest is parsed (a number; a boolean; JSON, then
    a Python literal), and text that does not parse stays text."""
    value = text.strip()
    if value.lower() == "null":
        return None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or kinds & {"string", "str", "text"}:
        return text
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
