"""One request's state inside the engine: tokens, KV blocks, progress and finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_outputs import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int = 0  # of token_id among the vocabulary by logprob, 1 = most likely; 0 = not computed


@dataclass(eq=False)  # identity: the scheduler's list removals must not compare every field
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Hold the prompt's KV blocks after finishing, for a decode worker to pull (prefill role).
    hold_kv: bool = False
    kv_imported: bool = False  # its prompt's KV came from another worker (decode role), not computed here
    root_hash: int | None = None  # block-hash chain root when the request has its own cache salt
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token computed so far, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of every full block of all_token_ids so far
    num_computed_tokens: int = 0
    cache_scan_upto: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache; -1 until first scheduled
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    output_text: str = ""  # kept only when stop strings must be checked
    arrival_time_ns: int = 0
    first_scheduled_ns: int = 0  # when the scheduler first gave it compute (queue time ends)
    first_token_ns: int = 0
    prompt_counted: bool = False  # prompt tokens added to the engine's totals
    grammar: GrammarMatcher | None = None  # with params.structured_outputs: where its output is in it
    lora_name: str | None = None  # the LoRA adapter it runs with (engine.lora)
    lora_slot: int = -1  # the adapter's device slot while it runs (-1: none, or not running)
    # An embedding request (engine.pooling): computes its prompt and returns its pooled hidden states instead
    # of sampling; ``pool_state`` is its pooling so far (mean: the running sum) while its prompt is chunked.
    pooling: PoolingParams | None = None
    pool_state: torch.Tensor | None = None
    _emitted: int = 0  # output tokens already reported to the caller

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, a: int, b: int) -> list[int]:
        """Tokens ``a`` to ``b`` of the prompt and output, by slices (``all_token_ids`` copies them all)."""
        n = len(self.prompt_token_ids)
        if b <= n:
            return self.prompt_token_ids[a:b]
        return self.prompt_token_ids[a:n] + self.output_token_ids[max(0, a - n) : b - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some of its prompt logprobs are still to compute: its prompt must then be computed, not
        taken from the prefix cache, and in a synchronous step (``ModelRunner.execute``)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
