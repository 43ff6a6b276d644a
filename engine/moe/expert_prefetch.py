"""Speculative L2 prefetch of each MoE layer's experts in batch-1 decode graphs (experimental, off by default).

``ExpertPrefetcher`` launches ``kernels/triton_expert_prefetch.py`` on a side stream right after a layer's QKV
projection has written the layer's input (the residual sum): the router applied to that input guesses the
experts, and a part of their weights is asked into L2 while the attention runs on the main stream. The side
launches are joined to the main stream at the end of each decode graph piece (``armed``), so a captured
graph holds them as a branch. Nothing the main stream computes reads what the side stream writes: the
outputs are bit-identical with and without it.

``record`` keeps, per layer, the guessed physical experts and (set on each MoE block) the ones the routing
chose, so a benchmark can report how often the guess was right.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.moe.layer import MoEBlock
from kernels.fp8_weight import Fp8Weight


def _values(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    return w.weight if isinstance(w, Fp8Weight) else w


class ExpertPrefetcher:
    def __init__(
        self,
        blocks: list[MoEBlock],
        device: torch.device,
        gate_up_fraction: float = 0.5,
        down_fraction: float = 0.0,
        num_programs: int | None = None,
    ) -> None:
        """``blocks``: the model's MoE blocks, in layer order; ``gate_up_fraction`` / ``down_fraction``: the
        share of each guessed expert's gate and up rows / down rows to prefetch."""
        if not blocks:
            raise ValueError("the expert prefetch needs a model with MoE layers")
        if device.type != "cuda":
            raise ValueError("the expert prefetch runs on CUDA devices")
        if any(b.dispatcher.ep_size != 1 for b in blocks):
            raise ValueError("the expert prefetch reads the experts of one rank: single-rank engines only")
        self.gate_up_fraction = gate_up_fraction
        self.down_fraction = down_fraction
        self.num_programs = num_programs
        self.stream = torch.cuda.Stream(device)
        self.slot = {id(b): i for i, b in enumerate(blocks)}
        num_experts = max(b.num_logical for b in blocks)
        top_k = max(b.top_k for b in blocks)
        self.logits = torch.empty(num_experts, dtype=torch.float32, device=device)
        self.counts = torch.zeros(2, dtype=torch.int32, device=device)
        self.guessed = torch.full((len(blocks), top_k), -1, dtype=torch.int32, device=device)
        self.blocks = blocks
        self.armed = False
        self._pending = False

    def launch(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, block: MoEBlock) -> None:
        """After the layer's input h [T, H] is written on the current stream: guess the layer's experts and
        prefetch them, on the side stream. Only while ``armed`` and for one row."""
        if not self.armed or h.shape[0] != 1:
            return
        from kernels.triton_expert_prefetch import expert_prefetch_triton

        main = torch.cuda.current_stream(h.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            expert_prefetch_triton(
                h,
                norm_weight,
                eps,
                block.gate,
                block.placement.logical_to_physical,
                _values(block.w13),
                _values(block.w2),
                block.top_k,
                self.gate_up_fraction,
                self.down_fraction,
                self.logits,
                self.counts,
                self.guessed[self.slot[id(block)], : block.top_k],
                self.num_programs,
            )
        h.record_stream(self.stream)  # h's memory is not reused before the side stream has read it
        self._pending = True

    def join(self) -> None:
        """Make the current stream wait for the side stream's launches (before a capture ends)."""
        if self._pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._pending = False

    @contextmanager
    def arm(self) -> Iterator[None]:
        """Prefetch in the layers run inside; joined at the end."""
        self.armed = True
        try:
            yield
        finally:
            self.armed = False
            self.join()

    def record(self, on: bool) -> None:
        """Have every MoE block keep its routed experts of row 0 (``MoEBlock.routed``) beside the guesses,
        or stop. Changes what a captured graph does: capture again after."""
        for b in self.blocks:
            b.routed = (
                torch.full((b.top_k,), -1, dtype=torch.int64, device=self.logits.device) if on else None
            )

    def hit_rate(self) -> float:
        """Share of the routed experts (as ``record`` kept them) that were guessed, over the MoE layers."""
        hits = total = 0
        for i, b in enumerate(self.blocks):
            if b.routed is None:
                raise ValueError("nothing recorded: call record(True) and run a step first")
            routed = set(b.routed.tolist())
            guessed = set(self.guessed[i, : b.top_k].tolist())
            hits += len(routed & guessed)
            total += len(routed)
        return hits / total
