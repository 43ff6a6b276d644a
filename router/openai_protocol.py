"""The OpenAI-compatible request and response shapes: parsing JSON bodies, building JSON replies.

Parsing checks types and names the offending field (``param``) in every error; value checks on sampling
fields happen later, in ``router.served_model`` (the engine's rules). Response builders produce the shapes
the ``openai`` client and vLLM users expect: ``text_completion`` / ``chat.completion`` objects, their
``.chunk`` streaming variants, usage with ``prompt_tokens_details.cached_tokens``, and logprobs in the
completions (``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``) and chat (``content``) forms.
No I/O here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from protos.pdmesh.v1 import common_pb2
from router.errors import InvalidRequestError
from router.output_constraints import parse_output_constraint
from router.served_model import NEUTRAL_PENALTIES, SamplingInput
from router.text_stream import token_text
from router.tool_calls import ToolRequest, parse_tools

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 20
MAX_N = 128  # choices per prompt, OpenAI's limit
MAX_CHOICES = 2048  # prompts x n in one request: each choice is a request of its own on the workers


@dataclass
class ParsedRequest:
    """A completions or chat request after type checks, before tokenization and value checks."""

    kind: str  # "completions" | "chat_completions"
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: each a text or token ids
    messages: list[dict[str, Any]] = field(default_factory=list)
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: each choice's text starts with its prompt; chat: see parse_chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message is left open for the model to go on
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as fit)
    truncate_prompt_tokens: int | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens token_id:<id>
    add_special_tokens: bool = True
    sampling: SamplingInput = field(default_factory=SamplingInput)
    # vLLM's prompt_logprobs: the reply shows each prompt token's logprob, rank and this many top
    # alternatives (completions: in each choice; chat: beside the choices). The workers compute
    # ``sampling.prompt_logprobs``, which echo with logprobs may raise.
    prompt_logprobs: int | None = None
    # Chat: the template's further variables (tools, chat_template_kwargs) and how tool calls are read.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolRequest | None = None
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (with a reasoning parser)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries usage so far
    session_id: str | None = None
    user: str | None = None
    request_id: str | None = None
    cache_salt: str = ""


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class JsonFields:
    """Typed access to a JSON object's fields; every error names the field."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body

    def _bad(self, name: str, want: str) -> InvalidRequestError:
        return InvalidRequestError(f"'{name}' must be {want}, got {_json_type(self.body[name])}", param=name)

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def str(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._bad(name, "a string")
        return value

    def bool(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, "a boolean")
        return value

    def int(self, name: str) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, "an integer")
        if isinstance(value, float) and not value.is_integer():
            raise self._bad(name, "an integer")
        return int(value)

    def number(self, name: str) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(name, "a finite number")
        return float(value)

    def str_list(self, name: str) -> list[str]:
        value = self.body.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(name, "a string or an array of strings")
        return list(value)

    def int_list(self, name: str) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise self._bad(name, "an array of integers")
        return [int(v) for v in value]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unsupported(f: JsonFields) -> None:
    best_of = f.int("best_of")
    if best_of is not None and best_of != 1:
        raise InvalidRequestError(
            f"best_of must be 1 (ask for n choices instead), got {best_of}", param="best_of"
        )
    if f.present("suffix"):
        raise InvalidRequestError("suffix is not supported", param="suffix")


