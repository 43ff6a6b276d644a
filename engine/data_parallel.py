"""Data-parallel attention over expert-parallel MoE: the ranks' engines step together.

Each rank runs its own engine on its own requests (attention is data-parallel), and the MoE layers of
every forward pass exchange tokens between all ranks (``AllGatherDispatcher``). A collective needs every
rank, so every rank must run each forward pass, also a rank with nothing to do or whose scheduler admits
nothing this step: it runs an idle pass instead (one padding token that writes no KV and counts for no
expert), as SGLang's data-parallel attention ranks run an idle batch.

``Lockstep.step`` is one step of the group: the ranks first say on the host whether they have work (an
all-reduce over a gloo group), then each runs exactly one forward pass, its engine's step or an idle pass.
It returns None once no rank has work, so a loop of ``step`` ends on every rank in the same iteration.
``LLM`` and ``AsyncEngine`` (so the workers) take this path for an engine with several ranks.

With decode CUDA graphs, each pass also needs the ranks to agree on its shape, since a graph's token
exchanges have a fixed size: just before it, the ranks all-reduce on the host the largest decode batch any
of them runs (``ModelRunner.group_batch``), and every rank replays the graph of that bucket, padding its
own batch (an idle rank: padding only). When any rank's step is not a decode that fits a graph (a prefill
or mixed step), every rank runs that pass eagerly. This is the padding SGLang's and vLLM's data-parallel
attention do for their graphs.
"""

from __future__ import annotations

import time

import torch

from engine.llm_engine import LLMEngine, RequestOutput
from engine.moe.dispatch import AllGatherDispatcher


class Lockstep:
    """Steps one rank's engine together with the other ranks of its dispatcher's group.

    Collective: every rank of the group constructs it (a gloo group may be created for the host-side
    flags) and calls ``step`` the same number of times; the engine must not be stepped by anything else
    meanwhile."""

    def __init__(
        self, engine: LLMEngine, dispatcher: AllGatherDispatcher, flags_on_device: bool = False
    ) -> None:
        """``flags_on_device``: exchange the per-step flags as device tensors over the dispatcher's NCCL
        group instead of host tensors over a gloo group."""
        import torch.distributed as dist

        self.dist = dist
        self.engine = engine
        self.dispatcher = dispatcher
        group = dispatcher.group
        self.flags_device = torch.device("cpu")
        if dist.get_backend(group) == "gloo":
            self.flags_group = group
        elif flags_on_device:
            self.flags_group = group
            self.flags_device = torch.device("cuda", torch.cuda.current_device())
        else:  # host tensors need a gloo group over the same ranks
            self.flags_group = dist.new_group(ranks=dist.get_process_group_ranks(group or dist.group.WORLD),
                                              backend="gloo")  # fmt: skip
        self.graph_passes = 0  # passes the group agreed to replay as decode graphs
        graphs = engine.runner.graphs
        if graphs is not None:
            self._max_batch = graphs.max_batch
            engine.runner.group_batch = self._agree

    @classmethod
    def for_engine(cls, engine: LLMEngine, flags_on_device: bool = False) -> Lockstep | None:
        """The lockstep of an engine whose MoE layers exchange tokens with other ranks; None otherwise."""
        dispatcher = engine.model.dispatcher
        if isinstance(dispatcher, AllGatherDispatcher) and dispatcher.ep_size > 1:
            return cls(engine, dispatcher, flags_on_device)
        return None

    def step(self) -> list[RequestOutput] | None:
        """One step of every rank: this engine's step if it has unfinished requests, else an idle pass.
        Returns its outputs, or None (having run nothing) when no rank of the group has work."""
        mine = self.engine.has_unfinished()
        if self._max_of(1 if mine else 0) == 0:
            return None
        runner = self.engine.runner
        before = runner.forward_passes
        outputs = self.engine.step() if mine else []
        ran = runner.forward_passes - before
        if ran == 0:  # nothing to run, or nothing admitted this step: join the others' pass
            self.engine.runner.idle_pass()
        elif ran > 1:
            raise RuntimeError(
                f"rank {self.dispatcher.ep_rank} ran {ran} forward passes in one step; the ranks of an "
                "expert-parallel group must run one each (asynchronous scheduling is off for them)"
            )
        return outputs

    @property
    def idle_passes(self) -> int:
        """Passes of padding only this rank ran to join the others' steps."""
        return self.engine.runner.idle_passes

    @property
    def sync_seconds(self) -> float:
        """Host time this rank spent in the per-step flag exchanges."""
        return self.engine.runner.group_sync_seconds

    def _agree(self, want: int | None) -> int | None:
        """The pass's decode-graph size (``ModelRunner.group_batch``): this rank wants a graph for ``want``
        rows (0: an idle pass) or, with None, an eager pass. Every rank calls it once per pass."""
        over = self._max_batch + 1  # stands for "eager"
        largest = self._max_of(over if want is None else want)
        if largest == over:
            return None
        self.graph_passes += 1
        graphs = self.engine.runner.graphs
        assert graphs is not None
        return graphs.bucket_for(max(largest, 1))

    def _max_of(self, value: int) -> int:
        """The largest of the ranks' ``value`` (collective)."""
        started = time.perf_counter()
        flags = torch.tensor([value], dtype=torch.int64, device=self.flags_device)
        self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX, group=self.flags_group)
        largest = int(flags.item())
        self.engine.runner.group_sync_seconds += time.perf_counter() - started
        return largest
