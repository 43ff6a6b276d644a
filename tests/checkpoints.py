"""Small random-weight Hugging Face checkpoints written with transformers' own classes, for parity tests.

Weights are re-drawn with fan-in scaling (embeddings with unit variance) so that greedy decoding stays
varied instead of collapsing into one repeated token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 384

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

ARCHS: dict[str, dict[str, Any]] = {
    # GQA 2:1, head_dim that is not hidden/heads, llama3 rope scaling.
    "llama": dict(
        cls="LlamaForCausalLM",
        cfg="LlamaConfig",
        head_dim=24,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    # q/k/v bias, tied embeddings, GQA 4:1.
    "qwen2": dict(
        cls="Qwen2ForCausalLM",
        cfg="Qwen2Config",
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # q/k norms, head_dim 32 with hidden 64 and 4 heads, no GQA.
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", head_dim=32, num_key_value_heads=4),
    # MoE with norm_topk_prob False, a dense first layer (mlp_only_layers) and decoder_sparse_step.
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM",
        cfg="Qwen3MoeConfig",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        num_hidden_layers=4,
    ),
    "qwen3_moe_norm": dict(
        cls="Qwen3MoeForCausalLM",
        cfg="Qwen3MoeConfig",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        num_hidden_layers=4,
    ),
    "mixtral": dict(
        cls="MixtralForCausalLM",
        cfg="MixtralConfig",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
    ),
}


def _scale_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.copy_(
                    1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                    if "norm" in name or "layernorm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen)
                )
            elif "embed_tokens" in name:
                # Tied output embeddings make a large input embedding predict itself: keep it small then.
                scale = 0.1 if model.config.tie_word_embeddings else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            else:
                # Sharper attention (q and k doubled) keeps small random models from looping on one token.
                gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * gain * p.shape[-1] ** -0.5)


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level tokenizer.json (one token per byte, specials after) plus tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_tokens = {tok: i for i, tok in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab = dict(byte_tokens)
    specials = ["<s>", "</s>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}",
            }
        )
    )


def make_checkpoint(
    arch: str, path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    import transformers

    spec = dict(BASE)
    spec.update(ARCHS[arch])
    spec.update(overrides)
    cls = getattr(transformers, spec.pop("cls"))
    cfg_cls = getattr(transformers, spec.pop("cfg"))
    config = cfg_cls(**spec)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _scale_weights(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    write_tokenizer(path)
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of one prompt (EOS ignored), float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
