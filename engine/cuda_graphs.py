"""Decode steps captured as CUDA graphs, one per bucketed batch size, over static input buffers.

Owns the graphs, their static inputs (token ids, positions, KV slots, sequence lengths, query starts,
block tables), the pinned host staging those inputs are copied from, and the static logits buffer. A
decode batch of ``n`` sequences replays the graphs of the smallest bucket ``>= n``: rows ``n..bucket``
are padding (token 0, position 0, slot -1, seq_len 0), which the Triton ops skip (no KV write, attention
over no keys). Logits of every row are computed inside the graphs. One step is two host-to-device copies,
one device copy of the block-table rows and the launches of the step's pieces; nothing in it synchronises
the host. Under asynchronous scheduling the token ids come from the previous step's sampled-token tensor
by one more device copy, so the host never reads them before the launch.

A step is captured as a few graphs of ``LAYERS_PER_GRAPH`` layers each rather than one: launching a graph
costs host time in proportion to its kernels (about 1 ms for a 48-layer MoE model's ~1,500), which the
measured step times showed was not overlapped with device work; with pieces the device runs piece i
while the host launches piece i+1 (docs/gpu.md has the numbers).

It must not decide which batches run as graphs (``engine.model_runner`` does), and it needs the Triton op
table: the PyTorch reference ops read device values on the host and cannot be captured.

MoE expert counters (for the EPLB controller) are updated inside the graph for the live rows only: the
routing kernel reads the static ``seq_lens`` (0 on padding rows) it was captured with
(``counting_live_rows``), so a padded replay needs no correction.

With several expert-parallel ranks the capture is collective (every rank captures the same sizes, in the
same order, and the MoE layers' token exchanges are captured as NCCL collectives of a fixed size, under
the dispatcher's ``uniform_batches``). Each step the ranks then replay graphs of one agreed size, each
with its own real rows and the rest padding (``run``'s ``size``; ``run_padding`` for a rank with none).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.decoder import AttentionMetadata, DecoderModel
from engine.moe.dispatch import SingleRankDispatcher
from kernels.decode_megakernel import DecodeMegakernel

log = logging.getLogger(__name__)

# Batch sizes that get a graph (those up to max_num_seqs, plus max_num_seqs itself when it is not one).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
MAX_GRAPH_BATCH = BUCKETS[-1]
LAYERS_PER_GRAPH = 8


# A capture tolerates other threads' CUDA calls (the default, "global", fails the capture when any thread
# makes a call that is unsafe during capture, such as destroying another engine's graph or synchronising);
# the capturing thread itself must still make none, which ``capturing`` sees to for the garbage collector.
CAPTURE_ERROR_MODE = "thread_local"


@contextmanager
def capturing() -> Iterator[None]:
    """Around a series of graph captures: collect garbage first, then keep Python's cyclic collector off
    until the block ends.

    A collection inside a capture may finalise an unreachable engine's CUDA graphs (a previous engine in the
    same process, kept by a reference cycle), and destroying a graph is not permitted while a stream
    captures: the capture fails later with "operation failed due to a previous error during capture"
    (seen intermittently in the GPU tests, which build engines one after another). torch no longer collects
    at the start of each capture, so this does, once, and defers collections to the end."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def expert_counts_restored(model: DecoderModel) -> Iterator[None]:
    """The MoE blocks' expert counters (for the EPLB controller) as they were on entry, once the block
    exits: for forward passes over no real tokens (graph capture and its calibration replays, warm-ups)."""
    counts = [blk.expert_counts for blk in model.moe_blocks()]
    saved = [c.clone() for c in counts]
    try:
        yield
    finally:
        for count, before in zip(counts, saved, strict=True):
            count.copy_(before)


@contextmanager
def counting_live_rows(model: DecoderModel, live: torch.Tensor) -> Iterator[None]:
    """While graphs are captured: the MoE blocks' routing counts only the rows ``live`` marks (nonzero: a
    decode graph's ``seq_lens``, a prefill graph's live rows), so a replay's padding rows count for no
    expert, whatever replicas they route to. The graphs keep reading ``live``; eager passes count every row."""
    blocks = model.moe_blocks()
    for blk in blocks:
        blk.count_live = live
    try:
        yield
    finally:
        for blk in blocks:
            blk.count_live = None