def _sampling(f: JsonFields, logprobs: int | None) -> SamplingInput:
    s = SamplingInput(
        temperature=f.number("temperature"),
        top_p=f.number("top_p"),
        top_k=f.int("top_k"),
        min_p=f.number("min_p"),
        seed=f.int("seed"),
        stop=f.str_list("stop"),
        stop_token_ids=f.int_list("stop_token_ids"),
        ignore_eos=f.bool("ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=f.bool("skip_special_tokens", True),
    )
    for name in NEUTRAL_PENALTIES:
        value = f.number(name)
        if value is not None:
            s.penalties[name] = value
    s.logit_bias = _logit_bias(f)
    s.min_tokens = f.int("min_tokens") or 0
    s.include_stop_str_in_output = f.bool("include_stop_str_in_output", False)
    if f.present("allowed_token_ids"):
        s.allowed_token_ids = f.int_list("allowed_token_ids")
    s.structured_outputs = parse_output_constraint(f.body)
    s.priority = f.int("priority") or 0
    s.bad_words = f.str_list("bad_words")
    return s


def _logit_bias(f: JsonFields) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object from token ids (as strings, or JSON numbers) to numbers."""
    value = f.body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise f._bad("logit_bias", "an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else key
        if not (isinstance(token, int) or (isinstance(token, str) and token.lstrip("-").isdigit())):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidRequestError(
                f"logit_bias[{key!r}] must be a finite number, got {_json_type(bias)}", param="logit_bias"
            )
        out[int(token)] = float(bias)
    return out


def _common(f: JsonFields, kind: str, headers: Mapping[str, str]) -> ParsedRequest:
    _reject_unsupported(f)
    stream = f.bool("stream", False)
    include_usage = continuous_usage = False
    options = f.body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        include_usage = JsonFields(options).bool("include_usage", False)
        # vLLM's extra: usage so far in every chunk too (with include_usage, as vLLM asks)
        continuous_usage = include_usage and JsonFields(options).bool("continuous_usage_stats", False)
    session = f.str("session_id") or headers.get("X-Session-ID") or headers.get("x-session-id")
    n = f.int("n")
    if n is not None and not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    truncate = f.int("truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be at least 1, or -1 (as many as max_model_len allows), got {truncate}",
            param="truncate_prompt_tokens",
        )
    return ParsedRequest(
        kind=kind,
        model=f.str("model"),
        n=n or 1,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        session_id=session or None,
        user=f.str("user"),
        request_id=f.str("request_id"),
        cache_salt=f.str("cache_salt") or "",
        truncate_prompt_tokens=truncate,
        tokens_as_ids=f.bool("return_tokens_as_token_ids", False),
    )


def parse_completion(body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> ParsedRequest:
    f = JsonFields(body)
    if f.body.get("tools"):
        raise InvalidRequestError("tools are a chat completions field", param="tools")
    req = _common(f, "completions", headers or {})
    req.prompts = _prompts(body.get("prompt"))
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise InvalidRequestError(
            f"{len(req.prompts)} prompts x n={req.n} is {len(req.prompts) * req.n} choices; at most "
            f"{MAX_CHOICES} a request",
            param="prompt",
        )
    req.add_special_tokens = f.bool("add_special_tokens", True)
    logprobs = f.int("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs"
        )
    req.echo = f.bool("echo", False)
    req.sampling = _sampling(f, logprobs)
    req.sampling.max_tokens = f.int("max_tokens")
    _prompt_logprobs(f, req)
    if req.echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        req.sampling.prompt_logprobs = max(logprobs, req.sampling.prompt_logprobs or 0)
    return req


def _prompt_logprobs(f: JsonFields, req: ParsedRequest) -> None:
    """vLLM's ``prompt_logprobs`` extra (an int; its range is the engine's check), refused when streaming
    as vLLM refuses it."""
    req.prompt_logprobs = req.sampling.prompt_logprobs = f.int("prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequestError(
            "prompt_logprobs is not available when stream is true", param="prompt_logprobs"
        )


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The completions ``prompt`` field as a list of prompts: a string, an array of token ids, or an
    array of either (a batch)."""
    if prompt is None:
        raise InvalidRequestError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return [list(prompt)]  # [] too: the length check names an empty prompt
    if isinstance(prompt, list) and prompt:
        batch: list[str | list[int]] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                batch.append(p)
            elif isinstance(p, list) and all(_is_int(t) for t in p):
                batch.append(list(p))
            else:
                raise InvalidRequestError(
                    f"prompt[{i}] must be a string or an array of token ids", param="prompt"
                )
        return batch
    raise InvalidRequestError(
        "'prompt' must be a string, an array of token ids, or an array of either", param="prompt"
    )


def parse_chat(
    body: Mapping[str, Any], headers: Mapping[str, str] | None = None, tool_call_parser: str = "hermes"
) -> ParsedRequest:
    f = JsonFields(body)
    req = _common(f, "chat_completions", headers or {})
    # vLLM's chat echo: a reply to a last message of the assistant's starts with that message's text.
    req.echo = f.bool("echo", False)
    req.messages = _messages(body.get("messages"))
    req.add_generation_prompt = f.bool("add_generation_prompt", True)
    req.continue_final_message = f.bool("continue_final_message", False)
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
            "to false to continue the last message",
            param="continue_final_message",
        )
    # Chat templates carry their own BOS; vLLM adds no special tokens to a rendered chat by default.
    req.add_special_tokens = f.bool("add_special_tokens", False)
    top = f.int("top_logprobs")
    logprobs: int | None = None
    if f.bool("logprobs", False):
        logprobs = top or 0
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="top_logprobs"
            )
    elif top:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    req.sampling = _sampling(f, logprobs)
    _tools_and_template(f, req, tool_call_parser)
    req.include_reasoning = f.bool("include_reasoning", True)
    max_completion = f.int("max_completion_tokens")
    req.sampling.max_tokens = max_completion if max_completion is not None else f.int("max_tokens")
    _prompt_logprobs(f, req)
    return req


