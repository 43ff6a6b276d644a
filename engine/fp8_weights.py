"""Float8 checkpoints: which quantised checkpoints the loader reads, and their weights kept or widened.

pdmesh reads checkpoints whose linear weights are stored in float8 with float32 scales, in the formats vLLM
and SGLang serve:

- ``fp8`` (transformers' fine-grained FP8, as in Qwen3-*-FP8 and DeepSeek-V3): ``<name>.weight_scale_inv``,
  one multiplier per block of ``weight_block_size`` (128 x 128) weights;
- ``compressed-tensors`` float-quantised (llm-compressor, e.g. RedHatAI's ``*-FP8`` and ``*-FP8-dynamic``):
  ``<name>.weight_scale`` per tensor, per output channel or per block;
- ``modelopt`` FP8 (NVIDIA ModelOpt; ``hf_quant_config.json`` or ``quantization_config``) and ``fbgemm_fp8``:
  ``<name>.weight_scale`` per tensor or per output channel.

How they are held follows ``EngineConfig.quantization``. ``auto`` (the default) and ``fp8`` keep the
attention and MLP (and expert) weights in float8 on the device with their scales (``kernels.fp8_weight.
Fp8Weight``), where the kernels read the checkpoint's scale layout (``checkpoint_fp8_layout``; ``fp8`` also
quantises 16-bit checkpoints, ``online_fp8_layout``): half the memory, and decode streams half the weight
bytes. ``none``, and layouts the kernels do not read, widen each float8 weight as it loads: the weight
times its scale in float32, rounded once to the engine's dtype, transformers' own arithmetic when it loads
such a checkpoint without a GPU (``FineGrainedFP8Config(dequantize=True)``, which a test compares
against). Either way activations stay 16-bit ("w8a16"; vLLM's and SGLang's float8 GEMMs quantise them per
token or per tensor, so their outputs differ from these by that rounding), and static activation scales
(``input_scale``) are not used. Every other quantisation (GPTQ, AWQ, bitsandbytes, integer or 4-bit
compressed-tensors, NVFP4, ...) is refused by name, before any weight is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.models.model_config import ModelConfig
from kernels.fp8_weight import Fp8Layout, Fp8Weight, kernel_layout_ok

FP8_METHODS = ("fp8", "compressed-tensors", "modelopt", "fbgemm_fp8")
# Every one-byte float format torch reads from safetensors (the fnuz ones are AMD's): each is widened
# with its scale, never read as a weight as it is.
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# The scale of tensor <name> is <name>_scale_inv (fp8: a multiplier despite the name) or <name>_scale.
SCALE_SUFFIXES = ("_scale_inv", "_scale")


@dataclass(frozen=True)
class WeightQuantization:
    method: str
    block: tuple[int, int] | None  # the block a 2-D scale grid covers, where the config names one


def checkpoint_quantization(hf: dict[str, Any], path: Path | None) -> WeightQuantization | None:
    """The checkpoint's weight quantisation where pdmesh reads it, None for an unquantised checkpoint; an
    UnsupportedModelError for any other method or scheme."""
    qc = hf.get("quantization_config")
    if not qc and path is not None and (path / "hf_quant_config.json").exists():
        qc = {
            "quant_method": "modelopt",
            **json.loads((path / "hf_quant_config.json").read_text())["quantization"],
        }
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in FP8_METHODS:
        raise UnsupportedModelError(
            f"quantization method {method or qc!r} is not supported: pdmesh reads float8 checkpoints "
            f"({', '.join(FP8_METHODS)}) and unquantized ones"
        )
    block = qc.get("weight_block_size")
    if method == "compressed-tensors":
        for group_name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
            if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel", "block"):
                raise UnsupportedModelError(
                    f"compressed-tensors group {group_name!r} stores weights as {kind[0]} {kind[1]}-bit per "
                    f"{kind[2]}: pdmesh reads float 8-bit weights per tensor, channel or block"
                )
            block = block or weights.get("block_structure")
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() != "FP8":
        raise UnsupportedModelError(
            f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported: pdmesh reads FP8"
        )
    return WeightQuantization(method, tuple(block) if block else None)  # type: ignore[arg-type]


def scale_name(name: str, names: set[str] | dict[str, Any]) -> str | None:
    """The checkpoint tensor holding ``name``'s scale, if it has one."""
    return next((name + s for s in SCALE_SUFFIXES if name + s in names), None)


def dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None
) -> torch.Tensor:
    """A float8 weight [..., rows, cols] times its scale, in float32: one scale for the tensor (or for each
    leading index, as stacked experts have), one per row ([..., rows] or [..., rows, 1]), or one per block of
    a 2-D grid [..., ceil(rows / b0), ceil(cols / b1)] (edge blocks partial; the block is the config's, else
    the one that divides the weight evenly)."""
    if scale is None:
        raise UnsupportedModelError(
            f"{name} is float8 ({weight.dtype}) but the checkpoint has no {name}_scale_inv or {name}_scale"
        )
    w = weight.to(torch.float32)
    s = _scale_values(name, scale)
    lead, (rows, cols) = tuple(w.shape[:-2]), tuple(w.shape[-2:])
    if s.numel() == max(1, math.prod(lead)):  # per tensor (per stacked matrix)
        return w * s.reshape(*lead, 1, 1)
    if tuple(s.shape) in (lead + (rows,), lead + (rows, 1)):  # per output channel
        return w * s.reshape(*lead, rows, 1)
    if s.dim() == len(lead) + 2 and tuple(s.shape[:-2]) == lead:
        grid = tuple(s.shape[-2:])
        b0, b1 = block or (rows // grid[0], cols // grid[1])
        if b0 > 0 and b1 > 0 and grid == (-(-rows // b0), -(-cols // b1)):
            full = s.repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
            return w * full[..., :rows, :cols]
    raise UnsupportedModelError(
        f"{name}: scale shape {tuple(scale.shape)} fits none of the layouts of a {tuple(weight.shape)} weight "
        f"(per tensor, per row, or blocks of {block or 'an even division'})"
    )


def _scale_values(name: str, scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # E8M0 exponents stored as bytes (MX formats): 2 ** (byte - 127)
        return (scale.to(torch.float32) - 127.0).exp2()
    if not scale.is_floating_point():
        raise UnsupportedModelError(f"{name}: scales of dtype {scale.dtype} are not supported")
    return scale.to(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Keeping float8 weights float8 (``quantization`` auto / fp8): which layout, and storing each tensor in it

# Checkpoint tensors that become the model's float8 weights: attention and MLP projections and experts
# (``.weight`` of each; the router ``mlp.gate``, the embeddings and the LM head stay in the model's dtype, as
# do DeepSeek's kv_b_proj, absorbed into the query and output, and its MTP layer's eh_proj).
_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:[qkvo]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)"
    r"|mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj"
    r"|(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$"
)
_FUSED_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)$")
_SAFETENSORS_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ONLINE_BLOCK = (128, 128)


def _row_boundaries(cfg: ModelConfig) -> list[int]:
    """Where the fused weights' parts start: a block layout's row blocks must not straddle them."""
    inters = _intermediate_sizes(cfg)
    if cfg.mla is not None:  # the query's first projection, then the latent's (MLAttention.qkv_a_proj)
        return [_mla_q_rows(cfg), *inters]
    return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, *inters]


def _intermediate_sizes(cfg: ModelConfig) -> list[int]:
    """The gated MLPs' intermediate sizes (0: none): dense layers', each expert's, the shared experts'."""
    return [
        cfg.intermediate_size,
        cfg.moe_intermediate_size,
        cfg.moe_intermediate_size * cfg.n_shared_experts,
    ]


def _mla_q_rows(cfg: ModelConfig) -> int:
    mla = cfg.mla
    assert mla is not None
    return mla.q_lora_rank or cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)


def _shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    h, mla = cfg.hidden_size, cfg.mla
    if mla is not None:
        heads_qk = cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        shapes = [(_mla_q_rows(cfg) + mla.latent_dim, h), (h, cfg.num_heads * mla.v_head_dim)]
        if mla.q_lora_rank:
            shapes.append((heads_qk, mla.q_lora_rank))
    else:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = [(q + 2 * kv, h), (h, q)]
    for inter in _intermediate_sizes(cfg):
        if inter:
            shapes += [(2 * inter, h), (h, inter)]
    return shapes


def _rotary_rows_stay_in_blocks(cfg: ModelConfig, bn: int) -> bool:
    """Whether the loader's reordering of DeepSeek's rotary rows (``rotary_row_order``) keeps every row in
    its scale block of ``bn`` rows, so that the blocks' scales stay theirs."""
    from engine.models.mla import rotary_row_order  # the models import this module's package

    if cfg.mla is None or not cfg.mla.rope_interleave:
        return True
    # q_b_proj is a weight of its own, q_proj (no query rank) the first rows of qkv_a_proj; the latent's
    # rows follow the query's there.
    return rows_stay_in_blocks(rotary_row_order(cfg, "q"), 0, bn) and rows_stay_in_blocks(
        rotary_row_order(cfg, "kv_a"), _mla_q_rows(cfg), bn
    )


