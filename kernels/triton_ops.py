"""The Triton op table: the same ops and signatures as ``kernels.ops.TORCH_OPS``, backed by Triton kernels.

Imported lazily by ``kernels.ops.get_ops("triton")`` so that the CPU path never needs triton.
"""

from __future__ import annotations

from kernels.ops import Ops
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_attention import paged_attention_triton, qkv_attention_triton
from kernels.triton_copy_rows import copy_rows_triton
from kernels.triton_kv_cache import write_kv_triton
from kernels.triton_linear import add_rms_norm_linear_triton, linear_triton, silu_mul_linear_triton
from kernels.triton_lora import lora_apply_small
from kernels.triton_mla import (
    mla_attention_triton,
    mla_prefill_triton,
    mla_prologue_triton,
    mla_value_proj_triton,
    moe_route_grouped_triton,
)
from kernels.triton_moe import fused_moe_triton
from kernels.triton_moe_routing import moe_route_triton
from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton
from kernels.triton_prologue import qkv_prologue_triton
from kernels.triton_rope import apply_rope_triton
from kernels.triton_sampling import gumbel_sample_triton

TRITON_OPS = Ops(
    name="triton",
    rms_norm=rms_norm_triton,
    fused_add_rms_norm=fused_add_rms_norm_triton,
    apply_rope=apply_rope_triton,
    silu_and_mul=silu_and_mul_triton,
    write_kv=write_kv_triton,
    paged_attention=paged_attention_triton,
    fused_moe=fused_moe_triton,
    moe_route=moe_route_triton,
    qkv_prologue=qkv_prologue_triton,
    qkv_attention=qkv_attention_triton,
    linear=linear_triton,
    add_rms_norm_linear=add_rms_norm_linear_triton,
    silu_mul_linear=silu_mul_linear_triton,
    gumbel_sample=gumbel_sample_triton,
    # Two kernels up to 16 rows, the reference's cuBLAS GEMMs beyond (measured on an H100: performance.md).
    lora_apply=lora_apply_small,
    copy_rows=copy_rows_triton,
    # DeepSeek-V3: the latent attention in Triton; prompt chunks unabsorbed where that is less arithmetic.
    moe_route_grouped=moe_route_grouped_triton,
    mla_attention=mla_attention_triton,
    mla_prologue=mla_prologue_triton,
    mla_value_proj=mla_value_proj_triton,
    mla_prefill=mla_prefill_triton,
)
