"""Data-parallel attention over expert-parallel MoE: the ranks' engines step together.

Each rank runs its own engine on its own requests (attention is data-parallel), and the MoE layers of
every forward pass exchange tokens between all ranks (``AllGatherDispatcher``). A collective needs every
rank, so every rank must run each forward pass, also a rank with nothing to do or whose scheduler admits
nothing this step: it runs an idle pass instead (padding that writes no KV and counts for no expert), as
SGLang's data-parallel attention ranks run an idle batch.

``Lockstep.step`` is one step of the group, with one host exchange (a max all-reduce of six numbers
over a gloo group): each rank votes for the pass it would run and gives its token count, says whether it
has unfinished requests, and whether it goes on (``stopping``). A rank
whose engine schedules a batch votes from inside its step, just before the forward pass
(``ModelRunner.group_batch``; with ``expert_parallel_async_scheduling`` also a lookahead step, launched
while the step before it still runs): the decode batch it runs when that fits a decode graph, else "eager". A
rank that schedules nothing (no requests, or none admitted) votes for no pass. Then:

- every rank votes for no pass: nobody runs one; ``step`` returns None on every rank when no rank has
  unfinished requests either, so a loop of ``step`` ends on every rank in the same iteration;
- some rank runs a pass: each rank without a batch joins it with an idle pass. With decode CUDA graphs
  (whose token exchanges have a fixed size) the largest vote picks the pass: a decode graph of the bucket
  that holds the largest batch, which every rank replays padding its own batch (an idle rank: padding
  only); when any rank's step is not a decode that fits a graph (a prefill or mixed step), the piecewise
  prefill graphs (``engine.prefill_graphs``) of the bucket that holds the most tokens any rank runs, which
  every rank replays with its own step (a decode batch too) and the rest padding; and when no bucket
  holds them (or there are no such graphs), an eager pass on every rank. This is the padding SGLang's and
  vLLM's data-parallel attention do for their graphs.

A new expert placement (``LLMEngine.set_expert_placement``, from the EPLB controller) is staged on each
rank as it arrives; the exchange also carries the newest and the oldest placement version the ranks have
staged (or run), and once they are equal and newer than the one running, every rank moves its experts at
the start of its next step (``engine.moe.rebalance``: point-to-point messages over the expert group), so
all ranks switch between the same two passes.

``LLM`` and ``AsyncEngine`` (so the workers) take this path for an engine with several ranks.

The ranks also stop together: a serving loop passes ``stopping`` once its worker has drained, and keeps
stepping (joining the others' passes) until every rank stops (``stopped``), so a rank that drained first
does not fail a step of a rank still finishing its requests.
"""

from __future__ import annotations

import datetime
import time

import torch

from engine.llm_engine import LLMEngine, RequestOutput
from engine.model_runner import EAGER, GroupPass
from engine.moe.dispatch import AllGatherDispatcher


