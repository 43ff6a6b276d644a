"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular expression, a
list of choices or a grammar (vLLM's ``structured_outputs``, OpenAI's ``response_format``).

The grammars run on llguidance (vLLM's ``guidance`` backend): ``GrammarCompiler`` turns a
``StructuredOutputs`` into a matcher over the model's own tokens, compiling each distinct constraint once
(an LRU of compiled matchers, copied per request); a request's ``GrammarMatcher`` follows its tokens, and
before each token it samples, ``apply_grammar_masks`` sets the logit of every token its grammar does not
allow next to -inf. Once the grammar is complete only the end-of-sequence tokens are allowed, so a
constrained request stops on its own. The masks are computed on the host from the tokens the host has
read: before a synchronous step's forward is launched, or, in a lookahead step (asynchronous
scheduling), once the tokens in flight are read, while its forward runs; either way before sampling.

Compiling can take from a millisecond to a second for large schemas: serving code calls
``GrammarCompiler.compile`` off the engine's thread first (the engine then finds it in the cache), so
one request's compile does not stall the others' steps. This module owns no engine state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.device_copy import host_to_device
from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILED_CACHE_SIZE = 128  # distinct constraints kept compiled


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, as JSON text or an object), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (the output is one of these strings) or ``grammar`` (Lark, or llama.cpp's
    GBNF). ``disable_any_whitespace``: JSON without whitespace between tokens (vLLM's option; by default
    any JSON whitespace is allowed); ``whitespace_pattern``: a regex the whitespace between JSON tokens must
    match instead (vLLM's ``guided_whitespace_pattern``). Hashable: the compiled-grammar cache's key."""

    json: str | dict[str, Any] | None = None  # an object is kept as its canonical JSON text (sorted keys)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # (think-start token, think-end token) of a reasoning model: the constraint starts after its thinking
    # (``GrammarMatcher``), as vLLM's does with a reasoning parser. None: from the first token.
    reasoning: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            # One text per schema, whatever the key order it came in.
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.reasoning is not None:
            object.__setattr__(self, "reasoning", tuple(self.reasoning))

    @property
    def kind(self) -> str:
        """The one constraint set (``validate`` checks there is exactly one)."""
        return next(k for k in KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def validate(self) -> None:
        kinds = [k for k in KINDS if self._is_set(k)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of json, json_object, regex, choice or grammar"
                + (f"; got {', '.join(kinds)}" if kinds else "")
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError("structured_outputs choice must be a list of non-empty strings")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"structured_outputs {kind} must be a non-empty string")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("structured_outputs json must be a JSON schema (an object)")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise InvalidRequestError(
                "structured_outputs takes disable_any_whitespace or whitespace_pattern, not both"
            )
        if self.reasoning is not None and (
            len(self.reasoning) != 2 or self.reasoning[0] == self.reasoning[1] or min(self.reasoning) < 0
        ):
            raise InvalidRequestError(
                "structured_outputs reasoning must be two different token ids (think start, think end)"
            )

    def grammar_source(self) -> str:
        """The constraint as an llguidance grammar (its errors surface when a matcher compiles it)."""
        import llguidance

        options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        kind = self.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.json, overrides=options)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", list(self.choice or ()))
            return llguidance.grammar_from("grammar", self.grammar or "")
        except ValueError as exc:
            raise InvalidRequestError(f"structured_outputs {kind}: {exc}") from None


class GrammarMatcher:
    """One request's position in its grammar, and, for a reasoning model (``StructuredOutputs.reasoning``),
    whether it is still thinking. ``phase``:
    - "grammar": every token is held to the grammar;
    - "reasoning": inside a think block, nothing is held until the think-end token;
    - "opening": the output may open a think block: the first token is the grammar's or the think start.
    Where it starts follows the prompt (vLLM's rule: reasoning ends where the end token is): a prompt whose
    last think marker is a start (the template opened the block) starts in "reasoning"; one whose last is
    an end (thinking turned off: the template wrote an empty block) in "grammar"; one with neither in
    "opening"."""

    def __init__(
        self, matcher: Any, reasoning: tuple[int, int] | None = None, prompt: Sequence[int] = ()
    ) -> None:
        self._m = matcher
        self.phase = "grammar"
        self.think = reasoning
        if reasoning is not None:
            start, end = reasoning
            last = next((t for t in reversed(prompt) if t in (start, end)), None)
            self.phase = "opening" if last is None else "reasoning" if last == start else "grammar"

    def consume(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it (the matcher is then stuck)."""
        if self.phase == "reasoning":
            if token == self.think[1]:  # type: ignore[index]
                self.phase = "grammar"
            return True
        if self.phase == "opening":
            if token == self.think[0]:  # type: ignore[index]
                self.phase = "reasoning"
                return True
            self.phase = "grammar"
        return bool(self._m.consume_token(token))

    def allows(self, token: int) -> bool:
        if self.phase == "reasoning" or (self.phase == "opening" and token == self.think[0]):  # type: ignore[index]
            return True
        return self._m.validate_tokens([token]) == 1

    @property
    def is_stopped(self) -> bool:
        """Whether the grammar is complete and only end-of-sequence tokens may follow."""
        return self.phase == "grammar" and bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer and hands out matchers. Thread-safe: ``compile``
    runs on serving threads, ``matcher`` on the engine's."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()  # the cache and the executor: held for microseconds
        self._tok_lock = threading.Lock()  # the tokenizer's build, which takes ~1 s once
        self._lltok: Any = None  # built on first use: ~1 s for a 150k-token vocabulary
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._executor: Any = None

    def _ll_tokenizer(self) -> Any:
        with self._tok_lock:  # not the cache's lock: the engine thread's cache hits never wait on it
            if self._lltok is None:
                self._lltok = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._lltok

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled matcher for ``spec`` (cached); InvalidRequestError with llguidance's message when
        the schema, regex or grammar is not valid. A cached one is checked no more (every request's
        constraint is compiled, so found, at least twice: by its worker, then by the engine)."""
        if spec.reasoning is not None:
            spec = dataclasses.replace(spec, reasoning=None)  # the same grammar, thinking or not
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found
        spec.validate()
        try:
            import llguidance
        except ImportError:
            raise InvalidRequestError(
                "structured outputs need the llguidance package, which this worker lacks "
                "(pip install llguidance)"
            ) from None
        source = spec.grammar_source()
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs {spec.kind}: {matcher.get_error()}")
        with self._lock:
            self._compiled[spec] = matcher
            self._compiled.move_to_end(spec)
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputs, prompt: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (a copy of the compiled one), for a request
        with this prompt (where its thinking, if any, stands)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), spec.reasoning, prompt)

    def fill_masks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The next-token bitmasks of ``matchers`` (none "reasoning"), [n, ceil(vocab / 32)] int32 on the
        host (bit j of word w allows token 32 w + j), computed in parallel on the host's cores; an
        "opening" row's also allows its think-start token."""
        import llguidance

        words = (self.vocab_size + 31) // 32
        masks = torch.zeros((len(matchers), words), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)], masks.data_ptr(), words * 4, len(matchers)
        )
        for i, m in enumerate(matchers):
            if m.phase == "opening":
                start = m.think[0]  # type: ignore[index]
                word = masks[i, start // 32].item() | (1 << (start % 32))
                masks[i, start // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as int32
        return masks


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with -inf at every token the bitmask of each of ``rows`` leaves out (a new
    tensor); ``masks`` [len(rows), words] from ``GrammarCompiler.fill_masks``."""
    batch, vocab = logits.shape
    device = logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (host_to_device(masks, device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
    if len(rows) == batch:
        return logits.masked_fill(~allowed, float("-inf"))
    index = host_to_device(torch.tensor(list(rows), dtype=torch.int64), device)
    out = logits.clone()
    out.index_copy_(0, index, logits[index].masked_fill(~allowed, float("-inf")))
    return out


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    """llguidance's view of the model's tokenizer: each id's bytes, the end-of-sequence ids."""
    import llguidance

    from engine.tokenizer import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteTokens(vocab_size, eos)), n_vocab=vocab_size, eos_token=eos
        )
    raise InvalidRequestError(f"structured outputs do not support the tokenizer {type(tokenizer).__name__}")


class _ByteTokens:
    """The built-in byte tokenizer as llguidance's ``TokenizerWrapper`` reads one: token i < 256 is byte i;
    BOS, EOS and the unused ids above are special tokens no grammar text can produce."""

    def __init__(self, vocab_size: int, eos: list[int]) -> None:
        from engine.tokenizer import ByteTokenizer

        self.eos_token_id = eos[0] if eos else ByteTokenizer.EOS
        self.bos_token_id = ByteTokenizer.BOS
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"] + [b""] * (vocab_size - 258)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)
