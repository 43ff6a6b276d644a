"""Sampling parameters of one request, with validation that names the bad field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_outputs import StructuredOutputs


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0 = only the sampled token's
    # Top-N logprobs at each prompt token from the second on, and that token's own with its rank; 0 = only
    # the prompt token's. The prompt is then computed whole: none of it comes from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    # engine/logits_processors.py: off at these values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many output tokens
    allowed_token_ids: list[int] | None = None  # sample only among these (None: every token)
    # Hold the output to a JSON schema, regex, choice or grammar (engine/structured_outputs.py); a dict
    # of StructuredOutputs' fields is taken too.
    structured_outputs: StructuredOutputs | None = None
    # Where the request queues under the priority scheduling policy (vLLM's priority: lower runs first;
    # EngineConfig.scheduling_policy). Not a sampling setting, but it travels with the request's settings
    # through the mesh (common.proto's SamplingParams) as they do.
    priority: int = 0
    # Words never to complete (vLLM's bad_words): the last token of each word's tokens is banned wherever
    # the output so far ends with the rest of them. The engine tokenizes them (``tokenize_bad_words``).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # set from bad_words by the engine

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether this request changes its logits before sampling (engine/logits_processors.py). Read for
        every row of every step: plain attribute tests, no calls."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.logit_bias)
            or bool(self.bad_words_token_ids)
        )

    @property
    def bad_words_need_history(self) -> bool:
        """Whether a bad word of several tokens needs the output so far to be checked."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    def tokenize_bad_words(self, encode: Any) -> None:
        """``bad_words_token_ids`` from ``bad_words`` by vLLM's rule: each word's tokens with its leading
        spaces stripped, and with one space before it where that starts it with another token of the same
        count (a word inside text, for tokenizers that fold the space into the word's first token).
        ``encode(text)``: token ids without special tokens. Done once; the same params give the same ids."""
        if self.bad_words_token_ids or not self.bad_words:
            return
        out: list[list[int]] = []
        for word in self.bad_words:
            bare = encode(word.lstrip())
            if not bare:
                raise InvalidRequestError(f"bad_words entry {word!r} has no tokens")
            out.append(bare)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        self.bad_words_token_ids = out

    @property
    def needs_host_step(self) -> bool:
        """Whether a step that samples this request must run synchronously: its logprobs are computed on
        the host, and its penalties (and bad words of several tokens) need its whole output so far, which a
        token still on the device (asynchronous scheduling) would leave short. (A grammar's mask needs every
        token so far too, but a lookahead step samples only after the tokens in flight are read: structured
        outputs run ahead.)"""
        return self.logprobs is not None or self.has_penalties or self.bad_words_need_history

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {self.priority!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must fit in 64 bits, got {self.seed}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise InvalidRequestError("bad_words must be an array of non-empty strings")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError(
                "allowed_token_ids must not be empty (leave it out to allow every token)"
            )
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        out_of_range = {t: b for t, b in self.logit_bias.items() if not -100.0 <= b <= 100.0}
        if out_of_range:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {out_of_range}")
        if vocab_size is not None:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})"
                )
            bad = [t for t in self.allowed_token_ids or [] if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
                )
            so = self.structured_outputs
            if so is not None and so.reasoning is not None and max(so.reasoning) >= vocab_size:
                raise InvalidRequestError(
                    f"structured_outputs reasoning tokens {list(so.reasoning)} are outside the vocabulary "
                    f"[0, {vocab_size})"
                )
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
                )
