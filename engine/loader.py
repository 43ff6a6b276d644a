"""Loading models: Hugging Face checkpoint directories (config.json, safetensors shards, tokenizer.json,
generation_config.json), the built-in tiny models, and ``load_format="dummy"`` random weights.

Maps checkpoint tensor names onto the engine's fused parameters (qkv, gate-up, expert w13). Nothing is
downloaded: a name that is neither a built-in model nor a directory is an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import UnsupportedModelError
from engine.fp8_weights import (
    FLOAT8_DTYPES,
    SCALE_SUFFIXES,
    checkpoint_fp8_layout,
    checkpoint_quantization,
    dequantize,
    online_fp8_layout,
    rows_stay_in_blocks,
    scale_name,
    store_fp8,
)
from engine.models.decoder import DecoderModel
from engine.models.mla import GroupedMoEBlock, MLAttention, rotary_row_order
from engine.models.model_config import ModelConfig
from engine.models.mtp import MTPLayer
from engine.moe.dispatch import TokenDispatcher
from engine.tiny_models import TINY_MODELS, tiny_model_config
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kernels import Ops
from kernels.fp8_weight import Fp8Layout, Fp8Weight
from mesh.expert_placement import initial_placement

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    fingerprint: str  # model identity + dtype: the root of every block hash
    # False for a checkpoint of the base model alone (no lm_head, untied): it can only embed (engine.pooling).
    has_lm_head: bool = True
    path: Path | None = None  # the checkpoint directory (None: a built-in model)


def resolve_model_config(model: str) -> tuple[ModelConfig, Path | None]:
    if model in TINY_MODELS:
        return tiny_model_config(model), None
    path = Path(model)
    if not path.is_dir():
        raise UnsupportedModelError(
            f"model {model!r} is neither a built-in model ({', '.join(TINY_MODELS)}) nor a checkpoint directory; "
            "nothing is downloaded at run time"
        )
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise UnsupportedModelError(f"{cfg_path} is missing: a checkpoint directory needs config.json")
    hf = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    checkpoint_quantization(hf, path)  # an unsupported quantisation fails here, before any weight is read
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    return cfg, path


def resolve_dtype(model: str, dtype: str) -> str:
    """``dtype`` itself, or for "auto" the checkpoint's (config.json's ``dtype``, or ``torch_dtype`` in
    older files) where it is one pdmesh computes in; float32 for the built-in models and for checkpoints
    that name none or another."""
    if dtype != "auto":
        return dtype
    _, path = resolve_model_config(model)
    if path is None:
        return "float32"
    hf = json.loads((path / "config.json").read_text())
    named = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    return named if named in DTYPES else "float32"


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise UnsupportedModelError(f"safetensors shards listed in {index} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no safetensors weights in {path} (model.safetensors or an index file)")
    return files


def model_fingerprint(
    model: str, path: Path | None, dtype: str, load_format: str = "auto", fp8: Fp8Layout | None = None
) -> str:
    if fp8 is not None:  # float8 weights compute other values than the same checkpoint widened
        dtype = f"{dtype}:w{fp8.describe().replace(' ', '_')}"
    if path is None:
        return f"{model}-v1:{dtype}"
    h = hashlib.sha256((path / "config.json").read_bytes())
    if load_format == "dummy":
        return f"{path.name}:{h.hexdigest()[:16]}:dummy:{dtype}"
    for f in safetensors_files(path):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return f"{path.name}:{h.hexdigest()[:16]}:{dtype}"


def load_model(
    model: str,
    dtype: str,
    device: torch.device,
    ops: Ops,
    max_positions: int | None = None,
    load_format: str = "auto",
    seed: int = 0,
    dispatcher: TokenDispatcher | None = None,
    physical_to_logical: list[list[int]] | None = None,
    quantization: str = "auto",
    num_redundant_experts: int = 0,
    mtp: bool = False,
) -> LoadedModel:
    """``max_positions``: the longest sequence the RoPE cache covers (None: the checkpoint's
    ``max_position_embeddings``); ``quantization``: the engine setting (float8 weights kept, made or
    widened); ``num_redundant_experts``: physical expert slots beyond the model's experts in each MoE layer,
    placed as ``mesh.expert_placement.initial_placement`` (unless ``physical_to_logical`` is given); ``mtp``:
    load the checkpoint's first multi-token-prediction layer too (``engine.models.mtp``, for drafts)."""
    cfg, path = resolve_model_config(model)
    if num_redundant_experts and physical_to_logical is None:
        if not cfg.is_moe:
            raise ValueError(f"{model} has no MoE layers: num_redundant_experts does not apply")
        physical_to_logical = initial_placement(
            cfg.num_layers, cfg.num_experts, cfg.num_experts + num_redundant_experts
        )
    max_positions = max_positions or cfg.max_position_embeddings
    torch_dtype = DTYPES[dtype]
    fp8 = fp8_layout(cfg, path, quantization, load_format)
    if fp8 is not None:
        log.info("%s: attention, MLP and expert weights kept in float8 (%s)", model, fp8.describe())
    net = DecoderModel(cfg, ops, torch_dtype, device, max_positions, dispatcher, physical_to_logical, fp8)
    if mtp:
        if not cfg.num_mtp_layers:
            raise UnsupportedModelError(
                f"{model} has no multi-token-prediction layer (num_nextn_predict_layers): speculative "
                "method mtp needs one (DeepSeek-V3 and R1 checkpoints have it)"
            )
        net.mtp = MTPLayer(cfg, ops, torch_dtype, device, fp8)
        if path is None or load_format == "dummy":  # generated weights: the main model's embeddings and head
            _share_mtp_tensors(net, cfg, force=True)
    has_lm_head = not cfg.num_labels  # a classifier's checkpoint has a score head instead
    if path is None:
        _init_tiny(net, seed=1234)
        tokenizer: Tokenizer = ByteTokenizer(cfg.vocab_size)
    else:
        if load_format == "dummy":
            _init_dummy(net, seed)
        else:
            has_lm_head = _load_safetensors(net, cfg, path, dispatcher) and not cfg.num_labels
        tokenizer = _checkpoint_tokenizer(path, cfg, load_format)
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = list(tokenizer.eos_token_ids)
    fingerprint = model_fingerprint(model, path, dtype, load_format, fp8)
    return LoadedModel(cfg, net, tokenizer, fingerprint, has_lm_head, path)


