"""Float8 checkpoints: which quantised checkpoints the loader reads, and their weights widened as they load.

pdmesh reads checkpoints whose linear weights are stored in float8 with float32 scales, in the formats vLLM
and SGLang serve:

- ``fp8`` (transformers' fine-grained FP8, as in Qwen3-*-FP8 and DeepSeek-V3): ``<name>.weight_scale_inv``,
  one multiplier per block of ``weight_block_size`` (128 x 128) weights;
- ``compressed-tensors`` float-quantised (llm-compressor, e.g. RedHatAI's ``*-FP8`` and ``*-FP8-dynamic``):
  ``<name>.weight_scale`` per tensor, per output channel or per block;
- ``modelopt`` FP8 (NVIDIA ModelOpt; ``hf_quant_config.json`` or ``quantization_config``) and ``fbgemm_fp8``:
  ``<name>.weight_scale`` per tensor or per output channel.

Each float8 weight is multiplied by its scale in float32 and rounded once to the engine's dtype as it loads:
transformers' own arithmetic when it loads such a checkpoint without a GPU (``FineGrainedFP8Config(
dequantize=True)``, which a test compares against). The engine then computes with weights of its dtype
("w8a16"): the checkpoint's outputs, not its memory saving (the weights take a 16-bit checkpoint's room),
and activations are not quantised (vLLM's and SGLang's float8 GEMMs quantise them per token or per tensor,
so their outputs differ from these by that rounding). Static activation scales (``input_scale``) are
therefore not used. Every other quantisation (GPTQ, AWQ, bitsandbytes, integer or 4-bit compressed-tensors,
NVFP4, ...) is refused by name, before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import UnsupportedModelError

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
