"""Token dispatch between expert-parallel ranks, behind one small interface with interchangeable backends.

``SingleRankDispatcher`` keeps everything local. ``AllGatherDispatcher`` uses torch.distributed
all-gather / all-reduce (runs on gloo on the CPU and NCCL on GPUs): every rank sees every token,
computes only the experts it holds, and the partial outputs are summed back to the token's rank.
A DeepEP backend would implement the same interface (none is wired in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch

from kernels.dispatch import local_routing_torch, pack_rows_torch, packed_views

# expert_fn(x, topk_weights, topk_ids_local) -> y, computed over this rank's physical experts only; a pair
# whose expert another rank holds has local id -1 and adds nothing (no weights read, no rows computed).
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TokenDispatcher(Protocol):
    ep_rank: int
    ep_size: int

    def begin_forward(self) -> None:
        """Called once per forward pass, before its first MoE layer (every layer of a pass sees the same
        tokens, so per-pass facts such as the ranks' token counts can be exchanged once)."""
        ...

    def uniform_batches(self, live: torch.Tensor | None = None) -> AbstractContextManager[None]:
        """Within it, every rank's forward passes have the same number of tokens (padded batches of one
        agreed size), so ``run`` exchanges no counts and synchronises no host: what a CUDA graph capture
        needs. ``live`` (on the device, one value per row for at least a pass's rows, which the caller
        sets before each pass: a bool mask, or a decode graph's ``seq_lens``): zero marks a padding row,
        whose pairs no expert runs (its output is zero); one rank ignores it, its padding rows run as
        any."""
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

    def uniform_batches(self, live: torch.Tensor | None = None) -> AbstractContextManager[None]:
        return nullcontext()

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
    """All-gather tokens over the EP group, compute local experts, sum the partial outputs.

    Ranks may have different token counts in a pass: its first MoE layer exchanges them (a host
    synchronisation), and each rank pads its rows to the largest, the padding's (token, expert) pairs
    marked absent (id -1), so they run on no expert. Within ``uniform_batches`` (the graphs, whose batches
    the ranks pad to one agreed size) there is no exchange, and a pass can be captured. The tokens, weights
    and expert ids go in one packed ``all_gather_into_tensor``, and over NCCL the partial sums come back by
    one ``reduce_scatter_tensor``: two collectives a layer, each costing its latency more than its bytes at
    decode sizes."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.ep_rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self._uniform = False
        self._live: torch.Tensor | None = None  # within uniform_batches: zero on padding rows
        self._counts: list[int] | None = None  # tokens per rank in the current forward pass

    def begin_forward(self) -> None:
        self._counts = None

    @contextmanager
    def uniform_batches(self, live: torch.Tensor | None = None) -> Iterator[None]:
        self._uniform, self._live = True, live
        try:
            yield
        finally:
            self._uniform, self._live = False, None

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
        live = None
        if self._uniform:  # every rank has n_local rows: nothing to exchange first, nothing to pad
            counts = [n_local] * self.ep_size
            if self.ep_size > 1:  # padding rows' pairs: absent on every rank (id -1), marked by the pack
                live = self._live  # (one rank ignores it: its experts take no absent pairs)
        elif self._counts is None:  # the pass's first MoE layer: one exchange (and host sync) per pass
            sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(self.ep_size)]
            dist.all_gather(sizes, torch.tensor([n_local], device=x.device), group=self.group)
            self._counts = counts = [int(s.item()) for s in sizes]
        elif self._counts[self.ep_rank] != n_local:
            raise RuntimeError(
                f"rank {self.ep_rank} has {n_local} tokens in this MoE layer but {self._counts[self.ep_rank]} "
                "in the pass's first one: begin_forward() must be called at the start of every forward pass"
            )
        else:
            counts = self._counts
        max_n = max(counts)
        if max_n == 0:  # no rank has a token (every rank sees the same counts)
            return x
        if n_local < max_n:  # pad to the largest count; the padding's pairs run on no expert (id -1)
            pad = (0, 0, 0, max_n - n_local)
            x = torch.nn.functional.pad(x, pad)
            topk_weights = torch.nn.functional.pad(topk_weights, pad)
            topk_ids = torch.nn.functional.pad(topk_ids, pad, value=-1)
        all_x, all_ids, all_w = self._gather_packed((x, topk_ids, topk_weights), live)  # one collective
        per_rank = num_physical_experts // self.ep_size
        local_routing = local_routing_torch
        if self._uniform and all_x.is_cuda:  # in a graph: one launch instead of five (eager: fewer host us)
            from kernels.triton_dispatch import local_routing_triton as local_routing
        local_ids, local_w = local_routing(all_ids, all_w, self.ep_rank * per_rank, per_rank)
        y = expert_fn(all_x, local_w, local_ids)
        if self.nccl:  # sum the partial outputs and keep this rank's rows in one collective
            out = torch.empty_like(x)
            scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter_single(out, y.contiguous(), group=self.group)
            return out[:n_local]
        # gloo has no reduce-scatter: sum the partial outputs across ranks, then keep this rank's rows.
        dist.all_reduce(y, group=self.group)
        return y[self.ep_rank * max_n : self.ep_rank * max_n + n_local]

    def _gather_packed(
        self, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], live: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """All-gather (x, ids, weights) of the same rows as one uint8 buffer (``kernels/dispatch.py``), in
        one collective: an NCCL collective of a few tokens costs its latency, not its bytes. ``live``: zero
        on the padding rows, whose ids are packed as -1. Returns each part over all ranks' rows, as
        strided views into the gathered buffer (no copies)."""
        pack_rows = pack_rows_torch
        if self._uniform and parts[0].is_cuda:  # in a graph: one launch, padding marked, no copies
            from kernels.triton_dispatch import pack_rows_triton as pack_rows
        x, ids, w = (p if p.stride(-1) == 1 else p.contiguous() for p in parts)
        packed = pack_rows((x, ids, w), live)
        out = torch.empty(
            (self.ep_size * packed.shape[0], packed.shape[1]), dtype=torch.uint8, device=packed.device
        )
        # all_gather_single is torch 2.13's name for all_gather_into_tensor (deprecated there).
        gather_single = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        gather_single(out, packed, group=self.group)
        return packed_views(out, [(p.dtype, p.shape[1]) for p in parts])
