"""A chat template given to the router in place of the model's (vLLM's ``--chat-template``)."""

from __future__ import annotations

from pathlib import Path

import jinja2


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template itself (vLLM's rule: a value that names a
    file is read; one that looks like a path but names none is an error), compiled once to check it."""
    path = Path(value)
    looks_like_text = any(c in value for c in "{}\n")
    try:
        is_file = not looks_like_text and path.is_file()
    except OSError:  # a name too long for the file system: the template itself
        is_file = False
    if is_file:
        template = path.read_text()
    elif looks_like_text:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None
    return template
