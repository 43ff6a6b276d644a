"""``StructuredOutputs`` (engine/structured_outputs.py) to and from its protobuf message, one place for the
router, which sends it, and the workers, which take it."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_outputs import StructuredOutputs
from protos.pdmesh.v1 import common_pb2


def structured_outputs_to_proto(spec: StructuredOutputs) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.reasoning is not None:
        msg.think_start_token, msg.think_end_token = spec.reasoning
    if spec.whitespace_pattern is not None:
        msg.whitespace_pattern = spec.whitespace_pattern
    kind = spec.kind
    if kind == "json":
        msg.json_schema = spec.json or ""
    elif kind == "json_object":
        msg.json_object = True
    elif kind == "regex":
        msg.regex = spec.regex or ""
    elif kind == "choice":
        msg.choice.choices.extend(spec.choice or ())
    else:
        msg.grammar = spec.grammar or ""
    return msg


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputs | None:
    """None when no kind is set (the field left out: no constraint)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    common: dict[str, Any] = {"disable_any_whitespace": msg.disable_any_whitespace}
    if msg.HasField("whitespace_pattern"):
        common["whitespace_pattern"] = msg.whitespace_pattern
    has_start, has_end = msg.HasField("think_start_token"), msg.HasField("think_end_token")
    if has_start != has_end:
        raise InvalidRequestError(
            "structured_outputs needs both think_start_token and think_end_token, or neither"
        )
    if has_start:
        common["reasoning"] = (msg.think_start_token, msg.think_end_token)
    if kind == "json_schema":
        return StructuredOutputs(json=msg.json_schema, **common)
    if kind == "json_object":
        # json_object = false is a set oneof that asks for nothing: refused by validate (no kind set).
        return StructuredOutputs(json_object=msg.json_object, **common)
    if kind == "regex":
        return StructuredOutputs(regex=msg.regex, **common)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.choices), **common)
    return StructuredOutputs(grammar=msg.grammar, **common)
