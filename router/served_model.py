"""The model a router serves, and the checks every API applies before a request reaches a worker.

Holds the tokenizer and config (``engine.loader.load_tokenizer``: no weights) and the length limit. Turns
user sampling values into the worker's ``SamplingParams`` message after validating them with the
engine's own ``SamplingParams.validate``, so a bad value gets the same message from the router as from
the engine. HTTP and gRPC front ends both go through here; neither validates on its own.

Prompts are tokenized (and chats rendered) off the event loop, on a small thread pool
(``tokenize``, ``tokenize_chat``): a long prompt's tokenization must not hold up every other request. A
text shorter than ``INLINE_ENCODE_MAX_CHARS`` is encoded on the loop, where it costs less than the hop
to a thread (~0.2 ms on a 2-core CPU; a HF tokenizer encodes ~0.4 us per character). A thread frees the
loop only while the work in it lets go of the GIL: Python code (the chat template) does every few ms;
``tokenizers``' ``Tokenizer.encode`` (0.23) holds it to the end, its ``encode_batch`` does not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jinja2

from engine.errors import InvalidRequestError as EngineInvalidRequest
from engine.loader import generation_defaults, load_tokenizer
from engine.models.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs
from engine.tokenizer import Tokenizer, render_chat
from mesh.structured_outputs_proto import structured_outputs_from_proto, structured_outputs_to_proto
from protos.pdmesh.v1 import common_pb2
from router.chat_template import load_chat_template
from router.errors import InvalidRequestError, ModelNotFoundError
from router.reasoning import THINK_END, THINK_START
from router.text_stream import TextStream
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions and Generate

# Shorter texts are encoded on the event loop: cheaper than handing them to a thread (module docstring).
INLINE_ENCODE_MAX_CHARS = 512
# Tokenization mostly holds the GIL: more threads would not add throughput, only take turns from the loop.
TOKENIZE_THREADS = 2

# The penalties (engine/logits_processors.py) and their values that turn them off.
NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass
class SamplingInput:
    """Sampling values as a user gave them; None means "not given"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    penalties: dict[str, float] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0  # vLLM's: where the request queues on workers scheduling by priority
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never to complete


