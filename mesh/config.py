"""One config definition for every setting: dataclass fields declared with ``setting()``.

From those fields this module derives the command-line flags (``--block-size``), their environment
twins (``PDMESH_BLOCK_SIZE``) and the reference docs (``docs/configuration.md``). A setting is
declared once; nothing else spells its name, default or help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "PDMESH_"


def setting(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    cli: bool = True,
    negated_by: str | None = None,
) -> Any:
    """A config field with its help text; ``cli=False`` keeps it out of flags and env (Python only);
    ``negated_by`` (a bool setting): another flag that sets it false, as vLLM spells it (``enforce_eager``
    for ``--no-cuda-graphs``)."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "cli": cli,
            "negated_by": negated_by}  # fmt: skip
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def dtype_setting() -> Any:
    """The weights' ``dtype`` field, one declaration for the engine's settings and ``pdmesh up``'s."""
    return setting(
        "auto",
        "Weight dtype (and the KV cache's where kv_cache_dtype is auto). auto: the checkpoint's own "
        "(config.json's dtype or torch_dtype: bfloat16 for most, float8 checkpoints included), float32 for "
        "the built-in models and for checkpoints that name none, as vLLM's --dtype auto.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )


def quantization_setting() -> Any:
    """The weights' ``quantization`` field, one declaration for the engine's settings and ``pdmesh up``'s."""
    return setting(
        "auto",
        "How linear weights are held. auto: a float8 checkpoint's weights stay float8 on the device (half "
        "the memory of 16-bit weights, and decode streams half the bytes), with their scales, where the "
        "kernels read its layout (a scale per 128x128 block, per channel or per tensor); 16-bit checkpoints "
        "stay as they are. fp8: also quantise 16-bit checkpoints' attention, MLP and expert weights to "
        "float8 e4m3 as they load (a scale per 128x128 block where the shapes allow, else per row; vLLM's "
        "--quantization fp8). none: widen float8 checkpoints to dtype as they load. The router, embeddings "
        "and LM head keep dtype; activations are not quantised (w8a16).",
        choices=("auto", "fp8", "none"),
    )


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(tp: Any) -> Any:
    """The scalar type behind ``X | None`` and ``list[X]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _is_list(tp: Any) -> bool:
    tp = _base_type(tp)
    return typing.get_origin(tp) is list


def _list_item(tp: Any) -> Any:
    return typing.get_args(_base_type(tp))[0]


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(tp: Any, text: str) -> Any:
    base = _base_type(tp)
    if _is_list(tp):
        item = _list_item(tp)
        return [_convert(item, part) for part in text.split(",") if part.strip()]
    if base is bool:
        return _parse_bool(text)
    if base in (int, float, str):
        return base(text)
    raise TypeError(f"unsupported setting type {tp!r}")


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def add_arguments(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add one flag per setting of ``cls``; the default shown is the environment twin's value if set."""
    group = parser.add_argument_group(title or cls.__name__)
    for f, tp in _fields(cls):
        env = env_name(f.name)
        help_text = f"{f.metadata['help']} [env {env}]".replace("%", "%%")  # argparse formats help with %
        base = _base_type(tp)
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if base is bool:
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            if f.metadata.get("negated_by"):
                group.add_argument(
                    flag_name(f.metadata["negated_by"]), dest=f.name, action="store_false",
                    default=argparse.SUPPRESS, help=f"the same as --no-{flag_name(f.name)[2:]} (vLLM's spelling)",
                )  # fmt: skip
        elif _is_list(tp):
            item = _list_item(tp)
            group.add_argument(
                flag_name(f.name), type=lambda s, item=item: _convert(item, s), nargs="+", **kwargs
            )
        else:
            group.add_argument(flag_name(f.name), type=lambda s, tp=tp: _convert(tp, s), **kwargs)


def check_choices(obj: Any) -> None:
    """Raise ``ValueError`` for a setting of ``obj`` whose value is not one of its ``choices``, naming the
    setting, its flag and its variable. Argparse checks flags and ``from_sources`` checks variables and
    overrides; a settings class calls this from ``__post_init__`` so that its constructor checks too."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices and value not in choices:
            raise ValueError(
                f"{f.name} ({flag_name(f.name)}, {env_name(f.name)}): {value!r} is not one of "
                f"{', '.join(map(str, choices))}"
            )


def from_sources(
    cls: type[T], args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **overrides: Any
) -> T:
    """Build ``cls``: explicit overrides, then flags, then ``PDMESH_*`` variables, then defaults. A value
    outside its setting's choices is a ``ValueError``, wherever it came from."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f, tp in _fields(cls):
        if f.name in overrides:
            continue
        if args is not None and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
        elif env_name(f.name) in env:
            try:
                values[f.name] = _convert(tp, env[env_name(f.name)])
            except ValueError as exc:
                raise ValueError(f"{env_name(f.name)}: {exc}") from exc
            choices = f.metadata.get("choices")
            if choices and values[f.name] not in choices:  # argparse checks flags; variables are checked here
                raise ValueError(
                    f"{env_name(f.name)}: {values[f.name]!r} is not one of {', '.join(map(str, choices))}"
                )
    values.update(overrides)
    obj = cls(**values)
    check_choices(obj)  # overrides, and classes whose constructor does not check
    return obj


def parse_service_settings(
    cls: type[T], title: str, prog: str, description: str, argv: list[str] | None = None
) -> T:
    """A service's settings: its flags (``--help``), then ``PDMESH_*`` variables, then defaults; a bad value
    exits with argparse's usage error."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls, title)
    args = parser.parse_args(argv)
    try:
        return from_sources(cls, args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def to_argv(obj: Any, only: Iterable[str] | None = None) -> list[str]:
    """Flags that reproduce ``obj`` (for a launcher handing settings to a child process)."""
    out: list[str] = []
    keep = set(only) if only is not None else None
    for f, tp in _fields(type(obj)):
        if keep is not None and f.name not in keep:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        if _base_type(tp) is bool:
            out.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif _is_list(tp):
            if value:
                out += [flag_name(f.name), *[str(v) for v in value]]
        else:
            out += [flag_name(f.name), str(value)]
    return out


def reference_markdown(sections: list[tuple[str, type]]) -> str:
    """The configuration reference: one table per settings class."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings classes by `python docs/gen_configuration.py`; do not edit by hand.",
        "",
    ]
    for title, cls in sections:
        lines += [
            f"## {title}",
            "",
            "| flag | environment | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for f, _tp in _fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            else:
                default = "(required)"
            choices = f.metadata.get("choices")
            meaning = f.metadata["help"] + (f" One of: {', '.join(map(str, choices))}." if choices else "")
            lines.append(f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)
