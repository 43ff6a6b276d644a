"""Decoder-only transformer covering Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3.

The differences between these architectures are flags of ``ModelConfig`` (q/k/v bias, per-head q/k
RMSNorm, MoE layers; DeepSeek-V3's latent attention and grouped routing, ``engine.models.mla``); weights
are stored fused (qkv, gate-up, expert w13) and every op goes through the ``kernels`` op table. The KV
cache is the block-major pool, addressed by ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.lora import LayerLoRA, LoRASlots
from engine.models.mla import GroupedMoEBlock, MLAttention
from engine.models.model_config import ModelConfig
from engine.models.rope_cache import cos_sin_cache
from engine.moe.dispatch import TokenDispatcher
from engine.moe.layer import MoEBlock
from kernels import Ops
from kernels.fp8_weight import Fp8Layout, empty_param, linear_weight
from kernels.kv_cache import FP8_KV_DTYPES


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in the context after this step
    query_start_loc: torch.Tensor  # [B+1] int32
    # Every sequence brings one query token (a decode graph's batch; its padding rows have seq_len 0):
    # ops that would otherwise read the layout on the host (the MLA reference) take a graph-safe path.
    decode: bool = False
    # seq_lens and query_start_loc on the host, where the pass's builder has them (``ModelRunner.prepare``'s
    # eager passes, the memory profile's): the MLA layer chooses each prompt's form by them, with no sync.
    host_lens: tuple[np.ndarray, np.ndarray] | None = None


class Attention(nn.Module):
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
        self.layer = layer
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = linear_weight((self.q_size + 2 * self.kv_size, cfg.hidden_size), fp8, dtype, device)
        self.qkv_bias = (
            empty_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
            if cfg.attention_bias
            else None
        )
        self.o_proj = linear_weight((cfg.hidden_size, self.q_size), fp8, dtype, device)
        self.q_norm = empty_param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = empty_param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        # The checkpoint's calibrated KV scales (``k_scale`` / ``v_scale``, set by the loader; 1.0 where it
        # has none), used with a float8 KV pool only: it stores k / k_scale and v / v_scale (vLLM's rule).
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def input_dim(self) -> int:
        """Per head, what ``project`` hands ``attend``: the rotated query."""
        return self.head_dim

    def project(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """From the QKV projection's output (the layer projects it with its input norm, see
        ``DecoderLayer.qkv``): q/k norms and RoPE; writes K and V into the pool at ``slot_mapping`` (-1:
        write nothing) and returns q [T, heads, head_dim] (in ``q_out`` where given)."""
        args = self._prologue_args(positions, cos_sin, kv_pool, slot_mapping)
        return self.ops.qkv_prologue(qkv, *args, out=q_out, **self.kv_scales(kv_pool))

    def project_and_attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``project`` then ``attend`` as one op, which a backend may fold into one kernel (the Triton one
        does for decode steps). Returns the attention output [T, heads, head_dim]."""
        return self.ops.qkv_attention(
            qkv,
            *self._prologue_args(positions, cos_sin, kv_pool, meta.slot_mapping),
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            **self.kv_scales(kv_pool),
        )

    def kv_scales(self, kv_pool: torch.Tensor) -> dict[str, float]:
        """The KV scales the pool's ops take: the layer's over a float8 pool, none over a 16-bit one."""
        if kv_pool.dtype in FP8_KV_DTYPES:
            return {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return {}

    def _prologue_args(
        self,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple:
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm, self.eps,
                positions, cos_sin, kv_pool, self.layer, slot_mapping)  # fmt: skip

    def attend(
        self, q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of q [T, heads, head_dim] over each sequence's cached context (into ``out`` where
        given); the only part of a layer that reads the batch's layout (``meta``)."""
        return self.ops.paged_attention(
            q,
            kv_pool,
            self.layer,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            out=None if out is None else out.view(q.shape),
            **self.kv_scales(kv_pool),
        )

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention result [T, heads, head_dim] (or [T, heads * head_dim])."""
        return self.ops.linear(o.reshape(-1, self.q_size), self.o_proj)


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        fp8: Fp8Layout | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = linear_weight((2 * inter, hidden), fp8, dtype, device)
        self.down_proj = linear_weight((hidden, inter), fp8, dtype, device)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus ``add`` where given (DeepSeek's routed experts' output beside its shared ones)."""
        return self.down(self.ops.linear(x, self.gate_up_proj), add)

    def down(self, gate_up: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP after its gate-up projection (which the layer fuses with its norm), plus ``add``."""
        return self.ops.silu_mul_linear(gate_up, self.down_proj, add)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        dispatcher: TokenDispatcher | None,
        physical_to_logical: list[int] | None,
        fp8: Fp8Layout | None = None,
        moe: bool | None = None,
    ) -> None:
        """``moe``: whether the MLP is an MoE block (None: as ``cfg.moe_layers`` says for ``layer``; a
        multi-token-prediction layer, numbered past the decoder's, says it itself)."""
        super().__init__()
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        if moe is None:
            moe = bool(cfg.moe_layers and cfg.moe_layers[layer])
        self.input_layernorm = empty_param(cfg.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm = empty_param(cfg.hidden_size, dtype=dtype, device=device)
        self.mla = cfg.mla is not None
        self.self_attn: Attention | MLAttention = (
            MLAttention(cfg, layer, ops, dtype, device, fp8)
            if self.mla
            else Attention(cfg, layer, ops, dtype, device, fp8)
        )
        self.mlp: nn.Module
        if cfg.routing is not None and moe:
            shared = (
                DenseMLP(
                    cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, ops, dtype, device, fp8
                )
                if cfg.n_shared_experts
                else None
            )
            self.mlp = GroupedMoEBlock(
                cfg,
                shared,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.moe_intermediate_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                ops=ops,
                dtype=dtype,
                device=device,
                physical_to_logical=physical_to_logical,
                dispatcher=dispatcher,
                fp8=fp8,
            )
        elif moe:
            self.mlp = MoEBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                ops,
                dtype,
                device,
                physical_to_logical=physical_to_logical,
                dispatcher=dispatcher,
                fp8=fp8,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, ops, dtype, device, fp8)
        # The served LoRA adapters' slots for this layer (engine.lora), set when the engine serves them.
        self.lora: LayerLoRA | None = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.qkv(x, residual)
        if isinstance(self.self_attn, MLAttention):
            o = self.self_attn(qkv, positions, cos_sin, kv_pool, meta, self.lora)
        else:
            o = self.self_attn.project_and_attend(qkv, positions, cos_sin, kv_pool, meta)
        return self.post_attention(o, residual)

    def qkv(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (adding the residual) with the QKV projection (and its bias; the latent
        attention's stacked query and latent projection). Returns the projection and the residual."""
        lora, attn = self.lora, self.self_attn
        mla = isinstance(attn, MLAttention)
        qkv, h, residual = self.ops.add_rms_norm_linear(
            x,
            residual,
            self.input_layernorm,
            self.eps,
            attn.qkv_a_proj if mla else attn.qkv_proj,
            lora is not None,
        )
        if lora is not None:
            qkv = lora.apply("qkv_a" if mla else "qkv", h, qkv)
        if not mla and attn.qkv_bias is not None:
            qkv = qkv + attn.qkv_bias
        return qkv, residual

    def pre_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to attention, for callers that run attention on its own (the prefill graphs):
        ``qkv`` and ``Attention.project`` (q into ``q_out`` where given). Returns q and the residual.
        Reads nothing of the batch's layout but the KV slots."""
        qkv, residual = self.qkv(x, residual)
        if isinstance(self.self_attn, MLAttention):
            q = self.self_attn.project(qkv, positions, cos_sin, kv_pool, slot_mapping, q_out, self.lora)
            return q, residual
        return self.self_attn.project(qkv, positions, cos_sin, kv_pool, slot_mapping, q_out), residual

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention: the output projection, the post-attention norm with the projection
        that reads it (the router, or the dense MLP's gate-up), and the MLP. Returns the layer's output and
        the residual."""
        lora = self.lora
        if lora is None:
            o = self.self_attn.output(o)
        else:
            flat = o.reshape(-1, self.self_attn.q_size)
            o = lora.apply("o", flat, self.self_attn.output(flat))
        if isinstance(self.mlp, MoEBlock):  # DeepSeek's float32 router reads h in float32 (the op promotes)
            logits, h, residual = self.ops.add_rms_norm_linear(
                o, residual, self.post_attention_layernorm, self.eps, self.mlp.gate, True
            )
            return self.mlp(h, logits), residual
        gate_up, h, residual = self.ops.add_rms_norm_linear(
            o, residual, self.post_attention_layernorm, self.eps, self.mlp.gate_up_proj, lora is not None
        )
        if lora is None:
            return self.mlp.down(gate_up), residual
        act = self.ops.silu_and_mul(lora.apply("gate_up", h, gate_up))
        return lora.apply("down", act, self.ops.linear(act, self.mlp.down_proj)), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        dispatcher: TokenDispatcher | None = None,
        physical_to_logical: list[list[int]] | None = None,
        fp8: Fp8Layout | None = None,
    ) -> None:
        """``fp8``: the attention, MLP and expert projections are kept in float8 in that layout (the
        router, the embeddings and the LM head stay in ``dtype``)."""
        super().__init__()
        self.cfg = cfg
        self.fp8 = fp8
        self.ops = ops
        self.dispatcher = dispatcher
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                i,
                ops,
                dtype,
                device,
                dispatcher,
                physical_to_logical[i] if physical_to_logical else None,
                fp8,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = empty_param(cfg.hidden_size, dtype=dtype, device=device)
        # A classifier has no LM head (it never generates; the passes that compute logits read the
        # embeddings, which costs no memory) and a ``score`` head, applied by engine.pooling.
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings or cfg.num_labels
            else empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.score = (
            empty_param(cfg.num_labels, cfg.hidden_size, dtype=dtype, device=device)
            if cfg.num_labels
            else None
        )
        self.lora_slots: LoRASlots | None = None  # the served LoRA adapters' slots (engine.lora)
        # DeepSeek-V3's multi-token-prediction layer (engine.models.mtp), set by the loader when the engine
        # drafts with it; its KV is the pool's layer after the decoder's.
        self.mtp: nn.Module | None = None
        self.register_buffer(
            "cos_sin",
            cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device),
            persistent=False,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.begin_forward()
        x = self.embed_tokens[input_ids]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, kv_pool, meta)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def final_logits(
        self, x: torch.Tensor, residual: torch.Tensor, hidden_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final norm and the LM head in one op (fused at batch 1), for callers that run the layers
        themselves and need the logits of every row (the decode graphs). Logits in x's dtype; the normed
        hidden states (``forward``'s output) into ``hidden_out`` where given."""
        logits, h, _ = self.ops.add_rms_norm_linear(
            x, residual, self.norm, self.cfg.rms_norm_eps, self.lm_head, hidden_out is not None
        )
        if hidden_out is not None:
            hidden_out.copy_(h)
        return logits

    def begin_forward(self) -> None:
        """Start of a forward pass (``forward`` calls it; so must callers that run the layers themselves)."""
        if self.dispatcher is not None:
            self.dispatcher.begin_forward()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head).float()

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]
