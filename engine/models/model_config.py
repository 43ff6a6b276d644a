"""The subset of a Hugging Face ``config.json`` the engine needs, normalised across architectures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
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


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank projection, keys
    and values from one latent a token (``kv_lora_rank`` values, normalised) plus a shared rotary key
    (``qk_rope_head_dim``); the KV pool holds only that latent and rotary key."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's rotary rows in interleaved pairs (transformers' default)

    @property
    def latent_dim(self) -> int:
        """What the KV pool holds a token a layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's expert routing. V3 (``noaux_tc``): sigmoid scores, a per-expert bias that only chooses,
    the top ``topk_group`` of ``n_group`` expert groups (each scored by its two best), the top-k experts
    within them, weights renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``. V2
    (``softmax``: ``greedy``, one group, or ``group_limited_greedy``): softmax scores, no bias, each group
    scored by its best, weights scaled, never renormalised."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    softmax: bool = False


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
    # DeepSeek-V3: latent attention (then num_kv_heads is 1 and head_dim the rotary part), grouped routing
    # and shared experts (a dense MLP of n_shared_experts x moe_intermediate_size beside the routed ones).
    mla: MLAConfig | None = None
    routing: GroupedRouting | None = None
    n_shared_experts: int = 0
    # The softmax scale's factor beyond head_dim ** -0.5 (YaRN's mscale_all_dim, squared: DeepSeek's).
    attention_scale_factor: float = 1.0
    # DeepSeek-V3's multi-token-prediction layers past the decoder's (``num_nextn_predict_layers``; used as
    # a speculative draft, engine.models.mtp), and whether they are MoE layers (by the decoder's rule).
    num_mtp_layers: int = 0
    mtp_moe: bool = False

    @property
    def kv_head_dim(self) -> int:
        """The KV pool's values a head a token, in each of its K and V halves: an MLA model's latent and
        rotary key are split across the two (one head), others hold K and V of ``head_dim``."""
        return self.mla.latent_dim // 2 if self.mla else self.head_dim

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
            if rope_type not in ("default", "llama3", "yarn"):
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r}; supported: default, llama3, yarn"
                )
            rope_scaling = None if rope_type == "default" else {**rope_scaling, "rope_type": rope_type}
            if rope_type == "yarn" and not rope_scaling.get("original_max_position_embeddings"):
                rope_scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 4096)
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
        elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
            num_experts = cfg["n_routed_experts"]
            top_k = cfg["num_experts_per_tok"]
            moe_inter = cfg["moe_intermediate_size"]
            # V2's router never renormalises (transformers' DeepseekV2TopkRouter), whatever the config says.
            norm_topk = arch == "DeepseekV3ForCausalLM" and bool(cfg.get("norm_topk_prob", True))
            first_dense = cfg.get("first_k_dense_replace") or 0
            freq = cfg.get("moe_layer_freq") or 1
            moe_layers = [i >= first_dense and i % freq == 0 for i in range(num_layers)]
        elif arch == "MixtralForCausalLM":
            num_experts = cfg["num_local_experts"]
            top_k = cfg["num_experts_per_tok"]
            moe_inter = cfg["intermediate_size"]
            norm_topk = True
            moe_layers = [True] * num_layers
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        config = cls(
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
        if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
            config = dataclasses.replace(
                config, **_deepseek(cfg, rope_scaling, v2=arch == "DeepseekV2ForCausalLM")
            )
        return config


def _labels(cfg: dict[str, Any]) -> list[str]:
    """A classifier's label names by id: config.json's ``id2label`` (transformers writes ``LABEL_i`` when
    none were named), else ``num_labels`` unnamed ones."""
    id2label = cfg.get("id2label") or {}
    n = len(id2label) or int(cfg.get("num_labels") or 2)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def _deepseek(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None, v2: bool = False) -> dict[str, Any]:
    """DeepSeek-V2's and V3's fields (and overrides: one KV head, the rotary head_dim)."""
    import math

    method = cfg.get("topk_method", "greedy" if v2 else "noaux_tc")
    scoring = cfg.get("scoring_func", "softmax" if v2 else "sigmoid")
    served = {("greedy", "softmax"), ("group_limited_greedy", "softmax")} if v2 else {("noaux_tc", "sigmoid")}
    if (method, scoring) not in served:
        raise UnsupportedModelError(
            f"DeepSeek routing {method!r} with {scoring!r} scores is not served for this architecture: "
            f"{', '.join(f'{m} with {s}' for m, s in sorted(served))}"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError("DeepSeek attention or MLP biases are not served")
    mla = MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    if mla.latent_dim % 2:
        raise UnsupportedModelError(f"MLA latent of {mla.latent_dim} values: the KV pool needs an even size")
    n_group = 1 if method == "greedy" else cfg.get("n_group") or 1
    # The first multi-token-prediction layer is numbered after the decoder's, and is an MoE layer by the
    # same rule as theirs.
    mtp_layer = cfg["num_hidden_layers"]
    first_dense, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    factor = 1.0
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        scale = rope_scaling["factor"]
        mscale = 0.1 * rope_scaling["mscale_all_dim"] * math.log(scale) + 1.0 if scale > 1 else 1.0
        factor = mscale * mscale
    return {
        "num_kv_heads": 1,
        "head_dim": mla.qk_rope_head_dim,
        "mla": mla,
        "routing": GroupedRouting(
            n_group,
            1 if method == "greedy" else cfg.get("topk_group") or n_group,
            float(cfg.get("routed_scaling_factor", 1.0)),
            softmax=v2,
        ),
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "attention_scale_factor": factor,
        "num_mtp_layers": 0 if v2 else int(cfg.get("num_nextn_predict_layers") or 0),
        "mtp_moe": mtp_layer >= first_dense and mtp_layer % freq == 0,
    }