def fp8_layout(cfg: ModelConfig, path: Path | None, quantization: str, load_format: str) -> Fp8Layout | None:
    """How the model keeps its linear weights in float8 under the ``quantization`` setting (None: in its
    dtype): a float8 checkpoint's own layout (auto, fp8) unless the kernels cannot read it; 16-bit
    weights quantised at load with fp8."""
    if quantization not in ("auto", "fp8", "none"):
        raise ValueError(f"quantization must be auto, fp8 or none, got {quantization!r}")
    if quantization == "none":
        return None
    quant = (
        None
        if path is None
        else checkpoint_quantization(json.loads((path / "config.json").read_text()), path)
    )
    if quant is None:
        return online_fp8_layout(cfg) if quantization == "fp8" else None
    if load_format == "dummy":  # random weights in the checkpoint's kind of layout
        layout = online_fp8_layout(cfg)
        return layout if quant.block and layout.block == tuple(quant.block) else Fp8Layout(None)
    layout, why = checkpoint_fp8_layout(cfg, path, quant, safetensors_files(path))  # type: ignore[arg-type]
    if layout is None:
        log.info("%s: float8 weights widened to the model dtype at load: %s", path, why)
    return layout


def _checkpoint_tokenizer(path: Path, cfg: ModelConfig, load_format: str) -> Tokenizer:
    if load_format == "dummy" and not (path / "tokenizer.json").exists():
        # Dummy weights are for benchmarks driven by token ids; a byte tokenizer stands in.
        log.warning("%s has no tokenizer.json; load_format=dummy uses a byte tokenizer", path)
        return ByteTokenizer(cfg.vocab_size)
    return HFTokenizer(path, cfg.eos_token_ids, cfg.vocab_size)


def _norm_params(net: DecoderModel) -> set[str]:
    return {n for n, _ in net.named_parameters() if n.endswith(("layernorm", "norm", "q_norm", "k_norm"))}