class ServedModel:
    def __init__(
        self,
        model: str,
        pool: WorkerPool | None,
        served_name: str | Sequence[str] | None = None,
        max_model_len: int | None = None,
        default_max_tokens_cap: int = 4096,
        tool_call_parser: str = "hermes",
        reasoning_parser: str = "none",
        chat_template: str | None = None,
        generation_config: str = "auto",
    ) -> None:
        tokenizer, config, name = load_tokenizer(model)
        # vLLM's --generation-config: the checkpoint's recommended sampling, for fields a request leaves out.
        self.default_sampling = generation_defaults(model, generation_config)
        if self.default_sampling:
            log.info("default sampling from the model's generation config: %s", self.default_sampling)
        if chat_template is not None:  # vLLM's --chat-template: the model's own is replaced
            tokenizer.chat_template = load_chat_template(chat_template)
        self.tool_call_parser = tool_call_parser  # router.tool_calls: how "auto" tool calls are read
        self.reasoning_parser = reasoning_parser  # router.reasoning: how chat replies' thinking is read
        # With a reasoning parser, chat constraints start after the thinking: its marker tokens.
        self.think_tokens = think_tokens(tokenizer) if reasoning_parser != "none" else None
        if reasoning_parser != "none" and self.think_tokens is None:
            log.warning(
                "the tokenizer has no single tokens for <think> and </think>: structured outputs will hold "
                "a chat reply's thinking too"
            )
        self.tokenizer: Tokenizer = tokenizer
        self.config: ModelConfig = config
        names = [served_name] if isinstance(served_name, str) else list(served_name or [])
        self.names = names or [name]  # every name the model answers to (vLLM's --served-model-name)
        self.name = self.names[0]
        self.pool = pool
        self._max_model_len = max_model_len
        self.default_max_tokens_cap = default_max_tokens_cap
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="router-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_model_len(self) -> int:
        """The flag if given, else the smallest the workers announce, else the model's own limit."""
        if self._max_model_len is not None:
            return self._max_model_len
        announced = self.pool.max_model_len() if self.pool is not None else None
        return announced or self.config.max_position_embeddings

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the workers serve (name -> PEFT directory), as they last said."""
        return self.pool.lora_adapters() if self.pool is not None else {}

    def check_model(self, requested: str | None, lora_name: str = "") -> str | None:
        """The LoRA adapter a request runs with (None: the base model). ``requested`` (the ``model``
        field) selects, as in vLLM: empty, absent or a name the base model is served under is the base
        model, a LoRA adapter's name is that adapter, anything else a 404 naming what is served.
        ``lora_name`` (gRPC's ``GenerateRequest.lora_name``) names an adapter beside a base ``model``."""
        if not lora_name and (not requested or requested in self.names):
            return None  # the common case: no adapter list to gather
        adapters = self.lora_adapters()
        adapter: str | None = None
        if requested and requested not in self.names:
            if requested not in adapters:
                served = ", ".join(f"`{n}`" for n in self.names)
                if adapters:
                    served += " and the LoRA adapters " + ", ".join(f"`{n}`" for n in adapters)
                raise ModelNotFoundError(
                    f"The model `{requested}` does not exist. This router serves {served}.", param="model"
                )
            adapter = requested
        if lora_name:
            if adapter is not None and adapter != lora_name:
                raise InvalidRequestError(
                    f"model names the LoRA adapter `{adapter}` and lora_name `{lora_name}`: name one",
                    param="lora_name",
                )
            if lora_name not in adapters:
                known = ", ".join(f"`{n}`" for n in adapters) or "none"
                raise ModelNotFoundError(
                    f"The LoRA adapter `{lora_name}` does not exist (served: {known}).", param="lora_name"
                )
            adapter = lora_name
        return adapter

    def reply_name(self, requested: str | None) -> str:
        """The model a reply names: the one asked for, if the model or one of its LoRA adapters is served
        under it (vLLM's rule)."""
        if requested and (requested in self.names or requested in self.lora_adapters()):
            return requested
        return self.name

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``, off the event loop unless the text is short."""
        if len(text) < INLINE_ENCODE_MAX_CHARS:
            return self.encode(text, add_special_tokens)
        return await self._off_loop(lambda: self.encode(text, add_special_tokens))

    async def tokenize_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one prompt by the tokenizer's pair template (a cross-encoder's query and document),
        off the event loop unless they are short."""
        if len(text) + len(pair) < INLINE_ENCODE_MAX_CHARS:
            return list(self.tokenizer.encode_pair(text, pair))
        return await self._off_loop(lambda: list(self.tokenizer.encode_pair(text, pair)))

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        add_special_tokens: bool,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """``render_chat`` on the loop (the template is compiled once: ~11 us a render, less than the ~0.2 ms
        hop to a thread), then ``tokenize``, which moves only a long text's encode off the loop."""
        text = self.render_chat(
            messages, add_generation_prompt, template_kwargs or {}, continue_final_message
        )
        return await self.tokenize(text, add_special_tokens)

    async def _off_loop(self, work: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The messages through the model's chat template; a template error is the user's (400)."""
        try:
            return render_chat(
                self.tokenizer,
                messages,
                add_generation_prompt,
                continue_final_message,
                **(template_kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from None
        except ValueError as exc:  # continue_final_message with nothing to continue
            raise InvalidRequestError(str(exc), param="continue_final_message") from None

    def text_stream(
        self,
        stop: Sequence[str],
        skip_special_tokens: bool,
        include_stop: bool,
        stop_token_ids: Sequence[int],
        ignore_eos: bool,
    ) -> TextStream:
        """A request's text as the engine makes it: stop strings cut, the stop token left out."""
        ends = set(stop_token_ids) | (set() if ignore_eos else set(self.config.eos_token_ids))
        return TextStream(self.tokenizer, stop, skip_special_tokens, include_stop, ends)

    def check_token_ids(self, token_ids: Sequence[int], what: str, param: str) -> None:
        """Every id inside the vocabulary, or a 400 naming the first offenders as ``what``."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", param=param
            )

    def check_prompt(self, prompt_token_ids: Sequence[int], param: str = "prompt") -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: it must have at least one token", param=param)
        self.check_token_ids(prompt_token_ids, "prompt token ids", param)
        n, limit = len(prompt_token_ids), self.max_model_len
        if n >= limit:
            raise InvalidRequestError(
                f"prompt has {n} tokens, max_model_len is {limit}: it must be shorter to leave room for at "
                "least one generated token",
                param=param,
            )

    def truncate_prompt(self, prompt_token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the longest prompt
        ``max_model_len`` takes, one token short of it); more than the context holds is a 400."""
        if keep is None:
            return prompt_token_ids
        limit = self.max_model_len - 1
        if keep == -1:
            keep = limit
        if keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({self.max_model_len}): ask "
                "for a smaller truncation size",
                param="truncate_prompt_tokens",
            )
        return prompt_token_ids[-keep:]

    def resolve_max_tokens(
        self, requested: int | None, prompt_len: int, default: int | None, param: str = "max_tokens"
    ) -> int:
        """The max_tokens to send: the user's (checked against the context), or the default clamped to it.

        ``default`` None means "the rest of the context, up to ``default_max_tokens_cap``" (chat).
        """
        room = self.max_model_len - prompt_len
        if requested is None:
            wanted = default if default is not None else self.default_max_tokens_cap
            return max(1, min(wanted, room))
        if requested < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {requested}", param=param)
        if requested > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
                param=param,
            )
        return requested

    def sampling_params(self, s: SamplingInput, max_tokens: int) -> common_pb2.SamplingParams:
        """Validate with the engine's rules and build the message workers take."""
        kwargs: dict[str, Any] = {
            **s.penalties,
            "logit_bias": dict(s.logit_bias),
            "min_tokens": s.min_tokens,
            "allowed_token_ids": s.allowed_token_ids,
            "include_stop_str_in_output": s.include_stop_str_in_output,
            "max_tokens": max_tokens,
            "stop": list(s.stop),
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "logprobs": s.logprobs,
            "prompt_logprobs": s.prompt_logprobs,
            "skip_special_tokens": s.skip_special_tokens,
            "seed": s.seed,
            "structured_outputs": s.structured_outputs,
            "priority": s.priority,
            "bad_words": list(s.bad_words),
        }
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(s, name)
            if value is None:
                value = self.default_sampling.get(name)
            if value is not None:
                kwargs[name] = value
        if "repetition_penalty" not in s.penalties and "repetition_penalty" in self.default_sampling:
            kwargs["repetition_penalty"] = self.default_sampling["repetition_penalty"]
        params = SamplingParams(**kwargs)
        try:
            params.validate(self.vocab_size)
        except EngineInvalidRequest as exc:
            raise InvalidRequestError(str(exc), param=_param_of(str(exc))) from None
        out = common_pb2.SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            stop=list(params.stop or []),
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            skip_special_tokens=params.skip_special_tokens,
        )
        if params.seed is not None:
            out.seed = params.seed % 2**64  # torch.Generator.manual_seed's rule for negative seeds
        for name, neutral in NEUTRAL_PENALTIES.items():
            if getattr(params, name) != neutral:
                setattr(out, name, getattr(params, name))
        out.logit_bias.update(params.logit_bias)
        out.min_tokens = params.min_tokens
        out.allowed_token_ids.extend(params.allowed_token_ids or [])
        out.include_stop_str_in_output = params.include_stop_str_in_output
        out.priority = params.priority
        out.bad_words.extend(params.bad_words)
        if params.logprobs is not None:
            out.logprobs = params.logprobs
        if params.prompt_logprobs is not None:
            out.prompt_logprobs = params.prompt_logprobs
        if params.structured_outputs is not None:
            out.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
        return out


