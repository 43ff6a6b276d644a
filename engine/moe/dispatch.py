"""Token dispatch between expert-parallel ranks, behind one small interface with interchangeable backends.

``SingleRankDispatcher`` keeps everything local. ``AllGatherDispatcher`` uses torch.distributed
all-gather / all-reduce (runs on gloo on the CPU and NCCL on GPUs): every rank sees every token,
computes only the experts it holds, and the partial outputs are summed back to the token's rank.
A DeepEP backend would implement the same interface (none is wired in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# expert_fn(x, topk_weights, topk_ids_local) -> y, computed over this rank's physical experts only.
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TokenDispatcher(Protocol):
    ep_rank: int
    ep_size: int

    def begin_forward(self) -> None:
        """Called once per forward pass, before its first MoE layer (every layer of a pass sees the same
        tokens, so per-pass facts such as the ranks' token counts can be exchanged once)."""
        ...

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_physical_experts: int,
        expert_fn: ExpertFn,
    ) -> torch.Tensor:
        """Send tokens to the ranks holding their experts, run ``expert_fn`` there, combine back.

        ``topk_ids`` are global physical expert ids; rank r holds physical experts
        ``[r * E/ep_size, (r+1) * E/ep_size)``.
        """
        ...


class SingleRankDispatcher:
    ep_rank = 0
    ep_size = 1

    def begin_forward(self) -> None:
        pass

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_physical_experts: int,
        expert_fn: ExpertFn,
    ) -> torch.Tensor:
        return expert_fn(x, topk_weights, topk_ids)


class AllGatherDispatcher:
    """All-gather tokens over the EP group, compute local experts, sum the partial outputs."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.ep_rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        # Forward passes begun on this rank: every rank must run each pass the others run
        # (``engine.data_parallel.Lockstep`` counts them to keep the ranks together).
        self.forward_passes = 0
        self._counts: list[int] | None = None  # tokens per rank in the current forward pass

    def begin_forward(self) -> None:
        self._counts = None
        self.forward_passes += 1

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_physical_experts: int,
        expert_fn: ExpertFn,
    ) -> torch.Tensor:
        dist = self.dist
        n_local = x.shape[0]
        if self._counts is None:  # the pass's first MoE layer: one exchange (and host sync) per pass
            sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(self.ep_size)]
            dist.all_gather(sizes, torch.tensor([n_local], device=x.device), group=self.group)
            self._counts = [int(s.item()) for s in sizes]
        elif self._counts[self.ep_rank] != n_local:
            raise RuntimeError(
                f"rank {self.ep_rank} has {n_local} tokens in this MoE layer but {self._counts[self.ep_rank]} "
                "in the pass's first one: begin_forward() must be called at the start of every forward pass"
            )
        counts = self._counts
        max_n = max(counts)

        def gather(t: torch.Tensor) -> torch.Tensor:
            padded = torch.zeros((max_n, *t.shape[1:]), dtype=t.dtype, device=t.device)
            padded[:n_local] = t
            parts = [torch.empty_like(padded) for _ in range(self.ep_size)]
            dist.all_gather(parts, padded, group=self.group)
            return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])

        all_x, all_w, all_ids = gather(x), gather(topk_weights), gather(topk_ids)
        per_rank = num_physical_experts // self.ep_size
        lo = self.ep_rank * per_rank
        local = (all_ids >= lo) & (all_ids < lo + per_rank)
        local_ids = torch.where(local, all_ids - lo, torch.zeros_like(all_ids))
        local_w = torch.where(local, all_w, torch.zeros_like(all_w))
        y = expert_fn(all_x, local_w, local_ids)
        # Sum the partial outputs across ranks, then keep this rank's own tokens. (An all-reduce rather
        # than a reduce-scatter: gloo has no reduce-scatter, and the rows per rank differ.)
        dist.all_reduce(y, group=self.group)
        start = sum(counts[: self.ep_rank])
        return y[start : start + n_local]
