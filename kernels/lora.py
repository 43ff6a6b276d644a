"""LoRA over stacked adapter slots: PyTorch reference (the op table's ``lora_apply``).

``engine/lora.py`` holds the slots: ``a`` [S*W, K] (each slot's A rows, W per slot), ``b`` [M, S*W] (each
slot's B columns, scale folded in), and ``row_slots`` [>= T, S], one-hot: the slot of each row of the pass (a
zero row for none). The op returns ``y + ((x a^T) masked to each row's slot) b^T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_apply_torch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """x [T, K], y [T, M] (the projection's output) -> y + LoRA, [T, M]; three kernels: the shrink over
    every slot, the row mask, the expand fused with the add. ``y`` may be reused for the result."""
    rows, slots = x.shape[0], row_slots.shape[1]
    t = F.linear(x, a)
    t = (t.view(rows, slots, -1) * row_slots[:rows, :, None]).view(rows, -1)
    return torch.addmm(y, t, b.t())
