"""Tokenizers: the byte-level one of the built-in models, and ``tokenizer.json`` through ``tokenizers``.

Also the chat template (from ``tokenizer_config.json``, rendered with Jinja2 the way transformers does)
and an incremental detokenizer that never emits half a UTF-8 character.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.errors import UnsupportedModelError

PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_pair(self, text: str, pair: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is BOS, 257 EOS; ids above are unused vocabulary."""

    BOS = 256
    EOS = 257

    def __init__(self, vocab_size: int = 512) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = [self.EOS]
        self.bos_token_id = self.BOS
        self.chat_template = PLAIN_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one prompt (a cross-encoder's query and document): BOS, then both."""
        return [self.BOS, *text.encode("utf-8"), *pair.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """``tokenizer.json`` loaded with the ``tokenizers`` library, plus ``tokenizer_config.json`` settings."""

    def __init__(self, model_dir: Path, eos_token_ids: list[int], vocab_size: int) -> None:
        from tokenizers import Tokenizer as _Tok

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise UnsupportedModelError(f"{path} is missing: the checkpoint needs a tokenizer.json")
        self._tok = _Tok.from_file(str(path))
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
        self.chat_template = cfg.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if self.chat_template is None and template_file.exists():
            self.chat_template = template_file.read_text()
        self.vocab_size = vocab_size
        self.bos_token_id = self._token_id(cfg.get("bos_token"))
        self._add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        eos = list(eos_token_ids)
        cfg_eos = self._token_id(cfg.get("eos_token"))
        if not eos and cfg_eos is not None:
            eos = [cfg_eos]
        self.eos_token_ids = eos
        self.special_tokens = {
            "bos_token": self._token_text(cfg.get("bos_token")),
            "eos_token": self._token_text(cfg.get("eos_token")),
        }

    @staticmethod
    def _token_text(tok: Any) -> str | None:
        if isinstance(tok, dict):
            return tok.get("content")
        return tok

    def _token_id(self, tok: Any) -> int | None:
        text = self._token_text(tok)
        return self._tok.token_to_id(text) if text else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode does not, in tokenizers 0.23), so a long prompt
        # tokenized on a worker thread does not stall the router's event loop.
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one prompt, as transformers' ``tokenizer(text, text_pair)``: the tokenizer's pair
        template (a cross-encoder's query and document; vLLM's ``/score`` of a classifier)."""
        ids = self._tok.encode_batch([(text, pair)], add_special_tokens=True)[0].ids
        if self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text, without padding or truncation (what llguidance reads,
        engine/structured_outputs.py)."""
        tok = copy.copy(self._tok)
        tok.no_padding()
        tok.no_truncation()
        return tok.to_str()


@functools.lru_cache(maxsize=16)
def _compiled_chat_template(template: str) -> Any:
    """A chat template compiled once (in a sandbox, as transformers does): compiling takes ~1.7 ms, which
    every chat request paid when it was compiled per call."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the end of the message to continue


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """Render messages with the tokenizer's chat template (a plain one when the checkpoint has none).
    ``template_kwargs``: more template variables (``tools``, vLLM's ``chat_template_kwargs`` such as
    Qwen3's ``enable_thinking``). ``continue_final_message`` ends the text with the last message's text,
    left open for the model to go on with (transformers' rule: the template's text after it is cut).
    ``chat_template``: a template to use instead of the tokenizer's."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    final = ""
    if continue_final_message:  # transformers' rule: mark where the message ends, cut the text there
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs a last message with text to continue")
        messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    template = _compiled_chat_template(chat_template or tokenizer.chat_template or PLAIN_CHAT_TEMPLATE)
    extra = getattr(tokenizer, "special_tokens", {}) or {}
    text = template.render(
        **{k: v for k, v in extra.items() if v is not None},
        **template_kwargs,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
    )
    if not continue_final_message:
        return text
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message: the chat template does not write the last message's text")
    where = text.rindex(CONTINUE_TAG.strip())
    if text[where : where + len(CONTINUE_TAG)] == CONTINUE_TAG:  # the template kept the message's spacing
        return text[:where]
    return text[:where].rstrip()  # it trimmed the message: so is its end


def find_stop(text: str, stops: Sequence[str], checked: int) -> tuple[int, str] | None:
    """The first of ``stops`` (in request order) found in ``text``, as (index, stop string), where
    ``text[:checked]`` is known to hold none: only a match overlapping the rest can be new, so the search
    costs O(new text), not O(text). The engine and the router's text stream both stop by this rule."""
    for s in stops:
        idx = text.find(s, max(0, checked - len(s) + 1))
        if idx >= 0:
            return idx, s
    return None


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids; holds back an incomplete UTF-8 character.

    Each call decodes only a window: the tokens from ``prefix_offset`` (a few already-emitted tokens, so
    that merges and leading spaces come out as they do in a full decode) to the end, and returns what
    that window adds beyond its already-emitted part. The cost per token is O(window), not O(output):
    decoding the whole list every token made a long stream quadratic. ``flush`` decodes everything
    once and returns whatever the windows did not (in practice nothing).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this are in ``text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        emitted = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.ids[self._prefix_offset :])
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""  # nothing new yet (a skipped special token), or a character still incomplete
        delta = window[len(emitted) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
