"""Prefill (and mixed) steps as piecewise CUDA graphs: each layer's work outside attention is captured,
attention runs eagerly between the pieces.

An eager prefill launches every kernel from Python: a Qwen3-30B-A3B layer is about ten Triton launches,
three cuBLAS calls and a few torch ops, and at 512 tokens the host's ~40 ms of launches outlast the
device's ~13 ms of work (docs/performance.md, "Eighth run"). Attention is the only op that reads the
batch's layout (sequence starts, context lengths, block tables), so, as vLLM's piecewise graphs do, the
step is cut at attention: piece 0 is the embedding and layer 0 up to attention (``pre_attention``: norm,
QKV, q/k norm, RoPE, KV write), piece i the rest of layer i-1 (``post_attention``: o-proj, norm, MLP or
MoE) and layer i up to attention, the last piece the rest of the last layer and the final norm. One graph
per piece and bucket of token counts; a step of ``n`` tokens replays the smallest bucket ``>= n``. DeepSeek's
latent attention is cut the same way: its ``project`` (projections, prologue, the latents written) ends a
piece, and its eager ``attend`` (absorbed, or unabsorbed for long prompts) reads what that left in
``attn_in`` (each head's nope query beside the absorbed and rotated one).

Rows ``n..bucket`` are padding: token 0, position 0, KV slot -1 (nothing written). Attention runs on the
real rows only and its output goes into a static buffer whose padding rows are zero, so every padding row
computes the same values in every step: as in ``engine/cuda_graphs.py``, a replay with padding only
measures what one padding row adds to the MoE expert counters, and padded steps subtract it. With several
expert-parallel ranks the padding rows' (token, expert) pairs run on no rank (``live``): a rank
whose decode batch joins another rank's long prefill pads to that prefill's bucket, and its padding rows,
all routed alike, would otherwise pile onto the same few experts.

Only for the Triton ops on a GPU. With several expert-parallel ranks the capture is collective (every
rank captures the same buckets in the same order, the MoE layers' token exchanges captured as NCCL
collectives of a fixed size under the dispatcher's ``uniform_batches``, as the decode graphs do), and the
ranks replay one agreed bucket together, each with its own real rows and the rest padding (``run``'s
``size``; ``run_padding`` for a rank with none). ``engine.model_runner`` decides which steps take the
graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from engine.cuda_graphs import (
    CAPTURE_ERROR_MODE,
    capturing,
    counting_live_rows,
    expert_counts_restored,
    smallest_bucket,
)
from engine.models.decoder import AttentionMetadata, DecoderModel
from engine.moe.dispatch import SingleRankDispatcher

log = logging.getLogger(__name__)

# Token counts that get a graph, up to the configured largest (which is added when it is not one).
PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)


def prefill_bucket_sizes(max_tokens: int) -> list[int]:
    if max_tokens < 1:
        return []
    return [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]


class PrefillGraphs:
    """Piecewise graphs of one model's forward over one KV pool, per bucket of token counts."""

    def __init__(
        self,
        model: DecoderModel,
        kv_pool: torch.Tensor,
        max_tokens: int,
        device: torch.device,
        specialize_lora: bool = True,
    ):
        """``specialize_lora``: with LoRA adapters, every bucket is captured twice, with the LoRA ops and
        without; the second set is replayed for steps no row of which has an adapter (and padding passes)."""
        self.model = model
        self.lora = model.lora_slots if specialize_lora else None
        self.kv_pool = kv_pool
        self.device = device
        self.sizes = prefill_bucket_sizes(max_tokens)
        self.max_tokens = b = self.sizes[-1]
        cfg = model.cfg
        # int64 inputs side by side (one copy per step): ids | positions | slots.
        self._dev64 = torch.zeros(3 * b, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.split(b)
        self.slot_mapping.fill_(-1)
        # Attention's input, written by a piece, and its output, read by the next piece (padding rows
        # stay zero). Static: a piece's own q lives in the graphs' pool, where a later piece may reuse it.
        dtype = model.embed_tokens.dtype
        attn = model.layers[0].self_attn  # the latent attention's input and output differ from q's shape
        self.attn_in = torch.zeros((b, cfg.num_heads, attn.input_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((b, attn.q_size), dtype=dtype, device=device)
        # Which rows are real (True) and which padding, set before each replay of a MoE model: the padding
        # rows' (token, expert) pairs count for no expert (``counting_live_rows``) and, with several
        # expert-parallel ranks, run on no rank (``uniform_batches``' live).
        self.live = torch.ones(b, dtype=torch.bool, device=device)
        self._rows = torch.arange(b, device=device)
        self._masks_padding = bool(model.moe_blocks())
        # Per (bucket, with the LoRA ops): the pieces' graphs, their shared state (residual, hidden) and
        # their eager runs. Without ``lora`` only the first kind.
        self._graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self._state: dict[tuple[int, bool], dict[str, torch.Tensor]] = {}
        self._runs: dict[tuple[int, bool], list[Callable[[], None]]] = {}
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # per bucket, for tests and stats
        self.replays_without_lora: dict[int, int] = dict.fromkeys(self.sizes, 0)  # of those
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # device memory the capture reserved (the graphs' pool), measured after it

    def bucket_for(self, n: int) -> int | None:
        """Smallest captured token count that holds ``n`` tokens; None when ``n`` is too large."""
        return smallest_bucket(self.sizes, n)

    def release(self) -> None:
        """Free every captured graph now (``DecodeGraphs.release``); the object cannot replay afterwards."""
        for graphs in self._graphs.values():
            for graph in graphs:
                graph.reset()
        self._graphs.clear()

    # ---- pieces ----------------------------------------------------------------------------------
    def _pieces(self, key: tuple[int, bool]) -> list[Callable[[], None]]:
        model = self.model
        layers = list(model.layers)
        size = key[0]
        ids, positions, slots = self.input_ids[:size], self.positions[:size], self.slot_mapping[:size]
        attn_in, attn_out = self.attn_in[:size], self.attn_out[:size]
        state = self._state.setdefault(key, {})

        def first() -> None:
            model.begin_forward()
            _, state["residual"] = layers[0].pre_attention(
                model.embed_tokens[ids], None, positions, model.cos_sin, self.kv_pool, slots, q_out=attn_in
            )

        def middle(i: int) -> Callable[[], None]:
            def run() -> None:
                x, residual = layers[i - 1].post_attention(attn_out, state["residual"])
                _, state["residual"] = layers[i].pre_attention(
                    x, residual, positions, model.cos_sin, self.kv_pool, slots, q_out=attn_in
                )

            return run

        def last() -> None:
            x, residual = layers[-1].post_attention(attn_out, state["residual"])
            state["hidden"], _ = model.ops.fused_add_rms_norm(x, residual, model.norm, model.cfg.rms_norm_eps)

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    def _forward(self, key: tuple[int, bool], n: int, meta: AttentionMetadata | None, replay: bool) -> None:
        """The pieces of ``key`` (bucket, with the LoRA ops) in order (replayed, or run eagerly), with
        attention over the first ``n`` rows between them (none when ``n`` is 0)."""
        layers = self.model.layers
        q = self.attn_in[:n]
        out = self.attn_out[:n]  # attention writes the next piece's input in place
        with torch.inference_mode():
            for i in range(len(layers) + 1):
                if replay:
                    self._graphs[key][i].replay()
                else:
                    self._runs[key][i]()
                if i < len(layers) and n > 0:
                    assert meta is not None
                    layers[i].self_attn.attend(q, self.kv_pool, meta, out=out)

    # ---- capture ---------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. Before each capture the pieces run
        once eagerly on padding only (Triton compiles, cuBLAS picks its kernels; no KV is written), with
        attention over the first row as a one-token sequence between them. Collective with several
        expert-parallel ranks: every pass in here has the bucket's token count on every rank."""
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        live = counting_live_rows(self.model, self.live)
        with capturing(), expert_counts_restored(self.model), self.uniform_batches(), live:
            for size in reversed(self.sizes):
                self._capture_size(size, True, pool)
            if self.lora is not None:
                with self.lora.without_lora():
                    for size in reversed(self.sizes):
                        self._capture_size(size, False, pool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info(
            "captured prefill CUDA graphs for %s tokens (%d pieces each%s) in %.1f s; %.0f MiB more reserved",
            ",".join(map(str, self.sizes)),
            len(self.model.layers) + 1,
            ", with and without the LoRA ops" if self.lora is not None else "",
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )

    def _capture_size(self, size: int, with_lora: bool, pool: tuple[int, int]) -> None:
        key = (size, with_lora)
        self._runs[key] = self._pieces(key)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
        )
        self.live.fill_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(key, 1, meta, replay=False)
        torch.cuda.current_stream().wait_stream(side)
        self.attn_out.zero_()
        graphs = []
        for run in self._runs[key]:  # in order: each piece's outputs are the next one's inputs
            graph = torch.cuda.CUDAGraph()
            with (
                torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE),
                torch.inference_mode(),
            ):
                run()
            graphs.append(graph)
        self._graphs[key] = graphs

    def uniform_batches(self) -> AbstractContextManager[None]:
        """The dispatcher's ``uniform_batches`` for these graphs' passes (their capture)."""
        return (self.model.dispatcher or SingleRankDispatcher()).uniform_batches(self.live)

    # ---- replay ----------------------------------------------------------------------------------
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        size: int | None = None,
    ) -> torch.Tensor:
        """The forward of ``n = len(input_ids)`` tokens laid out by ``meta`` (device tensors, as
        ``ModelRunner.prepare`` builds them), in the graphs of bucket ``size`` (by default the smallest
        that holds them; with several ranks, the one the ranks agreed on). Returns the final hidden states
        [n, hidden]: a view of the graphs' memory, valid until the next replay of this bucket."""
        size, n = self.stage(input_ids, positions, meta.slot_mapping, size)
        key = self._replay_padded(size, n, meta)
        return self._state[key]["hidden"][:n]

    def run_padding(self, size: int) -> None:
        """Replay bucket ``size`` with padding rows only (an expert-parallel rank with nothing to run joins
        the others' step): nothing is written to the KV pool, and no expert counts a row."""
        empty = self.input_ids[:0]
        self.stage(empty, empty, empty, size)
        self._replay_padded(size, 0, None)

    def _replay_padded(self, size: int, n: int, meta: AttentionMetadata | None) -> tuple[int, bool]:
        """Replay bucket ``size`` for ``n`` real rows: without the LoRA ops where those graphs exist and no
        row has an adapter (the runner set the rows before). Returns the graphs' key."""
        with_lora = self.lora is None or (n > 0 and self.lora.rows.any_adapter)
        key = (size, with_lora)
        self._forward(key, n, meta, replay=True)
        self.replays[size] += 1
        if not with_lora:
            self.replays_without_lora[size] += 1
        return key

    def stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        size: int | None = None,
    ) -> tuple[int, int]:
        """Copy a step's inputs into the static buffers and reset the padding rows; returns the bucket
        (``size``, or the smallest that holds the tokens) and the number of real tokens."""
        n = input_ids.shape[0]
        if size is None:
            size = self.bucket_for(n)
        elif size not in self.sizes or size < n:
            raise ValueError(f"no {size}-token prefill graph holds a step of {n} tokens")
        if size is None:
            raise ValueError(
                f"a prefill of {n} tokens exceeds the largest captured graph ({self.max_tokens})"
            )
        b = self.max_tokens
        if self._masks_padding:
            torch.lt(self._rows, n, out=self.live)
        self.input_ids[:n].copy_(input_ids)  # device to device: prepare() staged them already
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        if size > n:  # padding rows: token 0, position 0, no KV slot, zero attention output
            self._dev64[n:size].zero_()
            self._dev64[b + n : b + size].zero_()
            self._dev64[2 * b + n : 2 * b + size].fill_(-1)
            self.attn_out[n:size].zero_()
        return size, n
