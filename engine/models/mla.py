"""DeepSeek-V2's and V3's layers: multi-head latent attention (MLA) and the MoE block with grouped routing and
shared experts. The decoder (``engine.models.decoder``) takes them where ``ModelConfig.mla`` and
``ModelConfig.routing`` say so; the rest of the layer (norms, residuals, dense MLPs) is the common one.

MLA keeps one latent a token a layer in the KV pool (``kernels.mla_attention``): the normalised
``kv_lora_rank`` values and the shared rotary key, split across the pool's K and V halves. Attention runs
in the latent space (the key projection ``W_uk`` absorbed into the queries, the value projection ``W_uv``
applied to the output, both slices of ``kv_b_proj``), as vLLM and SGLang run MLA for decode. A prompt chunk long
enough that it is less arithmetic (``takes_unabsorbed``) attends unabsorbed instead (``ops.mla_prefill``: its
context's latents up-projected into every head's keys and values, then causal attention of ``nope + rope``
dimensions a head), as their prefill does; the other sequences of the pass stay absorbed.

Float8 weights (a DeepSeek-V3 checkpoint's own, or ``quantization="fp8"``) keep the query and latent
projections, the output projection, the MLPs and the experts in float8 (``kernels.fp8_weight``); ``kv_b_proj``
stays in the model's dtype, widened at load, since both its halves are absorbed (vLLM widens it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.models.model_config import ModelConfig
from engine.moe.layer import MoEBlock
from kernels import Ops
from kernels.fp8_weight import Fp8Layout, as_dense, empty_param, linear_weight

if TYPE_CHECKING:
    from engine.lora import LayerLoRA
    from engine.models.decoder import AttentionMetadata, DenseMLP


def rotary_row_order(cfg: ModelConfig, proj: str) -> torch.Tensor:
    """The order the loader takes a DeepSeek projection's rows in (row i of the model's weight is the
    checkpoint's row ``order[i]``): the rotary rows from the checkpoint's interleaved pairs (x0, x1), (x2, x3),
    ... into rotate-half order, evens then odds (transformers' ``rope_interleave``), the others in place.
    ``proj``: ``"q"`` (q_b_proj, or q_proj without a query rank: each head's nope rows, then its rotary
    rows) or ``"kv_a"`` (kv_a_proj_with_mqa: the latent's rows, then the rotary key's)."""
    mla = cfg.mla
    assert mla is not None
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if proj == "kv_a":
        return torch.cat([torch.arange(mla.kv_lora_rank), mla.kv_lora_rank + pairs])
    if proj != "q":
        raise ValueError(f"rotary_row_order: proj is 'q' or 'kv_a', not {proj!r}")
    order = torch.arange(cfg.num_heads * (nope + rope)).view(cfg.num_heads, nope + rope)
    order[:, nope:] = order[:, nope:][:, pairs]
    return order.reshape(-1)


def takes_unabsorbed(n: np.ndarray, seq_len: np.ndarray, attn: MLAttention) -> np.ndarray:
    """Whether each sequence's ``n`` queries (its last ``n`` of ``seq_len`` tokens; arrays, or ints) attend in
    the unabsorbed form (vLLM's and SGLang's for prefill): where it is less arithmetic a head than the
    absorbed one. The absorbed form takes ``2 rank + rope`` multiply-adds a (query, key) pair; the unabsorbed
    ``nope + rope + v_dim`` a pair plus ``(nope + v_dim) x rank`` a key to up-project it (Moonlight's and
    V3's shapes: from ~340 tokens of a prompt without a cached prefix). A decode token never does."""
    n, seq_len = np.asarray(n, dtype=np.int64), np.asarray(seq_len, dtype=np.int64)
    pairs = n * (seq_len - n) + n * (n + 1) // 2
    absorbed = pairs * (2 * attn.rank + attn.rope)
    unabsorbed = pairs * (attn.nope + attn.rope + attn.v_dim) + seq_len * (attn.nope + attn.v_dim) * attn.rank
    return (n > 1) & (unabsorbed < absorbed)


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        fp8: Fp8Layout | None = None,
    ) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer, self.ops, self.eps = layer, ops, cfg.rms_norm_eps
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank, self.latent = mla.kv_lora_rank, mla.latent_dim
        qk = self.nope + self.rope
        self.q_size = cfg.num_heads * self.v_dim  # the output projection's input
        self.scale = qk**-0.5 * cfg.attention_scale_factor
        kw = {"dtype": dtype, "device": device}
        self.q_lora = mla.q_lora_rank is not None
        # The query projection (V3: its down-projection q_a_proj; V2-Lite, Moonlight: q_proj) and the latent's
        # (kv_a_proj_with_mqa) read the same normalised row: one weight, their rows stacked, so that one GEMV
        # (fused with the input norm at batch 1) computes both, as vLLM's fused_qkv_a_proj.
        self.q_rows = mla.q_lora_rank if mla.q_lora_rank is not None else cfg.num_heads * qk
        self.qkv_a_proj = linear_weight((self.q_rows + self.latent, cfg.hidden_size), fp8, dtype, device)
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = empty_param(mla.q_lora_rank, **kw)
            self.q_b_proj = linear_weight((cfg.num_heads * qk, mla.q_lora_rank), fp8, dtype, device)
        self.kv_a_layernorm = empty_param(self.rank, **kw)
        self.kv_b_proj = empty_param(cfg.num_heads * (self.nope + self.v_dim), self.rank, **kw)
        self.o_proj = linear_weight((cfg.hidden_size, self.q_size), fp8, dtype, device)
        # A checkpoint's calibrated KV scales (set by the loader, as ``decoder.Attention``'s): a float8 pool
        # stores the latent unscaled (vLLM's default for MLA), so the engine refuses one with scales.
        self.k_scale = self.v_scale = 1.0

    @property
    def q_proj(self) -> torch.Tensor:
        """The query projection's rows of ``qkv_a_proj`` (V3's q_a_proj where it has a query rank): a view,
        or the rows a float8 weight stands for."""
        return as_dense(self.qkv_a_proj)[: self.q_rows]

    q_a_proj = q_proj

    @property
    def kv_a_proj_with_mqa(self) -> torch.Tensor:
        return as_dense(self.qkv_a_proj)[self.q_rows :]

    @property
    def input_dim(self) -> int:
        """Per head, what ``project`` hands ``attend``: the query projection's nope part, then the
        prologue's absorbed query and rotated rotary part (nope + rank + rope values)."""
        return self.nope + self.rank + self.rope

    def forward(
        self,
        qkv_a: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        """Attention of the normalised hidden states' ``qkv_a_proj`` [T, q_rows + latent]: writes each
        token's latent into the pool at ``meta.slot_mapping`` and returns the heads' outputs
        [T, heads * v_head_dim]. ``lora``: the layer's adapters (V3's q_b_proj takes its own)."""
        q_nope, qa = self._queries(qkv_a, positions, cos_sin, kv_pool, meta.slot_mapping, lora)
        return self._attend(q_nope, qa, kv_pool, meta)

    def project(
        self,
        qkv_a: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        """``forward`` up to attention, for callers that run attention on its own (the prefill graphs):
        writes the latents into the pool at ``slot_mapping`` and returns [T, heads, ``input_dim``] (in
        ``q_out`` where given), which ``attend`` takes. Reads nothing of the batch's layout but the slots."""
        q_nope, qa = self._queries(qkv_a, positions, cos_sin, kv_pool, slot_mapping, lora)
        out = q_out if q_out is not None else qa.new_empty((qa.shape[0], self.num_heads, self.input_dim))
        out[..., : self.nope] = q_nope
        out[..., self.nope :] = qa
        return out

    def attend(
        self,
        q_in: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``project``'s output over each sequence's cached context: [T, heads * v_head_dim]
        (into ``out`` where given); the only part of the layer that reads the batch's layout."""
        o = self._attend(q_in[..., : self.nope], q_in[..., self.nope :], kv_pool, meta)
        if out is None:
            return o
        out.copy_(o)
        return out

    def _queries(
        self,
        qkv_a: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        lora: LayerLoRA | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query projection's nope part [T, heads, nope] (a view) and the prologue's output (the latents
        written into the pool): the absorbed and rotated queries [T, heads, rank + rope]."""
        ops = self.ops
        q, kv = qkv_a[:, : self.q_rows], qkv_a[:, self.q_rows :]
        if self.q_lora:
            q, h, _ = ops.add_rms_norm_linear(
                q, None, self.q_a_layernorm, self.eps, self.q_b_proj, lora is not None
            )
            if lora is not None:
                q = lora.apply("q_b", h, q)
        qa = ops.mla_prologue(
            q, kv, positions, cos_sin, self.kv_a_layernorm, self.eps, self.w_kv, kv_pool, self.layer, slot_mapping
        )  # fmt: skip
        return q.view(q.shape[0], self.num_heads, self.nope + self.rope)[..., : self.nope], qa

    @property
    def w_kv(self) -> torch.Tensor:
        """``kv_b_proj`` viewed [heads, nope + v_head_dim, rank]: each head's key rows, then its value rows."""
        return self.kv_b_proj.view(self.num_heads, self.nope + self.v_dim, self.rank)

    def _attend(
        self, q_nope: torch.Tensor, qa: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """[T, heads * v_head_dim]: prompts long enough unabsorbed (``_prefill``), the rest absorbed."""
        if not meta.decode and meta.host_lens is not None:
            prompts = self._unabsorbed(*meta.host_lens)
            if len(prompts):
                return self._prefill(q_nope, qa, kv_pool, meta, prompts)
        o = self.ops.mla_attention(
            qa,
            kv_pool,
            self.layer,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.rank,
            decode=meta.decode,
        )
        return self.ops.mla_value_proj(o, self.w_kv, self.v_dim)

    def _unabsorbed(self, seq_lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The pass's sequences whose queries attend in the unabsorbed form (``takes_unabsorbed``), indices."""
        return np.flatnonzero(takes_unabsorbed(np.diff(starts), seq_lens, self))

    def _prefill(
        self,
        q_nope: torch.Tensor,
        qa: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        prompts: np.ndarray,
    ) -> torch.Tensor:
        """A prompt pass with the ``prompts`` sequences unabsorbed (``ops.mla_prefill``, from the query
        projection's q_nope and the prologue's rotated q_pe) and the others absorbed, as ``forward``."""
        ops, heads, v_dim, w_kv = self.ops, self.num_heads, self.v_dim, self.w_kv
        seq_lens, starts = meta.host_lens  # type: ignore[misc]
        q_pe = qa[..., self.rank :]
        out = qa.new_empty((qa.shape[0], heads, v_dim))
        for b in prompts:
            q0, q1 = int(starts[b]), int(starts[b + 1])
            out[q0:q1] = ops.mla_prefill(
                q_nope[q0:q1], q_pe[q0:q1], kv_pool, self.layer, meta.block_tables[b], int(seq_lens[b]),
                w_kv, self.scale,
            )  # fmt: skip
        lens = np.diff(starts)
        absorbed = np.ones(len(lens), dtype=bool)
        absorbed[prompts] = False
        absorbed &= lens > 0
        if absorbed.any():  # the other sequences' rows (decodes, short chunks) through the absorbed ops
            dev = qa.device
            rows = torch.from_numpy(np.flatnonzero(np.repeat(absorbed, lens))).to(dev)
            index = torch.from_numpy(np.flatnonzero(absorbed)).to(dev)
            qsl = np.concatenate([[0], np.cumsum(lens[absorbed])]).astype(np.int32)
            o = ops.mla_attention(
                qa[rows], kv_pool, self.layer, meta.block_tables[index], meta.seq_lens[index],
                torch.from_numpy(qsl).to(dev), self.scale, self.rank,
            )  # fmt: skip
            out[rows] = ops.mla_value_proj(o, w_kv, v_dim).view(-1, heads, v_dim)
        return out.view(qa.shape[0], heads * v_dim)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(o.reshape(-1, self.q_size), self.o_proj)


class GroupedMoEBlock(MoEBlock):
    """DeepSeek's MoE block: the router in float32 (its weight and V3's choice bias are float32, as
    transformers keeps them), grouped routing (``kernels.moe_routing.moe_route_grouped_torch``), the
    routed experts as ``MoEBlock``'s (replicas, counters, expert-parallel dispatch), plus the shared
    experts (a dense MLP every token takes)."""

    def __init__(self, cfg: ModelConfig, shared: DenseMLP | None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        assert cfg.routing is not None
        self.routing = cfg.routing
        device = self.gate.device
        self.gate = empty_param(*self.gate.shape, dtype=torch.float32, device=device)
        # V3's choice bias (a buffer: V2 has none and keeps it zero; V3 checkpoints all carry theirs).
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.num_logical, dtype=torch.float32, device=device)
        )
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``router_logits``: x @ gate.T in float32, where the layer computed them with its norm."""
        logits = (
            router_logits if router_logits is not None else torch.nn.functional.linear(x.float(), self.gate)
        )
        p, r = self.placement, self.routing
        topk_w, topk_phys = self.ops.moe_route_grouped(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            r.n_group,
            r.topk_group,
            self.norm_topk_prob,
            r.routed_scaling_factor,
            p.logical_to_physical,
            p.replica_counts,
            self.expert_counts,
            x.dtype,
            self.count_live,
            softmax=r.softmax,
        )
        out = self.dispatcher.run(x, topk_w, topk_phys, self.num_physical, self._experts)
        return out if self.shared_experts is None else self.shared_experts(x, add=out)
