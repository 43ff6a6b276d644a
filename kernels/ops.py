"""The op table: which implementation of each op the model calls, chosen by ``kernel_backend``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels.activation import silu_and_mul_torch
from kernels.attention import paged_attention_torch
from kernels.copy_rows import copy_rows_torch
from kernels.kv_cache import write_kv_torch
from kernels.linear import add_rms_norm_linear_torch, linear_torch, silu_mul_linear_torch
from kernels.lora import lora_apply_torch
from kernels.mla_attention import (
    mla_attention_torch,
    mla_prefill_torch,
    mla_prologue_torch,
    mla_value_proj_torch,
)
from kernels.moe import fused_moe_torch
from kernels.moe_routing import moe_route_grouped_torch, moe_route_torch
from kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.qkv_prologue import qkv_attention_torch, qkv_prologue_torch
from kernels.rope import apply_rope_torch
from kernels.sampling import gumbel_sample_torch

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_attention: Callable
    fused_moe: Callable
    moe_route: Callable
    qkv_prologue: Callable
    qkv_attention: Callable  # the prologue and attention as one op (folded into one kernel in decode)
    linear: Callable
    add_rms_norm_linear: Callable  # a layer's norm and the projection that reads it (fused at batch 1)
    silu_mul_linear: Callable  # a gated MLP's activation, down projection and an add (fused at batch 1)
    gumbel_sample: (
        Callable  # the sampling race, with top-k, top-p and min-p (engine/sampler.py picks the rows)
    )
    lora_apply: Callable  # a projection's output plus the LoRA of each row's adapter slot (engine/lora.py)
    copy_rows: Callable  # dst[dst_rows] = src[src_rows] (expert slots moved by a new placement)
    moe_route_grouped: Callable  # DeepSeek's routing (V3: sigmoid, bias; V2: softmax; expert groups)
    mla_attention: Callable  # latent attention (DeepSeek's MLA) over the pool
    mla_prologue: (
        Callable  # MLA between projections and attention: latent norm, RoPE, KV write, W_uk absorbed
    )
    mla_value_proj: Callable  # MLA's per-head value projection (W_uv) of the latent outputs
    mla_prefill: Callable  # MLA of one sequence's prompt queries, unabsorbed (keys and values up-projected)


TORCH_OPS = Ops(
    name="torch",
    rms_norm=rms_norm_torch,
    fused_add_rms_norm=fused_add_rms_norm_torch,
    apply_rope=apply_rope_torch,
    silu_and_mul=silu_and_mul_torch,
    write_kv=write_kv_torch,
    paged_attention=paged_attention_torch,
    fused_moe=fused_moe_torch,
    moe_route=moe_route_torch,
    qkv_prologue=qkv_prologue_torch,
    qkv_attention=qkv_attention_torch,
    linear=linear_torch,
    add_rms_norm_linear=add_rms_norm_linear_torch,
    silu_mul_linear=silu_mul_linear_torch,
    gumbel_sample=gumbel_sample_torch,
    lora_apply=lora_apply_torch,
    copy_rows=copy_rows_torch,
    moe_route_grouped=moe_route_grouped_torch,
    mla_attention=mla_attention_torch,
    mla_prologue=mla_prologue_torch,
    mla_value_proj=mla_value_proj_torch,
    mla_prefill=mla_prefill_torch,
)


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        try:
            from kernels.triton_ops import TRITON_OPS
        except ImportError as exc:
            raise ValueError(
                f"kernel_backend='triton' needs the triton package and kernels.triton_ops ({exc}); "
                "use kernel_backend='torch'"
            ) from exc
        return TRITON_OPS
    raise ValueError(f"unknown kernel_backend {backend!r}; choose one of {BACKENDS}")
