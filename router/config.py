"""The router's settings, declared once (``mesh.config``): flags, ``PDMESH_*`` twins and docs follow.

Only settings live here; ``router.__main__`` turns them into a running service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mesh.config import check_choices, setting
from router.chat_template import load_chat_template
from router.reasoning import REASONING_PARSERS
from router.scoring import ROUTING_MODES, RoutingWeights
from router.scoring.weighted_picker import (
    DEFAULT_HOTSPOT_MARGIN_TOKENS,
    DEFAULT_KV_HEADROOM_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
)
from router.tool_calls import TOOL_CALL_PARSERS

# vLLM's switch of its runtime LoRA endpoints, read as vLLM reads it ("1" or "true", any case).
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass
class RouterConfig:
    model: str = setting(
        "tiny-dense",
        "Model the mesh serves: a built-in model name or a checkpoint directory (the router loads only its "
        "tokenizer and config).",
    )
    served_model_name: list[str] = setting(
        [],
        "Names clients use for the model (the `model` field; vLLM's --served-model-name): each is accepted, "
        "replies name the one asked for, the first is the default; default: the model's own name.",
    )
    chat_template: str | None = setting(
        None,
        "Chat template to render chat requests with instead of the model's (vLLM's --chat-template): a file "
        "path, or the Jinja template itself.",
    )
    generation_config: str = setting(
        "auto",
        "Default sampling for fields a request leaves out (vLLM's --generation-config): auto takes the "
        "checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, as "
        "the model's authors recommend), vllm takes none (OpenAI's defaults), or a directory holding one.",
    )
    host: str = setting("127.0.0.1", "Address the gRPC and HTTP servers bind to.")
    port: int = setting(50050, "Port of the public gRPC API (pdmesh.v1.Router); 0 picks a free one.")
    http_port: int = setting(8000, "Port of the OpenAI-compatible HTTP API; 0 picks a free one.")
    prefill_workers: list[str] = setting([], "gRPC addresses (host:port) of the prefill workers.")
    decode_workers: list[str] = setting([], "gRPC addresses (host:port) of the decode workers.")
    routing: str = setting(
        "prefix",
        "How workers are chosen: prefix (cached prefix and load, see docs/routing.md), or the baselines "
        "round_robin and random (no KV index, always disaggregate).",
        choices=ROUTING_MODES,
    )
    redis_url: str | None = setting(
        None,
        "Redis URL of the registry and KV index: registered workers join the pool and prefixes are looked "
        "up in Redis. None: the flag workers only, with an in-process index fed by their StreamKVEvents.",
    )
    discovery_interval_s: float = setting(
        0.5, "How often the registry is read (with --redis-url), in seconds."
    )
    registry_grace_s: float = setting(
        5.0,
        "How long a registered worker that answers and is not draining may be missing from the registry "
        "before the router forgets it (a restarted Redis is empty until heartbeats register again).",
    )
    index_timeout_s: float = setting(
        0.25, "Deadline of one KV index lookup in Redis; past it the request is routed by load alone."
    )
    prefix_weight: float = setting(
        DEFAULT_PREFIX_WEIGHT, "Weight of the prefix scorer for prefill workers (--routing prefix)."
    )
    load_weight: float = setting(
        DEFAULT_LOAD_WEIGHT, "Weight of the load scorer for prefill and decode workers."
    )
    kv_headroom_weight: float = setting(
        DEFAULT_KV_HEADROOM_WEIGHT, "Weight of the KV headroom scorer for decode workers."
    )
    hotspot_margin_tokens: int = setting(
        DEFAULT_HOTSPOT_MARGIN_TOKENS,
        "Hot-spot guard: a cached prefix does not win on a worker whose queued + running tokens exceed the "
        "least-loaded worker's by more than this; -1 turns the guard off.",
    )
    pd_threshold_tokens: int = setting(
        256,
        "The decode worker prefills a request itself when fewer prompt tokens than this are missing from "
        "its cache (--routing prefix); 0 always sends the prompt through a prefill worker.",
    )
    routing_seed: int | None = setting(
        None, "Seed of the tie-breaking and random choices (tests, benchmarks)."
    )
    otlp_endpoint: str | None = setting(None, "OTLP/gRPC endpoint traces are exported to (http://host:4317).")
    trace_file: str | None = setting(None, "Append finished spans as JSON lines to this file (tests).")
    block_size: int = setting(16, "KV block size of the mesh; workers announcing another one are not used.")
    max_model_len: int | None = setting(
        None, "Longest prompt plus output, in tokens; default: the smallest the workers announce."
    )
    default_max_tokens_cap: int = setting(
        4096,
        "Most tokens a chat completion generates when the request sets no max_tokens "
        "(otherwise up to max_model_len - prompt tokens).",
    )
    request_timeout_s: float = setting(600.0, "Deadline of one request's worker calls, in seconds.")
    control_timeout_s: float = setting(
        5.0, "Deadline of short worker calls (GetStats, Abort, ReleaseKV) and of connecting, in seconds."
    )
    stats_interval_s: float = setting(2.0, "How often each worker's GetStats is polled, in seconds.")
    max_decode_attempts: int = setting(
        3,
        "Decode workers tried for one request before giving up (a retry happens only before any token "
        "reached the client).",
    )
    tool_call_parser: str = setting(
        "hermes",
        'How chat replies are read for tool calls when tool_choice is "auto" (docs/api.md): hermes '
        "(<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes), qwen3_coder (<tool_call> blocks of "
        "<function=...> and <parameter=...> tags: Qwen3-Coder), llama3_json (a reply of JSON calls: Llama "
        "3.1-3.3), pythonic (a reply that is a Python list of calls: Llama 3.2 and 4), or none "
        '("auto" is then a 400).',
        choices=TOOL_CALL_PARSERS,
    )
    enable_auto_tool_choice: bool = setting(
        True,
        'vLLM\'s --enable-auto-tool-choice, for command lines written for vLLM: off, tool_choice "auto" is a 400 '
        "whatever --tool-call-parser says (on by default here: the parser alone decides).",
    )
    reasoning_parser: str = setting(
        "none",
        "How chat replies' thinking is split from their content (docs/api.md): qwen3 or deepseek_r1 put "
        "the text inside <think>...</think> in reasoning_content; none leaves it in content.",
        choices=REASONING_PARSERS,
    )
    api_key: list[str] = setting(
        [],
        "API keys of the public APIs (vLLM's --api-key): with any set, HTTP requests under /v1 and gRPC "
        "calls of pdmesh.v1.Router must carry 'Authorization: Bearer <key>' (401 / UNAUTHENTICATED "
        "otherwise; /invocations too); /health, /ping, /metrics, /version, /tokenize, /detokenize and gRPC "
        "health stay open. "
        "Several keys: --api-key K1 K2 (PDMESH_API_KEY: K1,K2).",
    )
    allowed_origins: list[str] = setting(
        ["*"],
        "Origins a browser may call the HTTP API from (CORS; vLLM's --allowed-origins): * for any, or "
        "exact origins (https://app.example.com).",
    )
    allowed_methods: list[str] = setting(["*"], "HTTP methods allowed from other origins (CORS).")
    allowed_headers: list[str] = setting(["*"], "Request headers allowed from other origins (CORS).")
    allow_credentials: bool = setting(
        False, "Let browsers send credentials (cookies, Authorization) cross-origin (CORS)."
    )
    store_responses: bool = setting(
        True,
        "Keep finished Responses API responses (unless a request sets store: false) for previous_response_id "
        "and GET / DELETE /v1/responses/{id}: in Redis with --redis-url (every router sees them), else in "
        "this process.",
    )
    responses_ttl_s: float = setting(86400.0, "How long a stored response is kept, in seconds.")
    responses_max_stored: int = setting(
        1000, "Most responses a router without Redis keeps (the oldest go first)."
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and unload a LoRA adapter "
        "on every worker (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, which is honoured too); off, they are "
        "404s. The workers need --enable-lora.",
    )
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        check_choices(self)  # routing, log_level: whether they came from flags, variables or a caller
        if self.request_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("request_timeout_s and control_timeout_s must be positive")
        if self.max_decode_attempts < 1:
            raise ValueError(f"max_decode_attempts must be >= 1, got {self.max_decode_attempts}")
        if self.discovery_interval_s <= 0 or self.registry_grace_s < 0 or self.index_timeout_s <= 0:
            raise ValueError(
                "discovery_interval_s and index_timeout_s must be positive, registry_grace_s >= 0"
            )
        if self.pd_threshold_tokens < 0:
            raise ValueError(f"pd_threshold_tokens must be >= 0, got {self.pd_threshold_tokens}")
        if self.hotspot_margin_tokens < -1:
            raise ValueError(
                f"hotspot_margin_tokens must be >= 0, or -1 (off), got {self.hotspot_margin_tokens}"
            )
        self.routing_weights()  # checks the weights
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(
                f"generation_config must be auto, vllm or a directory holding generation_config.json, got "
                f"{self.generation_config!r}"
            )
        if self.chat_template is not None:
            load_chat_template(self.chat_template)  # a missing file or a syntax error stops the start
        if self.responses_ttl_s <= 0 or self.responses_max_stored < 1:
            raise ValueError("responses_ttl_s must be positive and responses_max_stored >= 1")
        if self.default_max_tokens_cap < 1:
            raise ValueError(f"default_max_tokens_cap must be >= 1, got {self.default_max_tokens_cap}")

    def runtime_lora_updating(self) -> bool:
        """Whether the adapter endpoints are served: the setting, or vLLM's variable set to 1 or true."""
        vllm = os.environ.get(VLLM_RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
        return self.allow_runtime_lora_updating or vllm

    def routing_weights(self) -> RoutingWeights:
        """The scorer weights and hot-spot margin as the pickers take them (-1, no guard, is None there)."""
        margin = None if self.hotspot_margin_tokens < 0 else self.hotspot_margin_tokens
        return RoutingWeights(self.prefix_weight, self.load_weight, self.kv_headroom_weight, margin)