def _tools_and_template(f: JsonFields, req: ParsedRequest, tool_call_parser: str) -> None:
    kwargs = f.body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise f._bad("chat_template_kwargs", "an object")
        reserved = sorted(
            set(kwargs) & {"messages", "add_generation_prompt", "tools", "continue_final_message"}
        )
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {reserved} (they have fields of their own)",
                param="chat_template_kwargs",
            )
        req.template_kwargs.update(kwargs)
    req.tools = parse_tools(dict(f.body), tool_call_parser)
    if req.tools is None:
        return
    req.template_kwargs["tools"] = req.tools.tools
    constraint = req.tools.constraint()
    if constraint is not None:
        if req.sampling.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice required or a named function constrains the output itself; drop the other "
                "output constraint (response_format, structured_outputs, guided_*)",
                param="tool_choice",
            )
        req.sampling.structured_outputs = constraint


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequestError("'messages' is required", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'messages' must be a non-empty array of message objects", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"{where}.role"
            )
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise InvalidRequestError(
                        f'{where}.content[{j}]: only text parts ({{"type": "text", "text": ...}}) are '
                        "supported",
                        param=f"{where}.content",
                    )
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise InvalidRequestError(
                f"{where}.content must be a string or an array of text parts", param=f"{where}.content"
            )
        msg = {k: v for k, v in m.items() if k != "content"}
        msg["content"] = text
        out.append(msg)
    return out


# ---- responses ------------------------------------------------------------------------------------


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


class CompletionLogprobs:
    """Accumulates the completions-API logprobs object (or the chunk of it for one stream message)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: tokens written token_id:<id>
        self.offset = 0

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else token_text(self.tokenizer, token_id)

    def part(self, entries: Sequence[common_pb2.Logprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(self._name(e.token_id))
            token_logprobs.append(e.logprob)
            top.append({self._name(t.token_id): t.logprob for t in e.top_logprobs})
            offsets.append(self.offset)  # into the text, whatever the tokens are called
            self.offset += len(token_text(self.tokenizer, e.token_id))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def prompt_part(
        self, prompt_token_ids: Sequence[int], entries: Sequence[common_pb2.Logprobs], top_n: int
    ) -> dict[str, Any]:
        """The echoed prompt's tokens (``entries``: from the second on): the first has no logprob (null,
        as OpenAI's echo gives it), the others their ``top_n`` best alternatives."""
        part = {
            "tokens": [self._name(prompt_token_ids[0])],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [self.offset],
        }
        self.offset += len(token_text(self.tokenizer, prompt_token_ids[0]))
        rest = self.part([_top(e, top_n) for e in entries])
        for key, values in rest.items():
            part[key].extend(values)
        return part

    @staticmethod
    def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for p in parts:
            for k in out:
                out[k].extend(p[k])
        return out


def _top(entry: common_pb2.Logprobs, n: int) -> common_pb2.Logprobs:
    """``entry`` with its first ``n`` alternatives only (the workers computed as many as any use asked)."""
    if len(entry.top_logprobs) <= n:
        return entry
    return common_pb2.Logprobs(
        token_id=entry.token_id, logprob=entry.logprob, top_logprobs=entry.top_logprobs[:n]
    )


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, entries: Sequence[common_pb2.Logprobs], top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token an object from token
    ids to ``{logprob, rank, decoded_token}``: the prompt token's own and its ``top_n`` best alternatives
    (ranks 1..top_n)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in entries:
        found = {
            str(e.token_id): {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": token_text(tokenizer, e.token_id),
            }
        }
        for rank, a in enumerate(e.top_logprobs[:top_n], start=1):
            found.setdefault(
                str(a.token_id),
                {"logprob": a.logprob, "rank": rank, "decoded_token": token_text(tokenizer, a.token_id)},
            )
        out.append(found)
    return out


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[common_pb2.Logprobs], as_ids: bool = False
) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content`` entries (``as_ids``: vLLM's return_tokens_as_token_ids, each
    token named ``token_id:<id>``; its ``bytes`` stay its text's)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        name = f"token_id:{token_id}" if as_ids else text
        return {"token": name, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {
            **entry(e.token_id, e.logprob),
            "top_logprobs": [entry(a.token_id, a.logprob) for a in e.top_logprobs],
        }
        for e in entries
    ]
