"""Turns a scheduled batch into model inputs, runs the model, and returns the logits of sampling rows.

Batch metadata is built with vectorised numpy on the host and copied once to the device. On a CUDA device
with the Triton ops and CUDA graphs enabled, a pure decode batch (one new token per sequence) replays a
captured graph (``engine.cuda_graphs``), and a prefill or mixed batch of up to ``prefill_graph_tokens``
tokens replays piecewise graphs with attention eager between them (``engine.prefill_graphs``); larger
batches, and everything on the CPU, run eagerly.
``execute_lookahead`` runs a decode step whose input tokens are still on the device (asynchronous
scheduling), through the same graphs.

With several expert-parallel ranks (data-parallel attention) every rank must run the same kind of pass in
each step, since the MoE layers exchange tokens: before each pass the ranks agree (``group_batch``, set by
``engine.data_parallel.Lockstep``) on one ``GroupPass``: a decode-graph size, which each pads its own batch
to (a rank with nothing to run replays that graph with padding only); when any rank's step is not a decode
that fits a decode graph, a prefill-graph bucket that holds every rank's tokens, which each rank replays
with its own step (a decode batch too) and the rest padding; or, when no bucket holds them, an eager pass.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs, expert_counts_restored
from engine.device_copy import host_to_device
from engine.models.decoder import AttentionMetadata, DecoderModel
from engine.models.mtp import MTPGraphs, MTPStep
from engine.moe.dispatch import SingleRankDispatcher
from engine.pooling import pool_chunk
from engine.prefill_graphs import PrefillGraphs
from engine.sampler import Sampler, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, TokenLogprobs
from kernels.cuda_module import CudaCompileError, CudaDriverError
from kernels.decode_megakernel import DecodeMegakernel
from kernels.decode_megakernel import unsupported as megakernel_unsupported

log = logging.getLogger(__name__)

# What warm_up samples, batch by batch: a plain row, a min-p row, a top-k + top-p row, a top-p row, then a
# min-p row beside each of the last two: the compiled variants of the sampler's Triton kernels (the row
# program's six: min-p or not, and no filter, top-p alone or top-k; the hashing pass's four); without
# them, the torch race with and without a sort. Seeded, so the sampler's generator does not move.
_PLAIN = SamplingParams(temperature=1.0, seed=0)
_MIN_P = SamplingParams(temperature=1.0, min_p=0.1, seed=0)
_FILTERS = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=0)
_TOP_P = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
_WARM_UP_SAMPLES = ([_PLAIN], [_MIN_P], [_FILTERS], [_TOP_P], [_MIN_P, _FILTERS], [_MIN_P, _TOP_P])


class GroupPass(NamedTuple):
    """The pass the expert-parallel ranks agreed to run together: the decode graph of batch ``decode``,
    the prefill graphs of bucket ``prefill`` (at most one of the two is set), or an eager pass (neither).
    On one rank, ``decode`` is the batch's own bucket, and ``prefill`` is left to the runner."""

    decode: int | None = None
    prefill: int | None = None


EAGER = GroupPass()
PASS_KINDS = ("decode_graph", "prefill_graph", "eager")
# Prompt logprobs are computed this many logits a pass at most (~256 MB of fp32 logits), whatever the
# chunk's length.
_PROMPT_LOGITS_ELEMENTS = 1 << 26


class Executed(NamedTuple):
    """What ``ModelRunner.execute`` computed: the sequences that sample now and their logits [n, V]
    (fp32), and each sequence's prompt logprobs computed by this step, in prompt order."""

    sample_seqs: list[Sequence]
    logits: torch.Tensor
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]]
    # Speculative decoding: each drafting sequence's logits at its last real token and every draft token.
    spec_logits: dict[Sequence, torch.Tensor] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)
    # Embedding requests (engine.pooling) whose prompt this step ended: their embeddings (float32). They
    # are not among the sequences that sample.
    pooled: dict[Sequence, torch.Tensor] = {}  # noqa: RUF012
    # With ``keep_hidden``: what the MTP draft pass reads of the step (engine.models.mtp).
    step: MTPStep | None = None