def decode_step_pieces(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: AttentionMetadata,
    logits_out: torch.Tensor,
    layers_per_piece: int = LAYERS_PER_GRAPH,
    hidden_out: torch.Tensor | None = None,
) -> list[Callable[[], None]]:
    """``DecoderModel.forward`` followed by ``final_logits`` into ``logits_out`` (and the final hidden
    states into ``hidden_out`` where given), cut into callables that run in order, ``layers_per_piece``
    decoder layers each (each becomes one graph). The hidden state and residual pass between pieces
    through ``state``, which the captured graphs keep addressing."""
    layers = list(model.layers)
    bounds = list(range(0, len(layers), layers_per_piece)) + [len(layers)]
    state: dict[str, torch.Tensor | None] = {}

    def piece(lo: int, hi: int) -> Callable[[], None]:
        @torch.inference_mode()
        def run() -> None:
            if lo == 0:
                model.begin_forward()
                state["x"], state["residual"] = model.embed_tokens[input_ids], None
            x, residual = state["x"], state["residual"]
            for layer in layers[lo:hi]:
                x, residual = layer(x, residual, positions, model.cos_sin, kv_pool, meta)
            if hi == len(layers):
                # one copy: converts to fp32 too
                logits_out.copy_(model.final_logits(x, residual, hidden_out))
            state["x"], state["residual"] = x, residual

        return run

    return [piece(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def megakernel_step_pieces(
    model: DecoderModel,
    megakernel: DecodeMegakernel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_out: torch.Tensor,
) -> list[Callable[[], None]]:
    """``decode_step_pieces`` for one row with every decoder layer in the megakernel's one launch, then the
    final norm and LM head: a single piece (it is three launches, so there is no host time to overlap)."""

    @torch.inference_mode()
    def run() -> None:
        model.begin_forward()
        x, residual = megakernel.run(
            input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
        )
        logits_out.copy_(model.final_logits(x, residual))

    return [run]


def smallest_bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending captured ``sizes`` that holds ``n``; None when ``n`` is too large."""
    return next((size for size in sizes if size >= n), None)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    cap = max(1, min(max_num_seqs, MAX_GRAPH_BATCH))
    return [b for b in BUCKETS if b < cap] + [cap]


@dataclass
class _Graph:
    size: int
    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    runs: list[Callable[[], None]] = field(default_factory=list)  # keeps the pieces' shared state alive

    def replay(self, late_point: torch.cuda.Event | None = None) -> None:
        """Launch the pieces in order; ``late_point`` is recorded after the second-to-last one (with a
        single piece, before it)."""
        for i, piece in enumerate(self.pieces):
            if late_point is not None and i == max(0, len(self.pieces) - 1):
                late_point.record()
            piece.replay()


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool, with their static buffers."""

    def __init__(
        self,
        model: DecoderModel,
        kv_pool: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        megakernel: DecodeMegakernel | None = None,
        specialize_lora: bool = True,
        keep_hidden: bool = False,
    ) -> None:
        """``megakernel``: where given, the batch-1 graph runs every decoder layer in it
        (``kernels.decode_megakernel``) instead of the op-by-op pieces. ``specialize_lora``: with LoRA
        adapters, every size is captured twice, with the LoRA ops and without; the second set is replayed
        for steps no row of which has an adapter (and for padding passes). ``keep_hidden``: every replay
        also leaves the rows' final hidden states in ``hidden`` (for an MTP draft, engine.models.mtp)."""
        self.model = model
        self.megakernel = megakernel
        self.lora = model.lora_slots if specialize_lora else None
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_batch = b = self.sizes[-1]
        self.max_blocks = max_blocks
        self.device = device
        # int64 inputs side by side in one buffer (one copy per step): ids | positions | slots.
        self._dev64 = torch.zeros(3 * b, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.split(b)
        # int32 inputs: seq_lens | the batch's block-table rows, packed [n, width] (then copied into place).
        self._dev32 = torch.zeros(b + b * max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = self._dev32[:b]
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # one token each
        self.logits = torch.zeros((b, model.cfg.vocab_size), dtype=torch.float32, device=device)
        self.hidden = (
            torch.zeros((b, model.cfg.hidden_size), dtype=model.embed_tokens.dtype, device=device)
            if keep_hidden
            else None
        )
        self._host64 = torch.zeros(3 * b, dtype=torch.int64).pin_memory()
        self._host32 = torch.zeros(b + b * max_blocks, dtype=torch.int32).pin_memory()
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        # Recorded in each step ``run`` launches, before its last piece: where a serving loop may launch
        # the next step and still keep the device busy (``LLMEngine.wait_for_lookahead_point``).
        self.late_point = torch.cuda.Event()
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.graphs: dict[int, _Graph] = {}
        self.graphs_without_lora: dict[int, _Graph] = {}  # with ``lora``: the same sizes, no LoRA op
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # per bucket, for tests and stats
        self.replays_without_lora: dict[int, int] = dict.fromkeys(self.sizes, 0)  # of those
        self.capture_seconds = 0.0

    def bucket_for(self, n: int) -> int | None:
        """Smallest captured batch size that holds ``n`` sequences; None when ``n`` is too large."""
        return smallest_bucket(self.sizes, n)

    # ---- capture ---------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (the smaller ones reuse it)."""
        started = time.perf_counter()
        self._stage_padding(0, self.max_batch)
        self._dev64.copy_(self._host64)
        self._dev32[: self.max_batch].copy_(self._host32[: self.max_batch])
        pool = torch.cuda.graph_pool_handle()
        # Warm-ups and calibration replays see no real tokens: the expert counters are restored. Every
        # pass in here has the graph's batch on every rank. With several expert-parallel ranks the
        # padding rows (seq_len 0) route to no expert: the pack before the exchange marks their pairs
        # absent, reading the static seq_lens, so it costs no launch.
        uniform = (self.model.dispatcher or SingleRankDispatcher()).uniform_batches(self.seq_lens)
        live = counting_live_rows(self.model, self.seq_lens)
        with capturing(), expert_counts_restored(self.model), uniform, live:
            for size in reversed(self.sizes):
                self._capture_size(size, pool)
            if self.lora is not None:
                with self.lora.without_lora():
                    for size in reversed(self.sizes):
                        self._capture_size(size, pool, self.graphs_without_lora)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        log.info(
            "captured decode CUDA graphs for batch %s (%d pieces each%s) in %.1f s",
            ",".join(map(str, self.sizes)),
            len(self.graphs[self.max_batch].pieces),
            ", with and without the LoRA ops" if self.graphs_without_lora else "",
            self.capture_seconds,
        )

    def _capture_size(self, size: int, pool: tuple[int, int], into: dict[int, _Graph] | None = None) -> None:
        pieces = self._pieces(size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for run in pieces:
                run()
        torch.cuda.current_stream().wait_stream(side)
        g = _Graph(size, runs=pieces)
        for run in pieces:  # in order: each piece's outputs, in the pool, are the next one's inputs
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
                run()
            g.pieces.append(graph)
        (self.graphs if into is None else into)[size] = g

    def set_megakernel(self, megakernel: DecodeMegakernel | None) -> None:
        """Run the batch-1 graph with (or, given None, without) the decode megakernel: that graph alone is
        captured again (benchmarks compare both in one engine). Single-rank engines only."""
        if 1 not in self.graphs:
            raise ValueError("no batch-1 decode graph was captured")
        if getattr(self.model.dispatcher, "ep_size", 1) != 1:  # the ranks capture together
            raise ValueError("set_megakernel recaptures one rank's graph alone: single-rank engines only")
        torch.cuda.synchronize()
        for piece in self.graphs.pop(1).pieces:
            piece.reset()
        self.megakernel = megakernel
        self._stage_padding(0, 1)
        self._dev64.copy_(self._host64)
        self._dev32[:1].copy_(self._host32[:1])
        with capturing(), expert_counts_restored(self.model), counting_live_rows(self.model, self.seq_lens):
            self._capture_size(1, torch.cuda.graph_pool_handle())
        torch.cuda.synchronize()

    def _pieces(self, size: int) -> list[Callable[[], None]]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            decode=True,
        )
        if size == 1 and self.megakernel is not None and self.hidden is None:
            return megakernel_step_pieces(
                self.model, self.megakernel, self.input_ids[:1], self.positions[:1], meta, self.logits[:1]
            )
        return decode_step_pieces(
            self.model, self.input_ids[:size], self.positions[:size], self.kv_pool, meta, self.logits[:size],
            hidden_out=None if self.hidden is None else self.hidden[:size],
        )  # fmt: skip

    def release(self) -> None:
        """Free every captured graph now (not when the last reference goes): a graph that captured NCCL
        collectives keeps their communicator busy. The object cannot replay afterwards."""
        for graphs in (self.graphs, self.graphs_without_lora):
            for g in graphs.values():
                for piece in g.pieces:
                    piece.reset()
                g.pieces.clear()
            graphs.clear()

    # ---- replay ----------------------------------------------------------------------------------
    def replay(self, size: int) -> None:
        """Launch the step of batch ``size`` on the inputs staged last (benchmarks time this alone)."""
        self._graph(size, with_rows=True).replay()

    def _graph(self, size: int, with_rows: bool) -> _Graph:
        """The graph of ``size`` for the next pass: without the LoRA ops where those were captured and no
        row has an adapter (``with_rows`` False: padding only)."""
        if self.graphs_without_lora and not (with_rows and self.lora.rows.any_adapter):
            return self.graphs_without_lora[size]
        return self.graphs[size]

    def _stage_padding(self, start: int, stop: int) -> None:
        b = self.max_batch
        self._np64[start:stop] = 0  # token ids
        self._np64[b + start : b + stop] = 0  # positions
        self._np64[2 * b + start : 2 * b + stop] = -1  # slots: write nothing
        self._np32[start:stop] = 0  # seq_lens: attend to nothing

    def run(
        self,
        token_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        tables: np.ndarray,
        rows: np.ndarray,
        width: int,
        size: int | None = None,
    ) -> torch.Tensor:
        """One decode step of ``n = len(token_ids)`` sequences; sequence i's block table is
        ``tables[rows[i], :width]``. Returns the logits ``[n, vocab]`` (fp32): a view of the static
        buffer, valid until the next replay. It replays the graph of ``size`` (a captured size of at least
        ``n``: the size the expert-parallel ranks agreed on), by default the smallest that holds ``n``.

        ``token_ids`` may be a device tensor (int64), such as the previous step's sampled tokens: it is
        copied into the static input ids on the device, after the staged inputs, without the host
        reading it (asynchronous scheduling)."""
        n = len(token_ids)
        size = size or self.bucket_for(n)
        if size is None:
            raise ValueError(f"a decode batch of {n} exceeds the largest captured graph ({self.max_batch})")
        if size not in self.graphs or size < n:
            raise ValueError(f"no captured decode graph of batch {size} holds {n} sequences")
        b = self.max_batch
        self._copied.synchronize()  # the previous step's copies have left the staging buffers
        on_device = isinstance(token_ids, torch.Tensor)
        self._np64[:n] = 0 if on_device else token_ids
        self._np64[b : b + n] = positions
        self._np64[2 * b : 2 * b + n] = slots
        self._np32[:n] = seq_lens
        if size > n:
            self._stage_padding(n, size)
        packed = self._np32[b : b + n * width].reshape(n, width)
        np.take(tables[:, :width], rows, axis=0, out=packed)
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32[: b + n * width].copy_(self._host32[: b + n * width], non_blocking=True)
        self._copied.record()
        if on_device:
            self.input_ids[:n].copy_(token_ids)
        self.block_tables[:n, :width].copy_(self._dev32[b : b + n * width].view(n, width))
        self._replay_padded(size, n)
        return self.logits[:n]

    def run_padding(self, size: int) -> None:
        """Replay the graph of batch ``size`` with padding rows only (an expert-parallel rank with nothing
        to run joins the others' step): nothing is written to the KV pool, the logits are dropped, and no expert
        counts a row."""
        self._copied.synchronize()
        self._stage_padding(0, size)
        b = self.max_batch
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32[:b].copy_(self._host32[:b], non_blocking=True)
        self._copied.record()
        self._replay_padded(size, 0)

    def _replay_padded(self, size: int, n: int) -> None:
        """Launch the graph of ``size`` whose first ``n`` rows are real and the rest padding (staged: seq_len
        0, so they count for no expert)."""
        graph = self._graph(size, with_rows=n > 0)
        graph.replay(self.late_point)
        self.replays[size] += 1
        if graph is not self.graphs[size]:
            self.replays_without_lora[size] += 1
