"""Small random-weight Hugging Face checkpoints written with transformers' own classes, for parity tests.

Weights are re-drawn with fan-in scaling (embeddings with unit variance) so that greedy decoding stays
varied instead of collapsing into one repeated token.
"""

from __future__ import annotations

import functools
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

# What the DeepSeek checkpoints below share: 8 routed experts of 32, a 32-value latent and 16 rotary values,
# one dense layer first, a shared expert, no query rank, two experts a token.
_DEEPSEEK: dict[str, Any] = dict(
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, first_k_dense_replace=1,
    n_shared_experts=1,
)  # fmt: skip

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
    # DeepSeek-V3: latent attention with a low-rank query, grouped routing (4 groups, 2 kept) with a choice
    # bias, a shared expert, a dense first layer, interleaved rotary rows.
    "deepseek_v3": dict(
        _DEEPSEEK,
        cls="DeepseekV3ForCausalLM",
        cfg="DeepseekV3Config",
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        q_lora_rank=48,
        v_head_dim=24,
        routed_scaling_factor=2.5,
    ),
    # No query projection rank, YaRN with DeepSeek's mscale (the softmax scale and the cos/sin factor).
    "deepseek_v3_yarn": dict(
        _DEEPSEEK,
        cls="DeepseekV3ForCausalLM",
        cfg="DeepseekV3Config",
        n_group=2,
        topk_group=1,
        qk_nope_head_dim=32,
        first_k_dense_replace=0,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    # DeepSeek-V2: softmax routing limited to the best groups (each scored by its best expert), scaled,
    # not renormalised; a low-rank query.
    "deepseek_v2": dict(
        _DEEPSEEK,
        cls="DeepseekV2ForCausalLM",
        cfg="DeepseekV2Config",
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        q_lora_rank=48,
        v_head_dim=24,
        routed_scaling_factor=1.5,
    ),
    # DeepSeek-V2-Lite's kind: greedy softmax routing, no query rank, two shared experts.
    "deepseek_v2_lite": dict(
        _DEEPSEEK,
        cls="DeepseekV2ForCausalLM",
        cfg="DeepseekV2Config",
        topk_method="greedy",
        qk_nope_head_dim=32,
        n_shared_experts=2,
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
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias: transformers zeroes it
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
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


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, generate: dict[str, Any] | None = None, **load: Any
) -> list[int]:
    """transformers' own greedy continuation of one prompt (EOS ignored), float32; ``generate``: more
    ``generate`` arguments (logits processors, penalties); ``load``: more ``from_pretrained`` arguments."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **load).eval()
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
            **(generate or {}),
        )
    return out[0, len(prompt) :].tolist()


FP8_FORMATS = ("fp8", "compressed-tensors", "modelopt")


def quantize_checkpoint(
    src: Path, dst: Path, fmt: str, block: tuple[int, int] = (16, 16)
) -> dict[str, torch.Tensor]:
    """A float8 copy of checkpoint ``src`` in ``dst``, every linear projection's weight (attention, MLP and
    experts; not the router, embeddings, norms or LM head) in float8 e4m3 with float32 scales, laid out as
    quantisation tools write them:

    - ``fp8``: transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3): ``weight_scale_inv`` per block of
      ``block`` (edge blocks partial where the block does not divide the weight), in quantization_config;
    - ``compressed-tensors``: llm-compressor's float-quantised, ``weight_scale`` [rows, 1] per output channel,
      a static ``input_scale`` beside it;
    - ``modelopt``: ModelOpt's FP8, one ``weight_scale`` per tensor, described in ``hf_quant_config.json``.

    Returns what each quantised weight stands for (float8 value x scale, float32), computed here with
    reshapes, independently of the loader."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    meant: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")):  # the latter: DeepSeek's latent
            out[name] = w
            continue
        rows, cols = w.shape
        if fmt == "fp8":
            b0, b1 = block
            g0, g1 = -(-rows // b0), -(-cols // b1)
            padded = torch.zeros(g0 * b0, g1 * b1)
            padded[:rows, :cols] = w.float()
            blocks = padded.reshape(g0, b0, g1, b1)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (
                (blocks / scale[:, None, :, None])
                .reshape(g0 * b0, g1 * b1)[:rows, :cols]
                .to(torch.float8_e4m3fn)
            )
            q_padded = torch.zeros(g0 * b0, g1 * b1)
            q_padded[:rows, :cols] = q.float()
            meant[name] = (q_padded.reshape(g0, b0, g1, b1) * scale[:, None, :, None]).reshape(g0 * b0, -1)
            meant[name] = meant[name][:rows, :cols]
            out[name], out[name + "_scale_inv"] = q, scale
        elif fmt == "compressed-tensors":
            scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            meant[name] = q.float() * scale
            out[name], out[name + "_scale"] = q, scale
            out[name[: -len("weight")] + "input_scale"] = torch.tensor([0.05])
        elif fmt == "modelopt":
            scale = w.float().abs().amax() / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            meant[name] = q.float() * scale
            out[name], out[name + "_scale"] = q, scale.reshape(())
            out[name[: -len("weight")] + "input_scale"] = torch.tensor(0.05)
        else:
            raise ValueError(fmt)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": list(block)}  # fmt: skip
    elif fmt == "compressed-tensors":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False},
            }},
        }  # fmt: skip
    else:
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
        (dst / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
        )
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            (dst / extra).write_bytes((src / extra).read_bytes())
    return meant