@dataclass
class PromptLogprobRows:
    """The rows of a step's tokens whose logits give prompt logprobs: the token at position p gives the
    logprob of prompt token p + 1, for the positions of each sequence's chunk not yet done (a sequence
    recomputed after preemption does not compute them again)."""

    seqs: list[Sequence]
    rows: list[np.ndarray]  # per sequence: indices into the step's tokens
    targets: list[list[int]]  # per sequence: the prompt tokens those rows predict

    @classmethod
    def of(cls, batch: ScheduledBatch) -> PromptLogprobRows | None:
        """None when no sequence of the batch computes prompt logprobs now."""
        out = None
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.wants_prompt_logprobs:
                start = seq.num_computed_tokens
                lo = max(start, len(seq.prompt_logprobs) - 1)
                hi = min(start + n, len(seq.prompt_token_ids) - 1)
                if hi > lo:
                    out = out or cls([], [], [])
                    out.seqs.append(seq)
                    out.rows.append(np.arange(lo - start + offset, hi - start + offset))
                    out.targets.append(seq.prompt_token_ids[lo + 1 : hi + 1])
            offset += n
        return out

    def compute(
        self, logits_of: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, device: torch.device
    ) -> list[tuple[Sequence, list[TokenLogprobs]]]:
        """``logits_of(rows)``: the logits [len(rows), V] of those token rows (an index tensor on
        ``device``), asked for a bounded number of rows at a time."""
        step = max(1, _PROMPT_LOGITS_ELEMENTS // vocab_size)
        out = []
        for seq, rows, targets in zip(self.seqs, self.rows, self.targets, strict=True):
            top_n = seq.params.prompt_logprobs or 0
            found: list[TokenLogprobs] = []
            for a in range(0, len(rows), step):
                index = torch.from_numpy(rows[a : a + step]).to(device)
                target = torch.tensor(targets[a : a + step], dtype=torch.int64, device=device)
                found += token_logprobs(logits_of(index), target, [top_n] * len(target))
            out.append((seq, found))
        return out


@dataclass
class _TableRow:
    index: int
    seq: Sequence  # held so that id(seq) cannot be reused while the row exists
    blocks: list[int]  # the seq.block_table list this row mirrors
    filled: int


class DecodeBlockTables:
    """Host copy of the block tables of recent decode batches: one stable row per sequence, extended as
    blocks are appended, so a decode step converts only new block ids instead of whole tables.

    Relies on the block pool's contract: a sequence's ``block_table`` only grows by appending, and is
    replaced by a new list when it is freed or reallocated (which is detected by identity).
    """

    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self._free = list(range(max_rows - 1, -1, -1))
        self._rows: dict[int, _TableRow] = {}

    def rows_for(self, seqs: list[Sequence]) -> tuple[np.ndarray, int]:
        """Row index of each sequence's table, and the widest table's block count."""
        if len(self._free) < len(seqs):
            current = {id(s) for s in seqs}
            for key in [k for k in self._rows if k not in current]:
                self._free.append(self._rows.pop(key).index)
        rows = np.empty(len(seqs), dtype=np.int64)
        width = 0
        for i, s in enumerate(seqs):
            blocks = s.block_table
            row = self._rows.get(id(s))
            if row is None:
                row = self._rows[id(s)] = _TableRow(self._free.pop(), s, blocks, 0)
            elif row.blocks is not blocks or row.filled > len(blocks):
                row.blocks, row.filled = blocks, 0
            n = len(blocks)
            if n > row.filled:
                self.table[row.index, row.filled : n] = blocks[row.filled :]
                row.filled = n
            rows[i] = row.index
            width = max(width, n)
        return rows, width


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_pool: torch.Tensor,
        block_size: int,
        device: torch.device,
        *,
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        prefill_graph_tokens: int = 0,
        decode_megakernel: bool = False,
        specialize_lora: bool = True,
        keep_hidden: bool = False,
        draft_tokens: int = 1,
    ) -> None:
        """``keep_hidden``: steps keep their final hidden states for an MTP draft (``Executed.step``) of
        up to ``draft_tokens`` tokens a step; the decode graphs then replay its verification steps, a row a
        token (``_execute_rows``)."""
        self.model = model
        self.keep_hidden = keep_hidden
        self.draft_tokens = draft_tokens
        # With LoRA adapters: graphs captured with and without the LoRA ops (``engine.cuda_graphs``).
        self.specialize_lora = specialize_lora
        # Whether the batch-1 decode graph may run the decoder layers in one kernel (where it supports the
        # model: kernels.decode_megakernel); ``megakernel`` is it once the graphs are captured.
        self.decode_megakernel = decode_megakernel
        self.megakernel: DecodeMegakernel | None = None
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | None = None
        self.mtp_graphs: MTPGraphs | None = None  # with an MTP draft: its pass at decode steps
        self.prefill_graphs: PrefillGraphs | None = None
        # The last step's point before its last decode-graph piece (None: that step did not replay one).
        self.late_point: torch.cuda.Event | None = None
        self._tables: DecodeBlockTables | None = None
        # Forward passes this runner launched (steps and idle passes, eager or replayed): a lockstep of
        # several ranks checks that each step ran one.
        self.forward_passes = 0
        # Of those, how each ran (for metrics): a decode graph, the prefill graphs' pieces, or eagerly.
        self.pass_kinds = dict.fromkeys(PASS_KINDS, 0)
        self.idle_passes = 0  # of those, passes of padding only (joining other ranks' steps)
        self.group_sync_seconds = 0.0  # host time in the ranks' per-step agreements (engine.data_parallel)
        # With several ranks: the group's agreement on each pass, given this rank's wish (a decode-graph
        # batch, or None for any other pass) and its pass's token count; returns the pass every rank
        # runs. Set by ``engine.data_parallel.Lockstep``.
        self.group_batch: Callable[[int | None, int], GroupPass] | None = None
        self._multi_rank = not isinstance(model.dispatcher or SingleRankDispatcher(), SingleRankDispatcher)
        if cuda_graphs:
            self.enable_cuda_graphs(max_num_seqs, max_model_len or model.cfg.max_position_embeddings)
            self.enable_prefill_graphs(prefill_graph_tokens)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Capture decode graphs for batches up to ``min(max_num_seqs, 256)``; returns whether decode
        now runs as graphs (only on CUDA devices with the Triton ops). Calling it again is a no-op.

        With several expert-parallel ranks it is collective: every rank captures the same sizes (the
        ranks must have the same ``max_num_seqs``), and each pass then needs ``group_batch``."""
        if self.graphs is not None:
            return True
        if self.device.type != "cuda":
            return False
        if self.model.ops.name != "triton":
            log.warning(
                "CUDA graphs need kernel_backend='triton' (the torch ops read device values on the host); "
                "decode runs eagerly"
            )
            return False
        max_blocks = min(-(-max_model_len // self.block_size), self.kv_pool.shape[0])
        # With an MTP draft a verification step is 1 + draft_tokens rows a sequence (``_execute_rows``).
        rows = max_num_seqs * (1 + self.draft_tokens if self.keep_hidden else 1)
        graphs = DecodeGraphs(
            self.model, self.kv_pool, self.block_size, rows, max_blocks, self.device,
            megakernel=None if self.keep_hidden else self._build_megakernel(),
            specialize_lora=self.specialize_lora, keep_hidden=self.keep_hidden,
        )  # fmt: skip
        if self._multi_rank:
            self._check_same_graph_sizes(graphs.max_batch)
        graphs.capture()
        self.graphs = graphs
        self._tables = DecodeBlockTables(graphs.max_batch, max_blocks)
        if self.keep_hidden and self.model.mtp is not None:
            self.mtp_graphs = MTPGraphs(self.model, self.kv_pool, rows, max_blocks, self.device)
            self.mtp_graphs.capture()
        return True

    def _build_megakernel(self) -> DecodeMegakernel | None:
        """The decode megakernel for this model and pool, where the setting asks for it and it supports
        them; otherwise None, with a log line saying why."""
        if not self.decode_megakernel:
            return None
        reason = megakernel_unsupported(self.model, self.kv_pool)
        if reason is not None:
            log.info("decode megakernel off for this model: %s", reason)
            return None
        try:
            self.megakernel = DecodeMegakernel(self.model, self.kv_pool)
        except (CudaCompileError, CudaDriverError) as exc:
            log.warning("decode megakernel off: it did not build (%s); batch-1 decode runs op by op", exc)
            return None
        log.info(
            "decode megakernel on: batch-1 decode steps run every decoder layer in one kernel (%d CTAs, "
            "%d bytes of shared memory each, %d registers)",
            self.megakernel.plan.ctas,
            self.megakernel.plan.smem_bytes,
            self.megakernel.kernel.num_regs,
        )
        return self.megakernel

    def release_graphs(self) -> None:
        """Drop the captured graphs (decode and prefill) once the device is done with them; later passes
        run eagerly. With several ranks, before the process group is destroyed: a graph that captured
        NCCL collectives keeps their communicator busy, and destroying the group then hangs."""
        if self.graphs is None:
            return
        torch.cuda.synchronize(self.device)
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prefill_graphs = self.mtp_graphs = None
        self._tables = None
        gc.collect()

    def _check_same_graph_sizes(
        self, largest: int, what: str = "decode", setting: str = "max_num_seqs"
    ) -> None:
        """Collective: every rank's graphs go up to the same size (they capture, and later replay, the
        same sizes together)."""
        import torch.distributed as dist

        dispatcher = self.model.dispatcher
        t = torch.tensor([largest, -largest], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=getattr(dispatcher, "group", None))
        if int(t[0]) != largest or -int(t[1]) != largest:
            raise ValueError(
                f"the expert-parallel ranks' {what} graphs go up to different sizes ({-int(t[1])} to "
                f"{int(t[0])}); give every rank the same {setting}"
            )

    def enable_prefill_graphs(self, max_tokens: int) -> bool:
        """Capture piecewise graphs for steps of up to ``max_tokens`` tokens that are not decode-graph
        steps (``engine.prefill_graphs``); returns whether such steps now replay graphs. Only with the
        decode graphs (the same conditions); 0 turns them off. Calling it again is a no-op. With several
        expert-parallel ranks it is collective, as ``enable_cuda_graphs`` is (the same ``max_tokens`` on
        every rank)."""
        if self.prefill_graphs is not None:
            return True
        if self.graphs is None:
            return False
        if self._multi_rank:  # also when this rank's are off: a rank with graphs waits for the others
            self._check_same_graph_sizes(max(max_tokens, 0), "prefill", "prefill_graph_tokens")
        if max_tokens < 1:
            return False
        graphs = PrefillGraphs(self.model, self.kv_pool, max_tokens, self.device, self.specialize_lora)
        graphs.capture()
        self.prefill_graphs = graphs
        return True

    @property
    def compiles_kernels(self) -> bool:
        """Whether the model's ops compile Triton kernels on the first use of each size class: the Triton
        ops on a GPU, CUDA graphs or not. What ``warm_up`` is for. (On the CPU the Triton interpreter
        compiles nothing, and a warm-up there would only add interpreted forwards to the tests.)"""
        return self.device.type == "cuda" and self.model.ops.name == "triton"

    def warm_up(self, token_counts: Seq[int], sampler: Sampler | None = None) -> float:
        """One prefill forward (and its logits) per size in ``token_counts``, with nothing written to the
        KV pool and the outputs dropped, so that the Triton kernels' variants for those size classes (MoE
        tiles, routing tiles, prefill attention) are compiled now rather than inside a served step.
        Expert counters are restored. Sizes the prefill graphs replay are skipped: their capture ran those
        kernels already, and such steps never run eagerly. With ``sampler``, then samples through each of
        its paths (``_WARM_UP_SAMPLES``), so the sampling kernel compiles now too, not in the first sampled
        request. Returns the seconds it took."""
        started = time.perf_counter()
        dev = self.device
        pg = self.prefill_graphs
        with expert_counts_restored(self.model):
            for n in (n for n in token_counts if pg is None or pg.bucket_for(n) is None):
                self.model.compute_logits(self._scratch_forward(n)[-1:])
        if sampler is not None:
            for params in _WARM_UP_SAMPLES:
                logits = torch.zeros(
                    (len(params), self.model.cfg.vocab_size), dtype=torch.float32, device=dev
                )
                sampler.sample(logits, params, [0] * len(params))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - started

    def _scratch_forward(self, n: int) -> torch.Tensor:
        return scratch_forward(self.model, self.kv_pool, self.block_size, n)

    def idle_pass(self, group_pass: GroupPass = EAGER) -> None:
        """A forward pass of padding only, for an expert-parallel rank with nothing to run while the others
        run a step: its MoE layers take part in their token exchanges (which every rank must join),
        nothing is written to the KV pool, no logits are computed, and the expert counters are left as
        they were. ``group_pass``: the decode graph or the prefill graphs the ranks agreed on, replayed
        with padding rows only; for an eager pass, one pass of a single padding token."""
        self.forward_passes += 1
        self.idle_passes += 1
        if group_pass.decode is not None:
            assert self.graphs is not None
            self.pass_kinds["decode_graph"] += 1
            self.graphs.run_padding(group_pass.decode)
            return
        if group_pass.prefill is not None:
            assert self.prefill_graphs is not None
            self.pass_kinds["prefill_graph"] += 1
            self.prefill_graphs.run_padding(group_pass.prefill)
            return
        self.pass_kinds["eager"] += 1
        with expert_counts_restored(self.model):
            self._scratch_forward(1)

    def _group_pass(self, decode_rows: int | None, tokens: int) -> GroupPass:
        """The pass this step runs, given ``decode_rows``, the rows of a pure decode pass (None for any
        other pass), and the pass's ``tokens``: on one rank, the rows' decode-graph bucket (any other pass
        takes the prefill graphs that hold it, ``_forward``); with several ranks the group's agreement, to
        which this rank votes for that bucket's rows or, without one, for another pass of ``tokens``
        (every pass is agreed on, graphs or not)."""
        graphs = self.graphs
        bucket = graphs.bucket_for(decode_rows) if graphs is not None and decode_rows else None
        if not self._multi_rank:
            return GroupPass(decode=bucket)
        if self.group_batch is None:
            raise RuntimeError(
                "an expert-parallel rank runs its passes through a lockstep "
                "(engine.data_parallel.Lockstep), which agrees on each pass with the other ranks"
            )
        return self.group_batch(decode_rows if bucket is not None else None, tokens)

    def prepare(
        self, batch: ScheduledBatch, in_flight: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence], torch.Tensor]:
        """The step's inputs on the device: token ids, positions, attention metadata, the sequences that
        sample and their rows. With ``in_flight`` (asynchronous scheduling), the first ``in_flight``
        sequences decode a token still on the device, not yet in their outputs: their id rows are left
        for the caller to fill, they all sample, and every copy is non-blocking (a pageable one would wait
        for the step in flight)."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        starts = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        n_new = np.array(counts, dtype=np.int64)
        ends = starts + n_new
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n_new, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.empty(total, dtype=np.int64)
        input_ids[: cu[in_flight]] = 0  # the rows in flight: filled on the device by the caller
        for i, s in enumerate(seqs[in_flight:], start=in_flight):
            input_ids[cu[i] : cu[i + 1]] = s.tokens(int(starts[i]), int(ends[i]))
        seq_index = np.repeat(np.arange(len(seqs)), n_new)
        self._set_lora_rows(seqs, seq_index)
        positions = np.arange(total, dtype=np.int64) - cu[seq_index] + starts[seq_index]
        tables = block_table_array(seqs)
        block_of = tables[seq_index, positions // self.block_size].astype(np.int64)
        slots = block_of * self.block_size + positions % self.block_size
        sampling = [i for i, s in enumerate(seqs) if i < in_flight or ends[i] == s.num_tokens]
        logits_rows = cu[1:][sampling] - 1
        dev = self.device

        def copy(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return host_to_device(t, dev) if in_flight else t.to(dev)

        meta = AttentionMetadata(
            slot_mapping=copy(slots),
            block_tables=copy(tables),
            seq_lens=copy(ends.astype(np.int32)),
            query_start_loc=copy(cu.astype(np.int32)),
            host_lens=(ends, cu),
        )
        return copy(input_ids), copy(positions), meta, [seqs[i] for i in sampling], copy(logits_rows)

    def execute_lookahead_mixed(
        self, seqs: list[Sequence], num_new_tokens: list[int], decode_ids: torch.Tensor
    ) -> torch.Tensor:
        """A step of asynchronous scheduling with prompts in it: the first ``len(decode_ids)`` sequences
        decode the tokens still on the device (``execute_lookahead``), the others compute their
        ``num_new_tokens`` from the host, each to its end. Every row samples; returns the logits [n, V]."""
        self.late_point = None
        self.forward_passes += 1
        agreed = self._group_pass(None, sum(num_new_tokens))  # with several ranks: not a decode graph
        k = decode_ids.shape[0]
        batch = ScheduledBatch(seqs=seqs, num_new_tokens=num_new_tokens)
        input_ids, positions, meta, sample_seqs, rows = self.prepare(batch, in_flight=k)
        assert len(sample_seqs) == len(seqs)
        input_ids[:k] = decode_ids  # one token per decode row, at the start of the batch
        return self.model.compute_logits(self._forward(input_ids, positions, meta, agreed)[rows])

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, agreed: GroupPass
    ) -> torch.Tensor:
        """The model over a prepared batch that is not a decode-graph pass: on one rank, a piecewise
        prefill graph where one holds it, else eager; with several ranks, the prefill graphs of the
        agreed bucket, or eager when the ranks agreed on no graph."""
        pg = self.prefill_graphs
        if self._multi_rank:
            size = agreed.prefill
        else:
            size = pg.bucket_for(input_ids.shape[0]) if pg is not None else None
        if size is None:
            self.pass_kinds["eager"] += 1
            return self.model(input_ids, positions, self.kv_pool, meta)
        assert pg is not None
        self.pass_kinds["prefill_graph"] += 1
        return pg.run(input_ids, positions, meta, size)

    def execute(
        self,
        batch: ScheduledBatch,
        prompt_logprobs: bool = False,
        drafts: dict[Sequence, int] | None = None,
        keep_hidden: bool = False,
    ) -> Executed:
        """Run one step; returns the sequences that sample now, their logits [n, V] (fp32), and, when
        ``prompt_logprobs`` says some request of the batch may want them (the caller knows for free; the
        scan costs 40 us at batch 256), the prompt logprobs this step computed (``PromptLogprobRows``).
        ``keep_hidden``: the step's hidden states and layout come back too (``Executed.step``, for an MTP
        draft), so it replays no decode graph (whose output is the logits alone).

        After a graph replay the logits are a view of the graph's output buffer: use them before the
        next step."""
        self.late_point = None
        self.forward_passes += 1
        tokens = sum(batch.num_new_tokens)
        prompt_rows = PromptLogprobRows.of(batch) if prompt_logprobs else None
        pooling = any(s.pooling is not None for s in batch.seqs)  # needs hidden states: no decode graph
        decode_rows = (
            len(batch.seqs) if max(batch.num_new_tokens) == 1 and not (pooling or keep_hidden) else None
        )
        if keep_hidden and prompt_rows is None and self._rows_decode(batch, drafts or {}):
            return self._execute_rows(batch, drafts or {})
        agreed = self._group_pass(decode_rows, tokens)
        if agreed.decode is not None:
            return self._execute_decode_graph(batch.seqs, agreed.decode, prompt_rows)
        input_ids, positions, meta, sample_seqs, rows = self.prepare(batch)
        hidden = self._forward(input_ids, positions, meta, agreed)
        step = None
        if keep_hidden:  # what the MTP pass reads of the step's layout
            starts = np.fromiter(
                (s.num_computed_tokens for s in batch.seqs), dtype=np.int64, count=len(batch.seqs)
            )
            row_starts = np.zeros(len(batch.seqs) + 1, dtype=np.int64)
            np.cumsum(batch.num_new_tokens, out=row_starts[1:])
            step = MTPStep(hidden, positions, meta.slot_mapping, meta.block_tables, starts, row_starts)
        pooled: dict[Sequence, torch.Tensor] = {}
        if pooling:
            sample_seqs, rows = self._pool(batch, hidden, sample_seqs, rows, pooled)
        scored = (
            prompt_rows.compute(
                lambda r: self.model.compute_logits(hidden[r]), self.model.cfg.vocab_size, self.device
            )
            if prompt_rows
            else []
        )
        spec_logits: dict[Sequence, torch.Tensor] = {}
        if drafts:  # a drafting sequence's chunk is its last real token and its draft: logits for each
            ends = np.cumsum(batch.num_new_tokens)
            spans = [(seq, int(ends[i]) - drafts[seq] - 1, int(ends[i])) for i, seq in enumerate(batch.seqs)
                     if drafts.get(seq, 0)]  # fmt: skip
            index = torch.from_numpy(np.concatenate([np.arange(a, b) for _, a, b in spans])).to(hidden.device)
            every = self.model.compute_logits(hidden[index])  # one projection for every draft row
            first = 0
            for seq, a, b in spans:
                spec_logits[seq] = every[first : first + b - a]
                first += b - a
        if not sample_seqs:
            empty = hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
            return Executed([], empty, scored, spec_logits, pooled, step)
        logits = self.model.compute_logits(hidden[rows])
        return Executed(sample_seqs, logits, scored, spec_logits, pooled, step)

    def _rows_decode(self, batch: ScheduledBatch, drafts: dict[Sequence, int]) -> bool:
        """Whether ``_execute_rows`` runs the step: a latent-attention model on one rank, and every sequence
        decoding its last token and its draft (no prompt chunk, no embedding request)."""
        if self.model.cfg.mla is None or self._multi_rank:
            return False
        return all(
            s.pooling is None and n == 1 + drafts.get(s, 0) and s.num_computed_tokens + n == s.num_tokens
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )

    @torch.inference_mode()
    def _execute_rows(self, batch: ScheduledBatch, drafts: dict[Sequence, int]) -> Executed:
        """A step in which every sequence decodes its last token and its draft (an MTP draft's
        verification), each token a row of its own that attends to its sequence's context up to itself:
        the latent attention writes every row's KV before any row reads, so a draft's row sees the token
        before it. That is a decode batch of one token a row, which the decode graphs replay (with the
        final hidden states kept); without graphs, the eager forward over the same rows. Every sequence
        samples at its last row; a drafting one's rows are its ``spec_logits``."""
        seqs = batch.seqs
        n = len(seqs)
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        row_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=row_starts[1:])
        total = int(row_starts[-1])
        seq_of = np.repeat(np.arange(n), counts)
        positions = np.arange(total, dtype=np.int64) - row_starts[seq_of] + starts[seq_of]
        token_ids = np.fromiter(
            (t for s, a, c in zip(seqs, starts, counts, strict=True) for t in s.tokens(int(a), int(a + c))),
            dtype=np.int64,
            count=total,
        )
        bs, dev, graphs = self.block_size, self.device, self.graphs
        size = graphs.bucket_for(total) if graphs is not None else None
        if graphs is not None and size is not None:
            assert self._tables is not None and graphs.hidden is not None
            table_rows, width = self._tables.rows_for(seqs)
            rows = table_rows[seq_of]
            slots = self._tables.table[rows, positions // bs].astype(np.int64) * bs + positions % bs
            self.pass_kinds["decode_graph"] += 1
            logits = graphs.run(
                token_ids,
                positions,
                slots,
                (positions + 1).astype(np.int32),
                self._tables.table,
                rows,
                width,
                size,
            )
            self.late_point = graphs.late_point
            hidden, dev_positions, dev_slots = (
                graphs.hidden[:total],
                graphs.positions[:total],
                graphs.slot_mapping[:total],
            )
            seq_tables = graphs.block_tables[torch.from_numpy(row_starts[:-1]).to(dev)]
        else:
            tables = block_table_array(seqs)
            slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
            dev_positions, dev_slots = torch.from_numpy(positions).to(dev), torch.from_numpy(slots).to(dev)
            meta = AttentionMetadata(
                slot_mapping=dev_slots,
                block_tables=torch.from_numpy(tables[seq_of]).to(dev),
                seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(dev),
                query_start_loc=torch.arange(total + 1, dtype=torch.int32, device=dev),
                decode=True,
            )
            self.pass_kinds["eager"] += 1
            hidden = self.model(torch.from_numpy(token_ids).to(dev), dev_positions, self.kv_pool, meta)
            logits = self.model.compute_logits(hidden)
            seq_tables = torch.from_numpy(tables).to(dev)
        spec_logits = {
            s: logits[row_starts[i] : row_starts[i + 1]] for i, s in enumerate(seqs) if drafts.get(s, 0)
        }
        sampled = logits[torch.from_numpy(row_starts[1:] - 1).to(dev)]
        step = MTPStep(hidden, dev_positions, dev_slots, seq_tables, starts, row_starts)
        return Executed(list(seqs), sampled, [], spec_logits, {}, step)

    def _pool(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        sample_seqs: list[Sequence],
        rows: torch.Tensor,
        pooled: dict[Sequence, torch.Tensor],
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Each embedding request's chunk into its pooling (``engine.pooling``): those whose prompt ends
        here go into ``pooled``; returns the sequences that sample, and their rows, without them."""
        start = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.pooling is not None:
                vec = pool_chunk(seq, hidden[start : start + n], seq.num_computed_tokens, self.model.score)
                if vec is not None:
                    pooled[seq] = vec
            start += n
        keep = [i for i, s in enumerate(sample_seqs) if s.pooling is None]
        if len(keep) == len(sample_seqs):
            return sample_seqs, rows
        index = torch.tensor(keep, dtype=torch.long, device=rows.device)
        return [sample_seqs[i] for i in keep], rows.index_select(0, index)

    def execute_lookahead(self, seqs: list[Sequence], input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step whose input tokens are still on the device (asynchronous scheduling): token
        ``input_ids[i]``, not yet in sequence i's ``output_token_ids``, goes at position
        ``seqs[i].num_computed_tokens``, whose KV slot the block table already covers. Every row samples;
        returns the logits [n, V] (fp32; after a graph replay, a view valid until the next step)."""
        self.late_point = None
        self.forward_passes += 1
        n = len(seqs)
        positions = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        agreed = self._group_pass(n, n)
        self._set_lora_rows(seqs)
        if agreed.decode is not None:
            return self._replay_decode(seqs, positions, input_ids, agreed.decode)
        tables = block_table_array(seqs)
        bs = self.block_size
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        # Pinned, non-blocking copies: a pageable one would wait for the step still in flight, which is
        # what running ahead avoids.
        meta = AttentionMetadata(
            slot_mapping=host_to_device(torch.from_numpy(slots), dev),
            block_tables=host_to_device(torch.from_numpy(tables), dev),
            seq_lens=host_to_device(torch.from_numpy((positions + 1).astype(np.int32)), dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        )
        hidden = self._forward(input_ids, host_to_device(torch.from_numpy(positions), dev), meta, agreed)
        return self.model.compute_logits(hidden)

    def _set_lora_rows(self, seqs: list[Sequence], seq_index: np.ndarray | None = None) -> None:
        """With LoRA adapters: each row's adapter slot for the next pass (row i is sequence
        ``seq_index[i]``, else sequence i). Rows past them keep stale slots: padding, whose output is
        dropped, and every row's LoRA reads only its own slot."""
        slots = self.model.lora_slots
        if slots is None:
            return
        per_seq = np.fromiter((s.lora_slot for s in seqs), dtype=np.int64, count=len(seqs))
        slots.set_rows(per_seq if seq_index is None else per_seq[seq_index])

    def _execute_decode_graph(
        self, seqs: list[Sequence], size: int | None = None, prompt_rows: PromptLogprobRows | None = None
    ) -> Executed:
        n = len(seqs)
        positions = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        token_ids = np.fromiter((s.token_at(s.num_computed_tokens) for s in seqs), dtype=np.int64, count=n)
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=n)
        self._set_lora_rows(seqs)
        logits = self._replay_decode(seqs, positions, token_ids, size)
        # One token a sequence: the batch's token rows are the logits' rows.
        prompt_logprobs = (
            prompt_rows.compute(lambda r: logits[r], self.model.cfg.vocab_size, self.device)
            if prompt_rows
            else []
        )
        sampling = np.flatnonzero(positions + 1 == num_tokens)
        if len(sampling) == n:
            return Executed(seqs, logits, prompt_logprobs)
        # A one-token prefill chunk that is not the prompt's end takes part without sampling.
        index = host_to_device(torch.from_numpy(sampling), self.device)
        return Executed([seqs[i] for i in sampling], logits[index], prompt_logprobs)

    def _replay_decode(
        self,
        seqs: list[Sequence],
        positions: np.ndarray,
        token_ids: np.ndarray | torch.Tensor,
        size: int | None = None,
    ) -> torch.Tensor:
        assert self.graphs is not None and self._tables is not None
        rows, width = self._tables.rows_for(seqs)
        bs = self.block_size
        slots = self._tables.table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        self.pass_kinds["decode_graph"] += 1
        logits = self.graphs.run(token_ids, positions, slots, seq_lens, self._tables.table, rows, width, size)
        self.late_point = self.graphs.late_point
        return logits


def profile_sampling(sampler: Sampler, logits: torch.Tensor) -> None:
    """Sample every row of ``logits`` through each of the sampler's paths (``_WARM_UP_SAMPLES``, its
    parameters repeated over the rows): what a step of that many rows can hold while it samples."""
    rows = logits.shape[0]
    for params in _WARM_UP_SAMPLES:
        sampler.sample(logits, [params[i % len(params)] for i in range(rows)], [0] * rows)


def scratch_forward(model: DecoderModel, kv_pool: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """A forward pass of ``n`` tokens (ids 0, positions 0..n-1, one sequence) that writes nothing to
    the KV pool (every slot -1); its attention reads block 0, whatever it holds (a pool of one block
    does). Returns the hidden states. The caller restores the expert counters."""
    dev = kv_pool.device
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),  # -1: write nothing
        block_tables=torch.zeros((1, -(-n // block_size)), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        host_lens=(np.array([n]), np.array([0, n])),  # as a real prompt of n tokens: the MLA prefill's peak
    )
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    return model(ids, positions, kv_pool, meta)


def block_table_array(seqs: list[Sequence]) -> np.ndarray:
    """The sequences' block tables as one zero-padded [n, widest] int32 array."""
    tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return tables
