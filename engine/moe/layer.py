"""The MoE block: router, top-k over logical experts, mapping to physical experts, per-expert counters.

Experts are stored as physical experts with a physical-to-logical map, so redundant replicas and
rebalanced placements (from the EPLB controller) need no model change. Each forward counts tokens per
physical expert on the device; the counters are read and reset by whoever reports load.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.moe.dispatch import SingleRankDispatcher, TokenDispatcher
from kernels import Ops
from kernels.fp8_weight import Fp8Layout, empty_param, linear_weight


class ExpertPlacement:
    """Physical-to-logical map of one layer and the logical-to-physical replica table derived from it
    (the routing op picks replica ``token % replica_counts[expert]`` of each chosen expert).

    The replica table is as wide as any placement of these sizes can need (``num_physical - num_logical
    + 1``, -1 past an expert's replicas), and ``update`` rewrites every table in place, so a new placement
    (the EPLB controller's) leaves captured CUDA graphs valid: they read the same tensors."""

    def __init__(self, physical_to_logical: list[int], num_logical: int, device: torch.device) -> None:
        self.num_logical = num_logical
        num_physical = len(physical_to_logical)
        width = max(num_physical - num_logical + 1, 1)
        kw = {"dtype": torch.int64, "device": device}
        self.physical_to_logical = torch.empty(num_physical, **kw)
        self.logical_to_physical = torch.empty(num_logical, width, **kw)
        self.replica_counts = torch.empty(num_logical, **kw)
        self.host: list[int] = []  # physical_to_logical on the host, so readers need no device sync
        self.update(physical_to_logical)

    def update(self, physical_to_logical: list[int]) -> None:
        """Take ``physical_to_logical`` (same number of physical experts), writing the tables in place."""
        if len(physical_to_logical) != self.physical_to_logical.shape[0]:
            raise ValueError(
                f"a placement of {len(physical_to_logical)} physical experts for a layer of "
                f"{self.physical_to_logical.shape[0]}"
            )
        replicas: list[list[int]] = [[] for _ in range(self.num_logical)]
        for phys, logical in enumerate(physical_to_logical):
            replicas[logical].append(phys)
        if any(not r for r in replicas):
            missing = [i for i, r in enumerate(replicas) if not r]
            raise ValueError(f"placement leaves logical experts {missing} without a physical replica")
        width = self.logical_to_physical.shape[1]
        table = [r + [-1] * (width - len(r)) for r in replicas]
        # From page-locked memory, not waited for on a GPU: a placement rewrites every layer's tables.
        pinned = self.physical_to_logical.is_cuda
        for dst, values in ((self.physical_to_logical, physical_to_logical), (self.logical_to_physical, table),
                            (self.replica_counts, [len(r) for r in replicas])):  # fmt: skip
            host = torch.tensor(values, dtype=torch.int64)
            dst.copy_(host.pin_memory() if pinned else host, non_blocking=pinned)
        self.host = list(physical_to_logical)


class MoEBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        physical_to_logical: list[int] | None = None,
        dispatcher: TokenDispatcher | None = None,
        fp8: Fp8Layout | None = None,
    ) -> None:
        super().__init__()
        self.num_logical = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.ops = ops
        self.dispatcher = dispatcher or SingleRankDispatcher()
        p2l = physical_to_logical if physical_to_logical is not None else list(range(num_experts))
        self.num_physical = len(p2l)
        self.placement = ExpertPlacement(p2l, num_experts, device)
        ep = self.dispatcher.ep_size
        if self.num_physical % ep:
            raise ValueError(f"{self.num_physical} physical experts do not divide over {ep} EP ranks")
        n_local = self.num_physical // ep
        kw = {"dtype": dtype, "device": device}
        self.gate = empty_param(num_experts, hidden_size, **kw)
        self.w13 = linear_weight((n_local, 2 * intermediate_size, hidden_size), fp8, dtype, device)
        self.w2 = linear_weight((n_local, hidden_size, intermediate_size), fp8, dtype, device)
        self.register_buffer(
            "expert_counts", torch.zeros(self.num_physical, dtype=torch.int64, device=device)
        )
        # Set while a CUDA graph is captured (``engine.cuda_graphs.counting_live_rows``): which of the
        # graph's rows are live (nonzero), so its padding rows count for no expert. None: every row counts.
        self.count_live: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """The block on normalised hidden states x [T, H]; ``router_logits`` (x @ gate.T) where the caller
        computed them already (the layer fuses the router with its norm)."""
        if router_logits is None:
            router_logits = self.ops.linear(x, self.gate)
        p = self.placement
        topk_w, topk_phys = self.ops.moe_route(
            router_logits,
            self.top_k,
            self.norm_topk_prob,
            p.logical_to_physical,
            p.replica_counts,
            self.expert_counts,
            x.dtype,
            self.count_live,
        )
        return self.dispatcher.run(x, topk_w, topk_phys, self.num_physical, self._experts)

    def _experts(self, x: torch.Tensor, topk_w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        # Over several ranks, pairs of experts other ranks hold come with id -1.
        return self.ops.fused_moe(
            x, self.w13, self.w2, topk_w, local_ids, has_absent=self.dispatcher.ep_size > 1
        )

    def take_counts(self) -> torch.Tensor:
        """Tokens per physical expert since the last call (and reset)."""
        counts = self.expert_counts.clone()
        self.expert_counts.zero_()
        return counts
