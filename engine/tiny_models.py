"""Built-in models ``tiny-dense``, ``tiny-moe`` and ``tiny-deepseek`` (DeepSeek-V3's latent attention and
grouped routing): fixed configs, deterministic random weights, byte tokenizer.

They let the whole mesh run with no checkpoint, and keep CPU tests quick.
"""

from __future__ import annotations

from engine.models.model_config import ModelConfig

TINY_VOCAB = 512


def _base(**kw: object) -> dict:
    cfg = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
    )
    cfg.update(kw)
    return cfg


TINY_MODELS: dict[str, dict] = {
    "tiny-dense": _base(architectures=["LlamaForCausalLM"]),
    "tiny-moe": _base(
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "tiny-deepseek": _base(
        architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_nextn_predict_layers=1,  # a multi-token-prediction layer, for speculative method mtp
    ),
}


def tiny_model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(TINY_MODELS[name]))