def write_weights(src: Path, dst: Path, replaced: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint ``src`` in ``dst`` (float32) with the tensors in ``replaced`` swapped in."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({name: t.contiguous() for name, t in replaced.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            (dst / extra).write_bytes((src / extra).read_bytes())
    return dst


def add_mtp_layer(src: Path, dst: Path, seed: int = 0, predictive: bool = False) -> Path:
    """A copy of DeepSeek-V3 checkpoint ``src`` in ``dst`` with a multi-token-prediction layer, as
    DeepSeek-V3's checkpoints hold theirs: ``model.layers.{num_hidden_layers}.*`` (a decoder layer's tensors,
    experts one by one, plus ``embed_tokens`` and ``shared_head.head`` copies of the model's own, ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``), ``num_nextn_predict_layers`` 1. Random values, scaled
    as ``make_checkpoint``'s.

    ``predictive``: a checkpoint whose drafts are mostly right, so that drafts are kept: every layer's output
    projections (attention and MLP, the decoder's and the MTP layer's) scaled by 0.05, so each layer adds
    little to its input and the main model mostly predicts from its last token; and the MTP layer's
    ``eh_proj`` reads mostly its token's embedding (an identity there), its head norm the model's final norm,
    so its prediction from the token at p + 1 is about the main model's at p + 1."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = json.loads((src / "config.json").read_text())
    config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    n = cfg["num_hidden_layers"]
    torch.manual_seed(seed)
    block = DeepseekV3DecoderLayer(config, layer_idx=n)
    _scale_weights(block, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    main = load_file(str(src / "model.safetensors"))
    h = cfg["hidden_size"]
    pre = f"model.layers.{n}."
    eh = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    enorm = 1.0 + 0.1 * torch.randn(h, generator=gen)
    head_norm = 1.0 + 0.1 * torch.randn(h, generator=gen)
    replaced: dict[str, torch.Tensor] = {}
    state = block.state_dict()
    if predictive:
        eh = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1) + 0.05 * eh
        enorm = torch.ones(h)
        head_norm = main["model.norm.weight"].clone()
        out_projections = ("o_proj.weight", "down_proj.weight", "down_proj")
        for name in [k for k in main if k.endswith(out_projections)]:
            replaced[name] = main[name] * 0.05
        for name in [k for k in state if k.endswith(out_projections)]:
            state[name] = state[name] * 0.05
    inter = cfg["moe_intermediate_size"]
    for name, t in state.items():
        if name == "mlp.experts.gate_up_proj":  # one expert at a time, as DeepSeek's checkpoints are
            for e in range(t.shape[0]):
                replaced[f"{pre}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                replaced[f"{pre}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                replaced[f"{pre}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            replaced[pre + name] = t
    replaced.update({
        pre + "embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        pre + "enorm.weight": enorm,
        pre + "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
        pre + "eh_proj.weight": eh,
        pre + "shared_head.norm.weight": head_norm,
        pre + "shared_head.head.weight": main["lm_head.weight"].clone(),
    })  # fmt: skip
    write_weights(src, dst, replaced)
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return dst


def mtp_reference_logits(path: Path, tokens: list[int], chain: int = 1) -> torch.Tensor:
    """transformers' computation of checkpoint ``path``'s MTP layer over a whole sequence (float32, no
    cache): row p is its logits for token p + 2, from the main model's final hidden state at p (after the
    final norm) and the embedding of token p + 1 (zeroed at position 0): [len(tokens) - 1, V].

    ``chain`` > 1: then the layer again, as vLLM runs one MTP layer for several draft tokens, each time on
    the last row's argmax and its own output (before the head's norm), one row further: ``chain - 1``
    more rows, each the logits of the draft token after the last one."""
    model, block, tensors = _mtp_reference_parts(str(path))
    config = model.config
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    def rows_in(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat([norm(embeds, tensors["enorm.weight"]), norm(hidden, tensors["hnorm.weight"])], dim=-1)
        return x @ tensors["eh_proj.weight"].t()

    def layer(x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        positions = torch.arange(length).unsqueeze(0)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # causal, additive
        out = block(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=model.model.rotary_emb(x, positions))  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    def head(out: torch.Tensor) -> torch.Tensor:
        return norm(out, tensors["shared_head.norm.weight"]) @ tensors["shared_head.head.weight"].t()

    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        embeds = tensors["embed_tokens.weight"][ids[:, 1:]]
        embeds[:, 0] = 0.0  # position 0
        x = rows_in(embeds, hidden)
        out = layer(x)
        logits = [head(out)[0]]
        for _ in range(chain - 1):
            draft = int(logits[-1][-1].argmax())
            x = torch.cat(
                [x, rows_in(tensors["embed_tokens.weight"][torch.tensor([[draft]])], out[:, -1:])], dim=1
            )
            out = layer(x)
            logits.append(head(out[:, -1:])[0])
        return torch.cat(logits)


@functools.lru_cache(maxsize=4)
def _mtp_reference_parts(path: str) -> tuple[Any, torch.nn.Module, dict[str, torch.Tensor]]:
    """transformers' model of checkpoint ``path``, a ``DeepseekV3DecoderLayer`` holding its MTP layer's
    block, and the MTP layer's own tensors (by name within the layer)."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config
    n = config.num_hidden_layers
    pre = f"model.layers.{n}."
    tensors = {
        k[len(pre) :]: v for k, v in load_file(f"{path}/model.safetensors").items() if k.startswith(pre)
    }
    block = DeepseekV3DecoderLayer(config, layer_idx=n).eval()
    state = {k: v for k, v in tensors.items() if not k.startswith(("mlp.experts.", "embed_tokens", "enorm",
             "hnorm", "eh_proj", "shared_head"))}  # fmt: skip
    experts = config.n_routed_experts
    if "mlp.experts.gate_up_proj" in block.state_dict():  # experts as 3D tensors (transformers 5's)
        state["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(experts)
        ])  # fmt: skip
        state["mlp.experts.down_proj"] = torch.stack(
            [tensors[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
        )
    else:  # one module an expert
        state.update({k: v for k, v in tensors.items() if k.startswith("mlp.experts.")})
    block.load_state_dict(state)
    return model, block, tensors