def _fp8_owner(net: DecoderModel, name: str, modules: dict) -> Fp8Weight | None:
    """The float8 weight whose parameter ``name`` is (its values or its scales), if any."""
    owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
    return owner if isinstance(owner, Fp8Weight) else None


def _set(
    p: torch.nn.Parameter, fp8: Fp8Weight | None, values: torch.Tensor, expert: int | None = None
) -> None:
    if fp8 is not None:
        fp8.quantize_(values, expert=expert)
    elif expert is None:
        p.data.copy_(values.to(p.dtype))
    else:
        p.data[expert].copy_(values.to(p.dtype))


def _init_tiny(net: DecoderModel, seed: int) -> None:
    """Deterministic weights, scaled so greedy output is varied rather than one repeated token. A float8
    weight holds the quantised values of the same draw."""
    from engine.moe.layer import MoEBlock

    gen = torch.Generator().manual_seed(seed)
    norms = _norm_params(net)
    modules = dict(net.named_modules())
    # The MTP layer's weights drawn last, so that the decoder's are the same with it or without it.
    for name, p in sorted(net.named_parameters(), key=lambda item: (item[0].startswith("mtp."), item[0])):
        fp8 = _fp8_owner(net, name, modules)
        if fp8 is not None:
            if name.endswith(".weight_scale"):
                continue
            name = name.rsplit(".", 1)[0]  # the weight's own name, so the draws match a 16-bit model's
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        if isinstance(owner, MoEBlock) and name.endswith((".w13", ".w2")):
            # Weights are drawn per logical expert, then placed: replicas hold identical copies.
            logical = torch.randn((owner.num_logical, *p.shape[1:]), generator=gen) * p.shape[-1] ** -0.5
            n_local = p.shape[0]
            lo = owner.dispatcher.ep_rank * n_local
            _set(p, fp8, logical[owner.placement.physical_to_logical[lo : lo + n_local].cpu()])
            continue
        if name in norms:
            values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = p.shape[-1]
            values = torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else fan_in**-0.5)
            if name == "lm_head":
                # Favour printable ASCII so the built-in models' random text is readable in demos.
                printable = torch.zeros(p.shape[0], dtype=torch.bool)
                printable[32:127] = True
                values = torch.where(printable.unsqueeze(1), values * 3.0, values * 0.5)
        _set(p, fp8, values)


def _init_dummy(net: DecoderModel, seed: int) -> None:
    """Random weights (never zeros) of the checkpoint's shapes, generated on the model's device; float8
    weights quantised from such values (expert by expert, which bounds the scratch memory)."""
    gen = torch.Generator(device=net.norm.device).manual_seed(seed)
    norms = _norm_params(net)
    modules = dict(net.named_modules())
    for name, p in net.named_parameters():
        fp8 = _fp8_owner(net, name, modules)
        if fp8 is not None:
            if name.endswith(".weight_scale"):
                continue
            for expert in range(p.shape[0]) if p.dim() == 3 else [None]:
                shape = p.shape[1:] if expert is not None else p.shape
                values = torch.empty(shape, dtype=fp8.dtype, device=p.device).normal_(
                    0.0, 0.02, generator=gen
                )
                _set(p, fp8, values, expert)
        elif name in norms:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# Calibrated KV-cache scales as quantisation tools write them (one float a layer): compressed-tensors /
# llm-compressor (self_attn.k_scale, v_scale), the older fp8 format (self_attn.kv_scale, both), NVIDIA
# ModelOpt (k_proj.k_scale / v_proj.v_scale, or their output_scale). vLLM reads the same names.
_KV_SCALES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.kv_scale": "kv",
    "self_attn.attn.k_scale": "k",
    "self_attn.attn.v_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
}


# Weights of a checkpoint saved from the base model alone (transformers' ``AutoModel``), named without ``model.``.
_BASE_MODEL_KEYS = ("embed_tokens.", "layers.", "norm.")


