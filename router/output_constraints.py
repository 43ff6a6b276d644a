"""The output constraints an OpenAI-style body can ask for, parsed into one ``StructuredOutputs``
(engine/structured_outputs.py): OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields. At most one may constrain a request. Shapes are checked here (400 naming the
field); whether a schema, regex or grammar compiles is the worker's check (INVALID_ARGUMENT, a 400 too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError as EngineInvalidRequest
from engine.structured_outputs import StructuredOutputs
from router.errors import InvalidRequestError

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs keys taken here; disable_fallback only picks among vLLM's backends (one here).
STRUCTURED_KEYS = {
    "json",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "disable_any_whitespace",
    "whitespace_pattern",
    "disable_fallback",
}


def parse_output_constraint(body: Mapping[str, Any]) -> StructuredOutputs | None:
    """The body's one output constraint, or None."""
    found: dict[str, StructuredOutputs] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found["response_format"] = spec
    so = body.get("structured_outputs")
    if so is not None:
        found["structured_outputs"] = _structured_outputs(so)
    guided = {name: body[name] for name in GUIDED_FIELDS if body.get(name) is not None}
    if guided:
        values = {GUIDED_FIELDS[name]: value for name, value in guided.items()}
        if body.get("guided_whitespace_pattern") is not None:
            values["whitespace_pattern"] = body["guided_whitespace_pattern"]
        found[" and ".join(guided)] = _spec(values, next(iter(guided)), prefix="")
    if len(found) > 1:
        raise InvalidRequestError(
            f"only one output constraint may be given; got {', '.join(found)}", param=next(iter(found))
        )
    return next(iter(found.values()), None)


def _response_format(fmt: Any) -> StructuredOutputs | None:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError("'response_format' must be an object with a string 'type'", param=param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                "response_format of type json_schema needs a 'json_schema' object", param=param
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema needs a 'schema' object (the JSON schema)", param=param
            )
        return StructuredOutputs(json=schema)
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}", param=param
    )


def _structured_outputs(value: Any) -> StructuredOutputs:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequestError("'structured_outputs' must be an object", param=param)
    unknown = sorted(set(value) - STRUCTURED_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs keys {unknown} are not supported (supported: {sorted(STRUCTURED_KEYS)})",
            param=param,
        )
    values = {k: v for k, v in value.items() if k != "disable_fallback" and v is not None}
    if values.get("json_object") is False:
        del values["json_object"]
    return _spec(values, param, prefix="structured_outputs.")


def _spec(values: dict[str, Any], param: str, prefix: str) -> StructuredOutputs:
    """A ``StructuredOutputs`` from vLLM-named values, each type checked."""
    guided_names = {
        **{v: k for k, v in GUIDED_FIELDS.items()},
        "whitespace_pattern": "guided_whitespace_pattern",
    }
    names = guided_names if not prefix else {}

    def bad(key: str, want: str) -> InvalidRequestError:
        return InvalidRequestError(f"'{prefix}{names.get(key, key)}' must be {want}", param=param)

    kwargs: dict[str, Any] = {}
    if "json" in values:
        schema = values["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad("json", f"a JSON schema; it is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise bad("json", "a JSON schema (an object, or its JSON text)")
        kwargs["json"] = schema
    if "whitespace_pattern" in values:
        if not isinstance(values["whitespace_pattern"], str):
            raise bad("whitespace_pattern", "a string (a regex)")
        kwargs["whitespace_pattern"] = values["whitespace_pattern"]
    for key in ("regex", "grammar"):
        if key in values:
            if not isinstance(values[key], str):
                raise bad(key, "a string")
            kwargs[key] = values[key]
    if "choice" in values:
        choice = values["choice"]
        if not isinstance(choice, list) or not all(isinstance(c, str) for c in choice):
            raise bad("choice", "an array of strings")
        kwargs["choice"] = tuple(choice)
    for key in ("json_object", "disable_any_whitespace"):
        if key in values:
            if not isinstance(values[key], bool):
                raise bad(key, "a boolean")
            kwargs[key] = values[key]
    spec = StructuredOutputs(**kwargs)
    try:
        spec.validate()
    except EngineInvalidRequest as exc:  # the same message, with the field
        raise InvalidRequestError(str(exc), param=param) from None
    return spec
