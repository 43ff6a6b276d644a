"""The EPLB controller's settings (one declaration: flags, ``PDMESH_*`` variables and docs come from it)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import check_choices, setting


@dataclass
class EPLBSettings:
    host: str = setting("127.0.0.1", "Address the gRPC server binds to.")
    port: int = setting(0, "gRPC port (0 picks a free one; the chosen port is printed).")
    advertise_host: str | None = setting(
        None, "Host the workers use to reach this controller (default: --host)."
    )
    metrics_port: int = setting(
        0, "Port of the Prometheus /metrics endpoint (0 picks a free one, -1 disables)."
    )
    controller_id: str | None = setting(None, "Unique id in the service registry (default: eplb-host-port).")
    redis_url: str | None = setting(
        None,
        "Redis URL: each placement group's current placement and version are kept there (keys "
        "pdmesh:eplb:...), so a restarted controller goes on from them, and the controller registers as role "
        "eplb so that workers with the same --redis-url find it. None: in memory only, not registered.",
    )
    redis_key_prefix: str = setting(
        "pdmesh:eplb", "Prefix of the controller's Redis keys (placements); the registry keeps its own."
    )
    registry_ttl_s: float = setting(5.0, "Registration TTL in seconds; heartbeats renew it every TTL/3.")
    window_s: float = setting(
        60.0,
        "Sliding window of load reports, in seconds: a rebalance weighs the reports of every worker and "
        "rank of the group received this recently (and measured under the current placement).",
    )
    rebalance_interval_s: float = setting(
        30.0, "How often each placement group's window is weighed for a new placement."
    )
    min_window_tokens: int = setting(
        1024,
        "Least load a window must hold before a rebalance is considered: tokens routed to experts (each "
        "token counts top_k times), summed over the group's ranks, averaged over its layers.",
    )
    min_improvement: float = setting(
        0.01,
        "Publish a new placement only when it raises the window's balancedness (mean over max tokens per "
        "expert-parallel rank, summed over layers) by more than this. With one rank balancedness is always "
        "1.0: a negative value publishes any placement that differs (replicas of the hot experts).",
    )
    num_nodes: int = setting(
        1,
        "Nodes the expert-parallel ranks of a group span: with num_expert_groups dividing over them, "
        "placement is hierarchical (expert groups packed onto nodes, replicas within each node); else global.",
    )
    num_expert_groups: int = setting(
        1,
        "Expert groups of the models served (DeepSeek-V3's n_group: 8), for hierarchical placement.",
    )
    log_level: str = setting("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        check_choices(self)
        if self.window_s <= 0 or self.rebalance_interval_s <= 0:
            raise ValueError("window_s and rebalance_interval_s must be positive")
        if self.num_nodes < 1 or self.num_expert_groups < 1:
            raise ValueError("num_nodes and num_expert_groups must be at least 1")
