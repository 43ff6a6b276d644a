"""Offline generation: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.data_parallel import Lockstep
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.loader import generation_defaults
from engine.lora import LoRARequest
from engine.moe.dispatch import TokenDispatcher
from engine.pooling import PoolingParams, cosine, score_pairs, top_label
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.tokenizer import render_chat


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``)."""

    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities by label id (``LLM.classify``; the raw logits without activation)."""

    prompt_token_ids: list[int]
    probs: list[float]
    label: str  # the most probable label's name
    num_cached_tokens: int = 0


@dataclass
class ScoringOutput:
    """One text pair's relevance (``LLM.score``): a cross-encoder's sigmoid, else the embeddings' cosine."""

    prompt_token_ids: list[int]  # the pair's (a cross-encoder), else the second text's
    score: float


class LLM:
    """Offline engine. Keyword arguments are ``EngineConfig`` fields (model, device, dtype, block_size, ...).

    With several expert-parallel ranks (``expert_parallel_size`` and ``expert_parallel_rank``, one process
    each; or a ``dispatcher`` over a group the caller set up), each rank's ``LLM`` holds its share of the
    experts and generates its own prompts; every rank must call ``generate`` together, and each call
    returns once every rank's prompts are done (``engine.data_parallel.Lockstep``)."""

    def __init__(
        self, model: str = "tiny-dense", *, dispatcher: TokenDispatcher | None = None, **kwargs: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), dispatcher=dispatcher)
        self.tokenizer = self.engine.tokenizer
        self._lockstep = Lockstep.for_engine(self.engine)
        self._generation_defaults = generation_defaults(model, "auto")  # read once

    def close(self) -> None:
        """``LLMEngine.close``: the engine's graphs, and its expert-parallel group if it joined one."""
        self.engine.close()

    def _step(self) -> list[RequestOutput] | None:
        """One engine step (None: with several ranks, no rank has work left)."""
        if self._lockstep is not None:
            return self._lockstep.step()
        return self.engine.step()

    def _token_prompts(self, prompts: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        """One prompt (text or token ids) or several, as token ids."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's recommended sampling (its generation_config.json, where it samples),
        else SamplingParams' own defaults; what ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self._generation_defaults)

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """``priority`` (vLLM's): each prompt's, under the priority scheduling policy. ``lora_request``
        (vLLM's): the LoRA adapter all prompts run with, or one per prompt (None: the base model); an
        adapter not yet registered under its name is loaded from its path first."""
        token_prompts = self._token_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_prompts)
        )
        if len(params) != len(token_prompts):
            raise ValueError(f"{len(params)} sampling params for {len(token_prompts)} prompts")
        if priority is not None:
            if len(priority) != len(token_prompts):
                raise ValueError(f"{len(priority)} priorities for {len(token_prompts)} prompts")
            params = [dataclasses.replace(p, priority=v) for p, v in zip(params, priority, strict=True)]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(token_prompts)
        if len(loras) != len(token_prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(token_prompts)} prompts")
        for lora in {lr for lr in loras if lr is not None}:
            if lora.lora_name not in self.engine.list_loras():
                self.engine.add_lora(lora.lora_name, lora.lora_path)
        ids = [f"offline-{uuid.uuid4().hex}" for _ in token_prompts]

        def add(rid: str, i: int) -> None:
            lora = loras[i]
            self.engine.add_request(
                rid, token_prompts[i], params[i], lora_name=lora.lora_name if lora else None
            )

        results = []
        for prompt, outs in zip(token_prompts, self._run(ids, add).values(), strict=True):
            last = outs[-1]
            found = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
            results.append(
                CompletionOutput(
                    prompt_token_ids=prompt,
                    token_ids=[t for o in outs for t in o.new_token_ids],
                    text=last.text or "",
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    logprobs=[lp for o in outs for lp in o.new_logprobs],
                    num_cached_tokens=last.num_cached_tokens,
                    prompt_logprobs=found[-1] if found else None,
                )
            )
        return results

    def _run(self, ids: list[str], add: Callable[[str, int], None]) -> dict[str, list[RequestOutput]]:
        """Add request ``ids[i]`` with ``add(ids[i], i)`` for each, step until every one has finished (with
        several ranks, until no rank has work left) and return each one's outputs in order, by id in the
        order of ``ids``. Anything raised aborts the requests already added."""
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        added: list[str] = []
        finished = 0
        try:
            for i, rid in enumerate(ids):
                add(rid, i)
                added.append(rid)
            while finished < len(ids) or self._lockstep is not None:
                outs = self._step()
                if outs is None:  # every rank is done
                    break
                for out in outs:
                    outputs[out.request_id].append(out)
                    finished += out.finished
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            self.engine.step()
            raise
        return outputs

    def embed(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        pooling_params: PoolingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingOutput]:
        """vLLM's ``LLM.embed``: each prompt's pooled last hidden states (``engine.pooling``; the model's
        pooling and normalisation unless ``pooling_params`` says otherwise), in prompt order."""
        token_prompts = self._token_prompts(prompts)
        if lora_request is not None and lora_request.lora_name not in self.engine.list_loras():
            self.engine.add_lora(lora_request.lora_name, lora_request.lora_path)
        ids = [f"embed-{uuid.uuid4().hex}" for _ in token_prompts]
        lora_name = lora_request.lora_name if lora_request else None
        pooling = pooling_params or PoolingParams()

        def add(rid: str, i: int) -> None:
            self.engine.add_request(
                rid, token_prompts[i], SamplingParams(), lora_name=lora_name, pooling=pooling
            )

        results = []
        for prompt, outs in zip(token_prompts, self._run(ids, add).values(), strict=True):
            last = outs[-1]
            if last.embedding is None:
                raise RuntimeError(f"an embedding request ended without an embedding ({last.finish_reason})")
            results.append(EmbeddingOutput(prompt, last.embedding, last.num_cached_tokens))
        return results

    def classify(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        *,
        activation: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ClassificationOutput]:
        """vLLM's ``LLM.classify``: a sequence classifier's (``*ForSequenceClassification``) probabilities
        for each prompt, in prompt order (softmax over the labels, a sigmoid for one; ``activation=False``:
        the logits)."""
        labels = self.engine.model_config.labels
        params = PoolingParams(task="classify", activation=activation)
        return [
            ClassificationOutput(
                o.prompt_token_ids, o.embedding, top_label(labels, o.embedding), o.num_cached_tokens
            )
            for o in self.embed(prompts, params, lora_request=lora_request)
        ]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringOutput]:
        """vLLM's ``LLM.score``: the relevance of each ``data_2`` text to ``data_1`` (one text against each,
        or pairwise when both are lists of one length). A cross-encoder (a classifier of one label) reads
        each pair as one prompt (the tokenizer's pair template) and gives its sigmoid; an embedding model
        gives the cosine of the two embeddings."""
        firsts, seconds = score_pairs(data_1, data_2)
        if self.engine.model_config.num_labels == 1:
            pairs = [self.tokenizer.encode_pair(a, b) for a, b in zip(firsts, seconds, strict=True)]
            outs = self.classify(pairs, lora_request=lora_request)  # type: ignore[arg-type]
            return [ScoringOutput(o.prompt_token_ids, o.probs[0]) for o in outs]
        if self.engine.model_config.num_labels:
            raise InvalidRequestError(
                f"score needs a cross-encoder (a classifier of one label) or an embedding model; this "
                f"classifier has {self.engine.model_config.num_labels} labels"
            )
        unique = list(dict.fromkeys([*firsts, *seconds]))
        vectors = dict(zip(unique, self.embed(unique, lora_request=lora_request), strict=True))
        return [
            ScoringOutput(vectors[b].prompt_token_ids, cosine(vectors[a].embedding, vectors[b].embedding))
            for a, b in zip(firsts, seconds, strict=True)
        ]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{role, content}`` messages) or several,
        rendered with the model's chat template (or ``chat_template``), tokenized without special tokens as
        the router does, then ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                render_chat(
                    self.tokenizer,
                    list(conversation),  # type: ignore[arg-type]
                    add_generation_prompt,
                    continue_final_message,
                    chat_template,
                    **({"tools": tools} if tools else {}),
                    **(chat_template_kwargs or {}),
                ),
                add_special_tokens=False,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix block no request holds (``LLMEngine.reset_prefix_cache``); returns how
        many blocks were evicted."""
        return self.engine.reset_prefix_cache()
