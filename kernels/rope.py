"""Rotary position embedding (rotate-half / NeoX style, as Llama and Qwen use): PyTorch reference.

The cos/sin cache (llama3 scaling included) is built by the model; the op only applies it.
"""

from __future__ import annotations

import torch


def apply_rope_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T], cos_sin_cache: [max_pos, D] (cos half || sin half), fp32."""
    cs = cos_sin_cache[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rot(q), rot(k)