def think_tokens(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` where each is one token (Qwen3's, DeepSeek-R1's), else None."""
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (THINK_START, THINK_END)]
    if all(len(i) == 1 for i in ids):
        return ids[0][0], ids[1][0]
    return None


def _param_of(message: str) -> str | None:
    """The field an engine validation message names (it starts with the field's name)."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


def sampling_input_from_proto(p: common_pb2.SamplingParams) -> SamplingInput:
    """What a gRPC caller set, unset optional fields left as "not given"."""
    s = SamplingInput(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        temperature=p.temperature if p.HasField("temperature") else None,
        top_p=p.top_p if p.HasField("top_p") else None,
        top_k=p.top_k or None,
        min_p=p.min_p or None,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
    )
    for name in NEUTRAL_PENALTIES:
        if p.HasField(name):
            s.penalties[name] = getattr(p, name)
    s.logit_bias = dict(p.logit_bias)
    s.min_tokens = p.min_tokens
    s.allowed_token_ids = list(p.allowed_token_ids) or None
    s.include_stop_str_in_output = p.include_stop_str_in_output
    s.prompt_logprobs = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    s.priority = p.priority
    s.bad_words = list(p.bad_words)
    if p.HasField("structured_outputs"):
        try:
            s.structured_outputs = structured_outputs_from_proto(p.structured_outputs)
        except EngineInvalidRequest as exc:
            raise InvalidRequestError(str(exc), param="structured_outputs") from None
        if s.structured_outputs is None:
            raise InvalidRequestError(
                "structured_outputs is set but names no constraint (json_schema, json_object, regex, "
                "choice or grammar)",
                param="structured_outputs",
            )
    return s