def _load_safetensors(
    net: DecoderModel, cfg: ModelConfig, path: Path, dispatcher: TokenDispatcher | None
) -> bool:
    """Read the checkpoint's weights into ``net``; returns whether it has an LM head (a checkpoint of the base
    model alone, as transformers' ``AutoModel`` saves an embedding model, has none: its weights' names lack
    the ``model.`` prefix, and the engine can then only embed)."""
    from safetensors import safe_open

    loaded: set[str] = set()
    modules = dict(net.named_modules())
    # Parameter names, a float8 weight's two (values, scales) as the weight's own name
    expected = {n.rsplit(".", 1)[0] if _fp8_owner(net, n, modules) else n for n, _ in net.named_parameters()}
    if cfg.tie_word_embeddings or cfg.num_labels:
        expected.discard("lm_head")
    files = safetensors_files(path)
    quant = checkpoint_quantization(json.loads((path / "config.json").read_text()), path)
    block = quant.block if quant is not None else None
    scales: dict[str, torch.Tensor] = {}
    if quant is not None:  # float8 weights: their scales first (small), wherever the shards put them
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                scales.update((n, f.get_tensor(n)) for n in f.keys() if n.endswith(SCALE_SUFFIXES))  # noqa: SIM118
    float8 = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = f.get_tensor(key)
                name = f"model.{key}" if key.startswith(_BASE_MODEL_KEYS) else key
                scale = None
                if tensor.dtype in FLOAT8_DTYPES:
                    scale = scales.get(scale_name(name, scales) or "")  # none without a quantisation config
                    float8 += 1
                elif not tensor.is_floating_point() and name.endswith("weight"):
                    raise UnsupportedModelError(f"{name} is {tensor.dtype}: pdmesh reads float weights only")
                put = functools.partial(_put, name=name, scale=scale, block=block)
                for target in _assign(net, cfg, name, tensor, put):
                    loaded.add(target)
    if float8:
        how = f"kept in float8 ({net.fp8.describe()})" if net.fp8 else f"widened to {net.norm.dtype}"
        log.info("%s: %d float8 weights (%s) %s at load", path, float8, quant.method, how)  # type: ignore[union-attr]
    if net.mtp is not None:
        loaded |= _share_mtp_tensors(net, cfg, force=False, loaded=loaded)
    missing = sorted(expected - loaded)
    if missing == ["lm_head"]:
        log.info("%s has no LM head (a base model's checkpoint): the engine serves embeddings only", path)
        with torch.no_grad():
            net.lm_head.zero_()
        return False
    if missing:
        raise UnsupportedModelError(
            f"checkpoint {path} lacks weights for: {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
    return True


def _put(
    target: torch.nn.Parameter | Fp8Weight,
    t: torch.Tensor,
    *,
    name: str,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    rows: slice | None = None,
    expert: int | None = None,
) -> None:
    """Checkpoint tensor ``name`` (with its float8 ``scale``, where it has one) into rows ``rows`` of expert
    ``expert`` of ``target``: a float8 weight stores float8 values as they are and quantises others; a
    parameter takes float8 values widened."""
    if isinstance(target, Fp8Weight):
        dst = target.views(expert)[0]
        dst = dst if rows is None else dst[rows]
        if tuple(dst.shape) != tuple(t.shape):
            raise UnsupportedModelError(
                f"weight {name}: checkpoint shape {tuple(t.shape)} != expected {tuple(dst.shape)}"
            )
        if t.dtype in FLOAT8_DTYPES:
            store_fp8(target, name, t, scale, rows, expert)
        else:
            target.quantize_(t, rows, expert)
        return
    if t.dtype in FLOAT8_DTYPES:
        t = dequantize(name, t, scale, block)
    dst = target.data if expert is None else target.data[expert]
    _copy(dst if rows is None else dst[rows], t, name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise UnsupportedModelError(
            f"weight {name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def _assign(net: DecoderModel, cfg: ModelConfig, name: str, t: torch.Tensor, put: Callable) -> list[str]:
    """Put one checkpoint tensor into the model (``put(target, t, rows=, expert=)``: ``_put`` with the
    tensor's name and scale); returns the parameter names it (partly) fills."""
    if name == "model.embed_tokens.weight":
        put(net.embed_tokens, t)
        return ["embed_tokens"]
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings or cfg.num_labels:  # a classifier's LM head goes unused
            return []
        put(net.lm_head, t)
        return ["lm_head"]
    if name == "model.norm.weight":
        put(net.norm, t)
        return ["norm"]
    if name == "score.weight" and net.score is not None:  # a sequence classifier's head
        put(net.score, t)
        return ["score"]
    m = _LAYER.match(name)
    if not m:
        return []  # e.g. rotary inv_freq buffers in old checkpoints
    i, rest = int(m.group(1)), m.group(2)
    if i >= len(net.layers):  # DeepSeek-V3's multi-token-prediction layers, past the decoder's
        if net.mtp is None or i != len(net.layers):
            return []  # not drafted with, or past the first (the only one drafted with)
        return _assign_mtp(net.mtp, cfg, name, rest, t, put)
    return _assign_layer(net.layers[i], f"layers.{i}.", cfg, name, rest, t, put)


# An MTP layer's own tensors (the rest are its decoder layer's), by checkpoint name.
_MTP_OWN = {
    "embed_tokens.weight": "embed_tokens",
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "eh_proj.weight": "eh_proj",
    "shared_head.norm.weight": "head_norm",
    "shared_head.head.weight": "head",
}


def _assign_mtp(
    mtp: MTPLayer, cfg: ModelConfig, name: str, rest: str, t: torch.Tensor, put: Callable
) -> list[str]:
    if rest in _MTP_OWN:
        put(getattr(mtp, _MTP_OWN[rest]), t)
        return ["mtp." + _MTP_OWN[rest]]
    return _assign_layer(mtp.block, "mtp.block.", cfg, name, rest, t, put)


def _share_mtp_tensors(
    net: DecoderModel, cfg: ModelConfig, force: bool, loaded: set[str] | None = None
) -> set[str]:
    """Make the MTP layer's embeddings and head the main model's tensors: always with ``force``
    (generated weights), else where the checkpoint has no copy of its own or its copy equals them
    (DeepSeek-V3's do: one copy in memory instead of two). Returns the MTP names now provided."""
    mtp = net.mtp
    assert isinstance(mtp, MTPLayer)
    shared = set()
    for own, main in (("embed_tokens", net.embed_tokens), ("head", net.lm_head)):
        if own == "head" and cfg.num_labels:
            continue
        name = f"mtp.{own}"
        if force or name not in (loaded or set()) or torch.equal(getattr(mtp, own), main):
            setattr(mtp, own, main)
            shared.add(name)
    return shared


def _assign_layer(layer: torch.nn.Module, pre: str, cfg: ModelConfig, name: str, rest: str, t: torch.Tensor,
                  put: Callable) -> list[str]:  # fmt: skip
    """A decoder layer's tensor ``rest`` (of checkpoint tensor ``name``) into ``layer``, whose parameters
    are named ``pre`` + their names."""
    attn = layer.self_attn
    if isinstance(attn, MLAttention):
        found = _assign_mla(layer, attn, rest, t, put, cfg)
        if found is not None:
            return [pre + f for f in found]
    if rest in _KV_SCALES:
        value = _kv_scale(name, t)
        if "k" in _KV_SCALES[rest]:
            attn.k_scale = value
        if "v" in _KV_SCALES[rest]:
            attn.v_scale = value
        return []  # not a parameter: used by a float8 KV pool only (decoder.Attention.kv_scales)
    simple = {
        "input_layernorm.weight": ("input_layernorm", layer.input_layernorm),
        "post_attention_layernorm.weight": ("post_attention_layernorm", layer.post_attention_layernorm),
    }
    if not isinstance(attn, MLAttention):
        simple["self_attn.o_proj.weight"] = ("self_attn.o_proj", attn.o_proj)
        simple["self_attn.q_norm.weight"] = ("self_attn.q_norm", attn.q_norm)
        simple["self_attn.k_norm.weight"] = ("self_attn.k_norm", attn.k_norm)
    if rest in simple:
        target, param = simple[rest]
        if param is None:
            return []
        put(param, t)
        return [pre + target]
    q, kv = (0, 0) if isinstance(attn, MLAttention) else (attn.q_size, attn.kv_size)
    qkv_rows = (
        {}
        if isinstance(attn, MLAttention)
        else {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    )
    for proj, (lo, hi) in qkv_rows.items():
        if rest == f"self_attn.{proj}.weight":
            put(attn.qkv_proj, t, rows=slice(lo, hi))
            return [pre + "self_attn.qkv_proj"]
        if rest == f"self_attn.{proj}.bias":
            if attn.qkv_bias is None:
                raise UnsupportedModelError(f"{name}: unexpected attention bias for {cfg.architecture}")
            put(attn.qkv_bias, t, rows=slice(lo, hi))
            return [pre + "self_attn.qkv_bias"]
    mlp = layer.mlp
    from engine.moe.layer import MoEBlock

    if not isinstance(mlp, MoEBlock):
        inter = mlp.down_proj.shape[1]
        if rest == "mlp.gate_proj.weight":
            put(mlp.gate_up_proj, t, rows=slice(0, inter))
            return [pre + "mlp.gate_up_proj"]
        if rest == "mlp.up_proj.weight":
            put(mlp.gate_up_proj, t, rows=slice(inter, 2 * inter))
            return [pre + "mlp.gate_up_proj"]
        if rest == "mlp.down_proj.weight":
            put(mlp.down_proj, t)
            return [pre + "mlp.down_proj"]
        return []
    if rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
        put(mlp.gate, t)
        return [pre + "mlp.gate"]
    em = _EXPERT.match(rest)
    if em:
        logical, proj = int(em.group(1)), em.group(2)
        inter = mlp.w2.shape[2]
        n_local = mlp.w13.shape[0]
        lo_phys = mlp.dispatcher.ep_rank * n_local
        p2l = mlp.placement.physical_to_logical.tolist()
        targets = [p - lo_phys for p in range(lo_phys, lo_phys + n_local) if p2l[p] == logical]
        for local in targets:
            if proj in ("gate_proj", "w1"):
                put(mlp.w13, t, rows=slice(0, inter), expert=local)
            elif proj in ("up_proj", "w3"):
                put(mlp.w13, t, rows=slice(inter, 2 * inter), expert=local)
            elif proj in ("down_proj", "w2"):
                put(mlp.w2, t, expert=local)
        return [pre + "mlp.w13", pre + "mlp.w2"]
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused-experts checkpoints
        which = mlp.w13 if rest.endswith("gate_up_proj") else mlp.w2
        full = t if tuple(t.shape[1:]) == tuple(which.shape[1:]) else t.transpose(1, 2)
        n_local = which.shape[0]
        lo_phys = mlp.dispatcher.ep_rank * n_local
        p2l = mlp.placement.physical_to_logical.tolist()
        for local in range(n_local):
            put(which, full[p2l[lo_phys + local]], expert=local)
        return [pre + ("mlp.w13" if which is mlp.w13 else "mlp.w2")]
    return []


def _assign_mla(layer: torch.nn.Module, attn: MLAttention, rest: str, t: torch.Tensor, put: Callable,
                cfg: ModelConfig) -> list[str] | None:  # fmt: skip
    """A DeepSeek layer's own tensors (latent attention, V3's router bias, shared experts); None for the
    tensors every layer has. The rotary rows of the query and latent projections are taken from the
    checkpoint's interleaved pairs into rotate-half order (transformers' ``rope_interleave``, on by
    default): the model then applies the common RoPE and computes the same scores."""
    names = ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj")
    # The query's first projection and the latent's are rows of one weight (MLAttention.qkv_a_proj).
    stacked = {
        "q_proj": slice(0, attn.q_rows),
        "kv_a_proj_with_mqa": slice(attn.q_rows, attn.q_rows + attn.latent),
    }
    if attn.q_lora:
        stacked["q_a_proj"] = stacked.pop("q_proj")
    interleaved = cfg.mla is not None and cfg.mla.rope_interleave
    for n in (*names, *stacked):
        if rest == f"self_attn.{n}.weight":
            # First: a float8 tensor is widened by its scale blocks (or stored with them), row by row as stored.
            target, rows = (attn.qkv_a_proj, stacked[n]) if n in stacked else (getattr(attn, n), None)
            put(target, t, rows=rows)
            if interleaved and n in ("q_b_proj", "q_proj", "kv_a_proj_with_mqa"):
                _reorder_rows(
                    target, rows, rotary_row_order(cfg, "kv_a" if n == "kv_a_proj_with_mqa" else "q")
                )
            return [f"self_attn.{'qkv_a_proj' if n in stacked else n}"]
    mlp = layer.mlp
    if rest == "mlp.gate.e_score_correction_bias" and isinstance(mlp, GroupedMoEBlock):
        put(mlp.e_score_correction_bias, t)
        return ["mlp.e_score_correction_bias"]
    if (
        rest.startswith("mlp.shared_experts.")
        and rest.endswith("_proj.weight")  # not a float8 weight's scales, which its weight's put reads
        and isinstance(mlp, GroupedMoEBlock)
        and mlp.shared_experts is not None
    ):
        shared, proj = mlp.shared_experts, rest.split(".")[2]
        inter = shared.down_proj.shape[1]
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
        if proj in rows:
            put(shared.gate_up_proj, t, rows=rows[proj])
            return ["mlp.shared_experts.gate_up_proj"]
        put(shared.down_proj, t)
        return ["mlp.shared_experts.down_proj"]
    return None


def _reorder_rows(target: torch.nn.Parameter | Fp8Weight, rows: slice | None, order: torch.Tensor) -> None:
    """Rows ``rows`` of ``target`` (all where None) put in ``order`` (``engine.models.mla.rotary_row_order``).
    A float8 weight's scales follow their rows where each row has its own; block scales stay, the layout
    (``engine.fp8_weights``) having kept no block that the order moves rows out of."""
    rows = rows or slice(0, target.shape[-2])
    order = order.to(target.device)
    if isinstance(target, Fp8Weight):
        bn = target.block[0]
        if bn > 1 and not rows_stay_in_blocks(order, rows.start, bn):
            raise UnsupportedModelError(f"rotary rows straddle the float8 scale blocks of {bn} rows")
        if bn == 1:
            scales = target.weight_scale.data[rows]
            scales.copy_(scales[order])
        values = target.weight.data[rows]
    else:
        values = target.data[rows]
    values.copy_(values[order])


def _kv_scale(name: str, t: torch.Tensor) -> float:
    """One layer's KV scale from its checkpoint tensor: a single positive finite value."""
    if t.numel() != 1:
        raise UnsupportedModelError(
            f"{name}: KV scales of shape {tuple(t.shape)} (per head or channel) are not supported, only one a layer"
        )
    value = float(t.float().reshape(()))
    if not (0.0 < value < float("inf")):
        raise UnsupportedModelError(f"{name}: a KV scale must be positive and finite, got {value}")
    return value


def load_tokenizer(model: str) -> tuple[Tokenizer, ModelConfig, str]:
    """Tokenizer, model config and the model's name as served, without loading any weights (router side)."""
    cfg, path = resolve_model_config(model)
    tokenizer: Tokenizer = (
        ByteTokenizer(cfg.vocab_size)
        if path is None
        else _checkpoint_tokenizer(path, cfg, "dummy" if not (path / "tokenizer.json").exists() else "auto")
    )
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = list(tokenizer.eos_token_ids)
    return tokenizer, cfg, (model if path is None else path.name)


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: str, source: str) -> dict[str, float]:
    """vLLM's ``--generation-config``: ``auto`` reads the checkpoint's ``generation_config.json``, ``vllm``
    (or a model without one) gives none, a directory reads its ``generation_config.json``. Only the
    sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) are taken, and only where the
    file turns sampling on (``do_sample`` not false), as transformers would sample."""
    if source == "vllm":
        return {}
    path = (Path(model) if source == "auto" else Path(source)) / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config {source!r}: {path} does not exist")
        return {}
    cfg = json.loads(path.read_text())
    if cfg.get("do_sample") is False:
        return {}
    return {
        k: cfg[k]
        for k in GENERATION_FIELDS
        if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)
    }
