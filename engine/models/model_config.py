"""The subset of a Hugging Face ``config.json`` the engine needs, normalised across architectures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# The decoder alone, as transformers' base-model classes save it (no LM head): read as its family, which
# then only embeds (engine.pooling) unless its embeddings are tied to the LM head.
BASE_MODEL_ARCHITECTURES = {a.replace("ForCausalLM", "Model"): a for a in SUPPORTED_ARCHITECTURES}
# The decoder with a classification head on its last token's state (transformers'
# ``*ForSequenceClassification``: ``score``, num_labels x hidden, no bias): read as its family, which then
# only classifies or embeds (engine.pooling), never generates.
CLASSIFIER_ARCHITECTURES = {
    a.replace("ForCausalLM", "ForSequenceClassification"): a for a in SUPPORTED_ARCHITECTURES
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[bool] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    # A sequence classifier's labels (config.json's id2label, by id); empty for every other checkpoint.
    labels: list[str] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        # A base model's checkpoint (transformers' ``AutoModel``, e.g. an embedding model): its family.
        given = list(archs)
        archs = [BASE_MODEL_ARCHITECTURES.get(a, CLASSIFIER_ARCHITECTURES.get(a, a)) for a in archs]
        classifier = any(a in CLASSIFIER_ARCHITECTURES for a in given)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r}; supported: default, llama3"
                )
            if rope_type == "default":
                rope_scaling = None
        num_layers = cfg["num_hidden_layers"]
        num_experts = 0
        top_k = 0
        moe_inter = 0
        moe_layers = [False] * num_layers
        norm_topk = True
        if arch == "Qwen3MoeForCausalLM":
            num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
            top_k = cfg["num_experts_per_tok"]
            moe_inter = cfg["moe_intermediate_size"]
            norm_topk = bool(cfg.get("norm_topk_prob", False))
            step = cfg.get("decoder_sparse_step", 1) or 1
            mlp_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = [
                (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
            ]
        elif arch == "MixtralForCausalLM":
            num_experts = cfg["num_local_experts"]
            top_k = cfg["num_experts_per_tok"]
            moe_inter = cfg["intermediate_size"]
            norm_topk = True
            moe_layers = [True] * num_layers
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg.get("intermediate_size", 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_inter,
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            eos_token_ids=eos_ids,
            labels=_labels(cfg) if classifier else [],
        )


def _labels(cfg: dict[str, Any]) -> list[str]:
    """A classifier's label names by id: config.json's ``id2label`` (transformers writes ``LABEL_i`` when
    none were named), else ``num_labels`` unnamed ones."""
    id2label = cfg.get("id2label") or {}
    n = len(id2label) or int(cfg.get("num_labels") or 2)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]
