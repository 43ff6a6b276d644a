"""The router's settings, declared once (``mesh.config``): flags, ``PDMESH_*`` twins and docs follow.

Only settings live here; ``router.__main__`` turns them into a running service.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import setting

ROUTING_MODES = ("round_robin",)


@dataclass
class RouterConfig:
    model: str = setting(
        "tiny-dense",
        "Model the mesh serves: a built-in model name or a checkpoint directory (the router loads only its "
        "tokenizer and config).",
    )
    served_model_name: str | None = setting(
        None, "Name clients use for the model (the `model` field); default: the model's own name."
    )
    host: str = setting("127.0.0.1", "Address the gRPC and HTTP servers bind to.")
    port: int = setting(50050, "Port of the public gRPC API (pdmesh.v1.Router); 0 picks a free one.")
    http_port: int = setting(8000, "Port of the OpenAI-compatible HTTP API; 0 picks a free one.")
    prefill_workers: list[str] = setting([], "gRPC addresses (host:port) of the prefill workers.")
    decode_workers: list[str] = setting([], "gRPC addresses (host:port) of the decode workers.")
    routing: str = setting("round_robin", "How prefill and decode workers are chosen.", choices=ROUTING_MODES)
    redis_url: str | None = setting(
        None, "Redis URL of the registry and KV index (accepted; round_robin routing does not read it)."
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
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing!r}")
        if self.request_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("request_timeout_s and control_timeout_s must be positive")
        if self.max_decode_attempts < 1:
            raise ValueError(f"max_decode_attempts must be >= 1, got {self.max_decode_attempts}")
        if self.default_max_tokens_cap < 1:
            raise ValueError(f"default_max_tokens_cap must be >= 1, got {self.default_max_tokens_cap}")
