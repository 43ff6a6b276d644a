"""``StructuredOutputs`` (engine/structured_outputs.py) to and from its protobuf message, one place for the
router, which sends it, and the workers, which take it."""

from __future__ import annotations

from engine.structured_outputs import StructuredOutputs
from protos.pdmesh.v1 import common_pb2


def structured_outputs_to_proto(spec: StructuredOutputs) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
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
    whitespace = msg.disable_any_whitespace
    if kind == "json_schema":
        return StructuredOutputs(json=msg.json_schema, disable_any_whitespace=whitespace)
    if kind == "json_object":
        # json_object = false is a set oneof that asks for nothing: refused by validate (no kind set).
        return StructuredOutputs(json_object=msg.json_object, disable_any_whitespace=whitespace)
    if kind == "regex":
        return StructuredOutputs(regex=msg.regex, disable_any_whitespace=whitespace)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.choices), disable_any_whitespace=whitespace)
    return StructuredOutputs(grammar=msg.grammar, disable_any_whitespace=whitespace)
