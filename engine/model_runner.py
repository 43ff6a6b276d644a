"""Turns a scheduled batch into model inputs, runs the model, and returns the logits of sampling rows.

Batch metadata is built with vectorised numpy on the host and copied once to the device.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.decoder import AttentionMetadata, DecoderModel
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self, model: DecoderModel, kv_pool: torch.Tensor, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = device

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence], torch.Tensor]:
        seqs, counts = batch.seqs, batch.num_new_tokens
        starts = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        n_new = np.array(counts, dtype=np.int64)
        ends = starts + n_new
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n_new, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.empty(total, dtype=np.int64)
        for i, s in enumerate(seqs):
            a, b = int(starts[i]), int(ends[i])
            n_prompt = len(s.prompt_token_ids)
            if b <= n_prompt:
                input_ids[cu[i] : cu[i + 1]] = s.prompt_token_ids[a:b]
            else:
                input_ids[cu[i] : cu[i + 1]] = s.all_token_ids[a:b]
        seq_index = np.repeat(np.arange(len(seqs)), n_new)
        positions = np.arange(total, dtype=np.int64) - cu[seq_index] + starts[seq_index]
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        block_of = tables[seq_index, positions // self.block_size].astype(np.int64)
        slots = block_of * self.block_size + positions % self.block_size
        sampling = [i for i, s in enumerate(seqs) if ends[i] == s.num_tokens]
        logits_rows = cu[1:][sampling] - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            max_seq_len=int(ends.max()),
            max_query_len=int(n_new.max()),
        )
        return (
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            meta,
            [seqs[i] for i in sampling],
            torch.from_numpy(logits_rows).to(dev),
        )

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; returns the sequences that sample now and their logits [n, V] (fp32)."""
        input_ids, positions, meta, sample_seqs, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_pool, meta)
        if not sample_seqs:
            return [], hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return sample_seqs, self.model.compute_logits(hidden[rows])
