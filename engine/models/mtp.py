"""DeepSeek-V3's multi-token-prediction (MTP) layer, served as a speculative draft (vLLM's
``--speculative-config '{"method": "mtp"}'``, formerly ``deepseek_mtp``).

A DeepSeek-V3 (or R1) checkpoint holds ``num_nextn_predict_layers`` such layers after its decoder's, as
``model.layers.{num_hidden_layers}.*``. The first predicts the token after next: at position p it reads the
main model's final hidden state h_p (after the final norm, as vLLM and SGLang hand it over) and the
embedding of the token at p + 1:

    x      = eh_proj([enorm(embed(t[p + 1])), hnorm(h_p)])    (the embedding zeroed at position 0, as vLLM does)
    h'     = block(x)                                          (a whole decoder layer: latent attention, MoE)
    logits = shared_head.head(shared_head.norm(h'))            (they predict t[p + 2])

Its attention reads its own KV, the pool's layer after the decoder's (``num_layers``), which is written
for every position once its next token is known, so it fills along with the decoder's and goes wherever
their blocks go (prefix cache, KV transfers, the offload store). After each step the engine runs the layer
over the rows whose next token that step made known (``MTPStep.draft``) and takes its argmax at each
decoding request's last row as the next step's draft, which that step verifies as n-gram drafts are
verified (engine.speculative): the output is the one plain decoding gives. For drafts of K tokens
(``num_speculative_tokens``) the layer runs K - 1 more times (``chain_step``), each on the last draft token
and its own output h' one position further, as vLLM runs one MTP layer for several tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.cuda_graphs import CAPTURE_ERROR_MODE, bucket_sizes, capturing, smallest_bucket
from engine.models.decoder import AttentionMetadata, DecoderLayer, DecoderModel
from engine.models.model_config import ModelConfig
from kernels import Ops
from kernels.fp8_weight import Fp8Layout, empty_param


class MTPLayer(nn.Module):
    """The checkpoint's first MTP layer. ``embed_tokens`` and ``head`` are the main model's own tensors
    where the checkpoint's copies equal them (DeepSeek-V3's do; the loader makes them one). With ``fp8``
    its decoder layer's projections are float8 as the model's are; ``eh_proj`` stays in ``dtype`` (vLLM's
    too), widened at load where the checkpoint stores it in float8."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        fp8: Fp8Layout | None = None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        h = cfg.hidden_size
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.embed_tokens = empty_param(cfg.vocab_size, h, **kw)
        self.enorm = empty_param(h, **kw)
        self.hnorm = empty_param(h, **kw)
        self.eh_proj = empty_param(h, 2 * h, **kw)
        # Its KV is the pool's layer ``num_layers``; all its experts on every rank (with several expert-
        # parallel ranks each drafts for its own sequences: the layer's pass exchanges nothing).
        self.block = DecoderLayer(cfg, cfg.num_layers, ops, dtype, device, None, None, fp8, moe=cfg.mtp_moe)
        self.head_norm = empty_param(h, **kw)
        self.head = empty_param(cfg.vocab_size, h, **kw)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output [T, hidden] for the tokens ``ids`` that follow the positions ``positions``,
        whose main-model hidden states are ``hidden``; writes the layer's KV at ``meta.slot_mapping``."""
        ops = self.ops
        embeds = self.embed_tokens[ids].masked_fill((positions == 0).unsqueeze(1), 0.0)
        x = ops.linear(
            torch.cat(
                [ops.rms_norm(embeds, self.enorm, self.eps), ops.rms_norm(hidden, self.hnorm, self.eps)], -1
            ),
            self.eh_proj,
        )
        x, residual = self.block(x, None, positions, cos_sin, kv_pool, meta)
        return x + residual

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] (float32) of the tokens two positions after each row's."""
        return self.ops.linear(self.ops.rms_norm(h, self.head_norm, self.eps), self.head).float()


