"""The worker's KV pool: one block-major tensor, sized from settings, and its layout."""

from __future__ import annotations

import torch

from engine.loader import DTYPES
from engine.models.model_config import ModelConfig
from mesh.kv_layout import KV_CACHE_DTYPES, KVLayout

# The pool's dtype by name (KVLayout.dtype): the weights' dtypes, float8 e4m3 (``kv_cache_dtype`` fp8) and
# float8 e5m2 (fp8_e5m2).
KV_DTYPES = {**DTYPES, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def kv_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The pool dtype's name for the ``kv_cache_dtype`` setting, with ``dtype`` the weights'."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def make_layout(
    cfg: ModelConfig, fingerprint: str, dtype: str, block_size: int, draft_layers: int = 0
) -> KVLayout:
    """``draft_layers``: pool layers after the decoder's, for a draft's attention (the MTP layer's,
    engine.models.mtp): every block then holds its KV too, so it moves with the decoder's."""
    return KVLayout(
        fingerprint, dtype, block_size, cfg.num_layers + draft_layers, cfg.num_kv_heads, cfg.kv_head_dim
    )


def draft_layers(speculative_config: str | None) -> int:
    """The pool layers a speculative config adds after the decoder's: one for method mtp."""
    from engine.speculative import MtpSpec, parse_speculative_config

    return 1 if isinstance(parse_speculative_config(speculative_config), MtpSpec) else 0


def num_blocks_for(layout: KVLayout, memory_gb: float) -> int:
    return max(1, int(memory_gb * (1 << 30)) // layout.block_nbytes)


def allocate_pool(layout: KVLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of the layout's dtype,
    contiguous, zero-filled."""
    return torch.zeros((num_blocks, *layout.block_shape), dtype=KV_DTYPES[layout.dtype], device=device)