def rows_stay_in_blocks(order: torch.Tensor, start: int, bn: int) -> bool:
    """Whether rows ``start + i`` taken from rows ``start + order[i]`` each stay in their block of ``bn``."""
    rows = torch.arange(len(order), device=order.device) + start
    return torch.equal((order + start) // bn, rows // bn)


def _block_fits(cfg: ModelConfig, block: tuple[int, int]) -> bool:
    return (
        all(kernel_layout_ok(block, n, k) for n, k in _shapes(cfg))
        and all(b % block[0] == 0 for b in _row_boundaries(cfg) if b)
        and _rotary_rows_stay_in_blocks(cfg, block[0])
    )


def online_fp8_layout(cfg: ModelConfig) -> Fp8Layout:
    """``quantization="fp8"`` over 16-bit weights: 128 x 128 blocks where every fused part is whole blocks,
    else a scale per row."""
    return Fp8Layout(ONLINE_BLOCK if _block_fits(cfg, ONLINE_BLOCK) else None)


def checkpoint_fp8_layout(
    cfg: ModelConfig, path: Path, quant: WeightQuantization, files: list[Path]
) -> tuple[Fp8Layout | None, str]:
    """The layout a float8 checkpoint's weights keep on the device, or None (widened at load) with the
    reason: every attention, MLP and expert weight must be float8 of one format, their scales one layout
    (blocks of one power-of-two size that fused parts do not straddle, or per row / per tensor)."""
    from safetensors import safe_open

    meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # every tensor's dtype and shape, from the headers
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                sl = f.get_slice(name)
                meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    fp8_dtype, block, per_row, count = None, None, False, 0
    for name, (dtype, shape) in sorted(meta.items()):
        if _FUSED_EXPERTS.match(name) and dtype in _SAFETENSORS_FP8:
            return None, f"{name}: float8 fused-experts tensors are widened"
        if not _LINEAR.match(name):
            continue
        kind = _SAFETENSORS_FP8.get(dtype)
        if kind is None:
            return None, f"{name} is {dtype}, not float8 e4m3 or e5m2"
        if fp8_dtype not in (None, kind):
            return None, "the weights mix float8 formats"
        fp8_dtype, count = kind, count + 1
        rows, cols = shape
        sname = scale_name(name, meta)
        if sname is None:
            return None, f"{name} has no scale"
        grid = meta[sname][1]
        if math.prod(grid) == 1 or grid in ((rows,), (rows, 1)):
            per_row = True
        elif len(grid) == 2:
            b = tuple(quant.block or (rows // grid[0], cols // grid[1]))
            if block not in (None, b):
                return None, f"{name}: scale blocks {b} differ from {block}"
            block = b
        else:
            return None, f"{name}: scale shape {grid} fits no layout"
    if count == 0:
        return None, "no float8 attention, MLP or expert weights"
    if block is not None and per_row:
        return None, "scales mix blocks and rows"
    if block is not None and not _block_fits(cfg, block):  # type: ignore[arg-type]
        return None, f"scale blocks {block} are not a layout the kernels read for these shapes"
    return Fp8Layout(block, fp8_dtype), ""  # type: ignore[arg-type]


def store_fp8(target: Fp8Weight, name: str, values: torch.Tensor, scale: torch.Tensor | None,
              rows: slice | None = None, expert: int | None = None) -> None:  # fmt: skip
    """A checkpoint's float8 tensor ``values`` [rows, K] with its ``scale`` into ``target`` (its layout from
    ``checkpoint_fp8_layout``): a per-tensor or per-row scale down the rows, block scales as they are."""
    if scale is None:
        raise UnsupportedModelError(
            f"{name} is float8 ({values.dtype}) but the checkpoint has no scale for it"
        )
    s = _scale_values(name, scale)
    n = values.shape[0]
    if target.block[0] == 1 and target.weight_scale.shape[-1] == 1:  # a scale per row
        if s.numel() == 1:
            s = s.reshape(1, 1).expand(n, 1)
        elif tuple(s.shape) in ((n,), (n, 1)):
            s = s.reshape(n, 1)
        else:
            raise UnsupportedModelError(
                f"{name}: scale shape {tuple(scale.shape)} is not per tensor or per row"
            )
    target.store_(values, s, rows, expert)