@dataclass
class MTPStep:
    """What the MTP pass needs of the step just run (``ModelRunner.execute`` with ``keep_hidden``): its
    final hidden states, each row's position and KV slot, and each sequence's block-table row, first
    position and first row."""

    hidden: torch.Tensor  # [T, hidden], after the final norm
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, width] int32
    starts: np.ndarray  # [B]: each sequence's first position in the step
    row_starts: np.ndarray  # [B + 1]: each sequence's first row (cumulative token counts)

    @torch.inference_mode()
    def draft(
        self, model: DecoderModel, kv_pool: torch.Tensor, kept: np.ndarray, next_ids: np.ndarray,
        drafting: np.ndarray, graphs: MTPGraphs | None = None, decode_rows: int = 2,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Run the MTP layer over the first ``kept[i]`` rows of each sequence i of the step (those whose
        next token is known: ``next_ids``, sequence by sequence), writing its KV for them; returns its
        argmax and its output (before the head's norm) at the last of them for each sequence in
        ``drafting`` (indices, in order). When no sequence brings more than ``decode_rows`` rows (a decode
        step: a token and its kept drafts) each row is a query of its own, the latent attention's decode
        path, and the pass replays ``graphs`` where given and one holds its rows."""
        seqs = np.flatnonzero(kept)
        counts = kept[seqs]
        ends = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=ends[1:])
        rows = np.repeat(self.row_starts[seqs] - ends[:-1], counts) + np.arange(int(ends[-1]))
        dev = self.hidden.device
        index = torch.from_numpy(rows).to(dev)
        if counts.max() <= decode_rows:
            # Each row a query of its own over its context up to itself (the layer writes every row's KV
            # before any row reads): the latent attention's decode path, graph-safe and the Triton kernel's.
            seq_of = np.repeat(seqs, counts)
            row_positions = self.starts[seq_of] + np.arange(len(rows)) - np.repeat(ends[:-1], counts)
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[index],
                block_tables=self.block_tables[torch.from_numpy(seq_of).to(dev)],
                seq_lens=torch.from_numpy((row_positions + 1).astype(np.int32)).to(dev),
                query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
                decode=True,
            )
        else:  # prompt chunks: each sequence's rows one ragged query
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[index],
                block_tables=self.block_tables[torch.from_numpy(seqs).to(dev)],
                seq_lens=torch.from_numpy((self.starts[seqs] + counts).astype(np.int32)).to(dev),
                query_start_loc=torch.from_numpy(ends.astype(np.int32)).to(dev),
                # On the host too: a long prompt's rows attend unabsorbed, as in the model's own passes.
                host_lens=(self.starts[seqs] + counts, ends),
            )
        ids = torch.from_numpy(np.asarray(next_ids, dtype=np.int64)).to(dev)
        last = torch.from_numpy(ends[1:][np.searchsorted(seqs, drafting)] - 1).to(dev)
        return mtp_pass(model, kv_pool, ids, self.positions[index], self.hidden[index], meta, graphs, last)


def mtp_pass(
    model: DecoderModel, kv_pool: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
    hidden: torch.Tensor, meta: AttentionMetadata, graphs: MTPGraphs | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The MTP layer over rows ``ids`` at ``positions`` whose preceding hidden states are ``hidden``: the
    argmax and output (before the head's norm) of the rows ``rows`` (None: every row; a prompt chunk's
    pass wants its last rows' alone). A decode layout (``meta.decode``) replays ``graphs`` where given and
    one holds the rows (every row then: views of its static buffers, valid until its next replay, where
    ``rows`` is None)."""
    if meta.decode and graphs is not None and graphs.bucket_for(ids.shape[0]) is not None:
        tokens, h = graphs.run(ids, positions, hidden, meta)
        return (tokens, h) if rows is None else (tokens[rows], h[rows])
    mtp = model.mtp
    assert isinstance(mtp, MTPLayer)
    h = mtp(ids, positions, hidden, model.cos_sin, kv_pool, meta)
    if rows is not None:
        h = h[rows]
    return mtp.logits(h).argmax(dim=-1), h


@torch.inference_mode()
def chain_step(
    model: DecoderModel, kv_pool: torch.Tensor, block_size: int, tables: np.ndarray, positions: np.ndarray,
    tokens: torch.Tensor, hidden: torch.Tensor, graphs: MTPGraphs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One more draft token for each of n sequences (vLLM's ``num_speculative_tokens`` > 1 with one MTP
    layer): the layer again, at ``positions`` (one past each sequence's previous draft row), on its
    previous draft ``tokens`` and its own previous output ``hidden``, writing its KV there (``tables``:
    the sequences' block tables, covering those positions). What it writes at positions not computed yet
    is overwritten by the pass over them once they are. Returns the new drafts and outputs."""
    dev = kv_pool.device
    n = len(positions)
    blocks = tables[np.arange(n), positions // block_size].astype(np.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(blocks * block_size + positions % block_size).to(dev),
        block_tables=torch.from_numpy(tables).to(dev),
        seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        decode=True,
    )
    return mtp_pass(model, kv_pool, tokens, torch.from_numpy(positions).to(dev), hidden, meta, graphs)


class MTPGraphs:
    """The MTP passes of decode steps (each row a query of its own) as one CUDA graph a bucket of rows (the
    decode graphs' buckets): the layer, its head, every row's argmax and output. Eager, a pass is one
    layer's launches from the host, more than the decode graph it follows takes at small batches. Padding
    rows write nothing (slot -1) and attend to nothing (seq_len 0)."""

    def __init__(
        self, model: DecoderModel, kv_pool: torch.Tensor, max_rows: int, max_blocks: int, device: torch.device
    ) -> None:
        self.model, self.kv_pool = model, kv_pool
        self.sizes = bucket_sizes(max_rows)
        b = self.sizes[-1]
        self.ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((b, model.cfg.hidden_size), dtype=model.embed_tokens.dtype, device=device)
        self.tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.out = torch.zeros_like(self.hidden)  # each row's output, before the head's norm
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.sizes, n)

    def _pass(self, size: int) -> None:
        mtp = self.model.mtp
        assert isinstance(mtp, MTPLayer)
        meta = AttentionMetadata(
            self.slots[:size], self.block_tables[:size], self.seq_lens[:size], self.query_start_loc[: size + 1],
            decode=True,
        )  # fmt: skip
        h = mtp(
            self.ids[:size], self.positions[:size], self.hidden[:size], self.model.cos_sin, self.kv_pool, meta
        )
        self.out[:size].copy_(h)
        self.tokens[:size].copy_(mtp.logits(h).argmax(dim=-1))

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first, into one memory pool; the warm-ups run on padding rows only."""
        pool = torch.cuda.graph_pool_handle()
        with capturing():
            for size in reversed(self.sizes):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # Triton compiles, cuBLAS picks its kernels
                    self._pass(size)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
                    self._pass(size)
                self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass over ``len(ids)`` rows (device tensors; ``meta`` with a decode layout); returns each
        row's argmax and output (views of the static buffers, valid until the next replay)."""
        n = ids.shape[0]
        size = self.bucket_for(n)
        assert size is not None
        width = meta.block_tables.shape[1]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.hidden[:n].copy_(hidden)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
        self.graphs[size].replay()
        self.replays += 1
        return self.tokens[:n], self.out[:n]
