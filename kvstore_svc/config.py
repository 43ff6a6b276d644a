"""The KV offload store's settings, declared once (``mesh.config``): flags, ``PDMESH_*`` twins and docs follow.

Only settings live here; ``kvstore_svc.service`` turns them into a running store.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import check_choices, dtype_setting, quantization_setting, setting
from mesh.kv_layout import KV_CACHE_DTYPES


@dataclass
class KVStoreSettings:
    model: str = setting(
        "tiny-dense",
        "Model whose KV blocks the store keeps: a built-in model name or a checkpoint directory (only its "
        "config is read, no weights). With dtype, kv_cache_dtype, block_size, quantization and load_format it "
        "must match the workers' settings: the KV layout fingerprint is checked before any byte moves.",
    )
    dtype: str = dtype_setting()
    kv_cache_dtype: str = setting("auto", "The workers' KV cache dtype.", choices=tuple(KV_CACHE_DTYPES))
    block_size: int = setting(16, "Tokens per KV block (the workers' block size).")
    quantization: str = quantization_setting()
    load_format: str = setting(
        "auto",
        "The workers' load_format (dummy weights have their own fingerprint).",
        choices=("auto", "dummy"),
    )
    cache_salt: str | None = setting(
        None, "The workers' engine-wide cache salt, if they have one (their published model fingerprint)."
    )
    speculative_config: str | None = setting(
        None,
        "The workers' --speculative-config, if they have one: with method mtp their KV blocks hold the MTP "
        "layer's KV too (one layer more).",
    )
    host: str = setting("127.0.0.1", "Address the gRPC server binds to.")
    port: int = setting(0, "gRPC port (0 picks a free one; the chosen port is printed).")
    advertise_host: str | None = setting(None, "Host workers use to reach the store (default: --host).")
    metrics_port: int = setting(
        0, "Port of the Prometheus /metrics endpoint (0 picks a free one, -1 disables)."
    )
    store_id: str | None = setting(None, "Unique store id (default: kvstore-host-port).")
    host_blocks: int | None = setting(
        None, "Blocks of the host-memory tier (registered with NIXL); default: from host_memory_gb."
    )
    host_memory_gb: float = setting(
        1.0, "Host memory of the host tier, in GiB, when host_blocks is not given."
    )
    disk_path: str | None = setting(
        None,
        "File of the disk tier, preallocated at start (its earlier contents are discarded); none: no disk tier, "
        "blocks evicted from host memory are dropped.",
    )
    disk_blocks: int | None = setting(None, "Blocks of the disk tier; default: from disk_gb.")
    disk_gb: float = setting(4.0, "Size of the disk tier, in GiB, when disk_blocks is not given.")
    lease_s: float = setting(
        30.0,
        "How long fetched blocks stay pinned for the reader when neither its NIXL notification nor Release comes.",
    )
    transfer_timeout_s: float = setting(30.0, "Longest the store waits for one READ of offered blocks.")
    kv_transfer: str = setting("nixl", "KV transfer backend.", choices=("nixl", "local"))
    kv_xfer_mode: str = setting(
        "prepped", "NIXL transfer mode (as the workers' --kv-xfer-mode).", choices=("prepped", "coalesced")
    )
    redis_url: str | None = setting(
        None,
        "Redis URL: register in the service registry (role kvstore) and write the store's KV events (tiers cpu "
        "and disk) into the KV index.",
    )
    registry_ttl_s: float = setting(5.0, "Registration TTL in seconds; heartbeats renew it every TTL/3.")
    log_level: str = setting("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        check_choices(self)