class Lockstep:
    """Steps one rank's engine together with the other ranks of its dispatcher's group.

    Collective: every rank of the group constructs it (a gloo group may be created for the host-side
    flags) and calls ``step`` the same number of times; the engine must not be stepped by anything else
    meanwhile."""

    def __init__(self, engine: LLMEngine, flags_on_device: bool = False) -> None:
        """``engine``'s model has an ``AllGatherDispatcher`` over several ranks (``for_engine`` checks).
        ``flags_on_device``: exchange the per-step flags as device tensors over the dispatcher's NCCL group
        instead of host tensors over a gloo group."""
        import torch.distributed as dist

        self.dist = dist
        self.engine = engine
        self.dispatcher: AllGatherDispatcher = engine.model.dispatcher
        group = self.dispatcher.group
        self.flags_device = torch.device("cpu")
        if dist.get_backend(group) == "gloo":
            self.flags_group = group
        elif flags_on_device:
            self.flags_group = group
            self.flags_device = torch.device("cuda", torch.cuda.current_device())
        else:  # host tensors need a gloo group over the same ranks (with the engine's collective timeout)
            self.flags_group = dist.new_group(
                ranks=dist.get_process_group_ranks(group or dist.group.WORLD), backend="gloo",
                timeout=datetime.timedelta(seconds=engine.config.distributed_timeout_s),
            )  # fmt: skip
        self._stopping = False
        self.passed = False  # whether the group ran a forward pass in the last step
        self.stopped = False  # set in the step in which every rank asked to stop (the same on every rank)
        # An expert placement every rank has staged (agreed in a step's exchange), applied by every rank at
        # the start of the next step: (version, physical -> logical).
        self._placement: tuple[int, list[list[int]]] | None = None
        graphs = engine.runner.graphs
        self._eager = (graphs.max_batch if graphs is not None else 0) + 1  # the vote for an eager pass
        engine.runner.group_batch = self._agree

    @classmethod
    def for_engine(cls, engine: LLMEngine, flags_on_device: bool = False) -> Lockstep | None:
        """The lockstep of an engine whose MoE layers exchange tokens with other ranks; None otherwise."""
        dispatcher = engine.model.dispatcher
        if isinstance(dispatcher, AllGatherDispatcher) and dispatcher.ep_size > 1:
            return cls(engine, flags_on_device)
        return None

    def step(self, stopping: bool = False) -> list[RequestOutput] | None:
        """One step of every rank: this engine's step if it has unfinished requests, and an idle pass when
        it ran no forward pass while another rank runs one. Returns its outputs, or None (having run
        nothing) when no rank of the group has unfinished requests. ``stopping``: this rank would stop;
        ``stopped`` turns true in the step in which every rank says so."""
        if self._placement is not None:  # every rank agreed on it in the last step's exchange
            version, placement = self._placement
            self._placement = None
            self.engine.apply_expert_placement(version, placement)
        self._stopping = stopping
        self.passed = True
        mine = self.engine.has_unfinished()
        runner = self.engine.runner
        before = runner.forward_passes
        outputs = self.engine.step() if mine else []
        ran = runner.forward_passes - before
        if ran > 1:
            raise RuntimeError(
                f"rank {self.dispatcher.ep_rank} ran {ran} forward passes in one step; the ranks of an "
                "expert-parallel group must run one each"
            )
        if ran == 1:  # it voted from inside its pass
            return outputs
        largest, tokens, anyone = self._vote(0, 0, mine)  # no pass here: nothing to run or admitted
        if largest > 0:  # another rank runs one: join it
            runner.idle_pass(self._group_pass(largest, tokens))
            return outputs
        self.passed = False
        return outputs if anyone else None

    @property
    def graph_passes(self) -> int:
        """Passes this rank replayed as decode graphs (the group agreed on each)."""
        return self.engine.runner.pass_kinds["decode_graph"]

    @property
    def prefill_graph_passes(self) -> int:
        """Passes this rank replayed as prefill graphs."""
        return self.engine.runner.pass_kinds["prefill_graph"]

    @property
    def idle_passes(self) -> int:
        """Passes of padding only this rank ran to join the others' steps."""
        return self.engine.runner.idle_passes

    @property
    def sync_seconds(self) -> float:
        """Host time this rank spent in the per-step flag exchanges."""
        return self.engine.runner.group_sync_seconds

    def _agree(self, want: int | None, tokens: int) -> GroupPass:
        """``ModelRunner.group_batch``: this rank's vote from inside its step, just before its pass: a
        decode graph for ``want`` rows, or with None any other pass, of ``tokens`` tokens. Returns the
        pass every rank runs."""
        largest, most, _ = self._vote(self._eager if want is None else max(want, 1), tokens, True)
        return self._group_pass(largest, most)

    def _group_pass(self, largest: int, tokens: int) -> GroupPass:
        """The pass the largest vote (at least 1) and the most tokens any rank runs stand for: a decode
        graph's size; else the prefill graphs' bucket that holds the tokens; else eager."""
        runner = self.engine.runner
        if largest < self._eager and runner.graphs is not None:
            return GroupPass(decode=runner.graphs.bucket_for(largest))
        bucket = runner.prefill_graphs.bucket_for(tokens) if runner.prefill_graphs is not None else None
        return EAGER if bucket is None else GroupPass(prefill=bucket)

    def _vote(self, want: int, tokens: int, has_work: bool) -> tuple[int, int, bool]:
        """The step's one exchange (collective): the largest of the ranks' votes (0: no pass, 1 to the
        largest graph batch: that decode batch, ``_eager``: any other pass), the most tokens any rank's
        pass has, and whether any rank has unfinished requests. Sets ``stopped`` when no rank goes on."""
        started = time.perf_counter()
        staged = self.engine.staged_placement
        ready = staged[0] if staged is not None else self.engine.placement_version
        flags = [want, tokens, int(has_work), int(not self._stopping), ready, -ready]
        t = torch.tensor(flags, dtype=torch.int64, device=self.flags_device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.flags_group)
        largest, most, anyone, going_on, newest, oldest = (int(v) for v in t.tolist())
        self.engine.runner.group_sync_seconds += time.perf_counter() - started
        self.stopped = not going_on
        if staged is not None and newest == -oldest == staged[0]:
            self._placement = staged
        return largest, most, bool(anyone)
