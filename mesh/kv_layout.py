"""The KV pool layout and its fingerprint, checked before any KV byte moves between workers.

Pool shape is block-major: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; one block
of one request, all layers, is one contiguous region of ``block_nbytes`` bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# kv_cache_dtype's values, as vLLM and SGLang name them, and the pool dtype each names (KVLayout.dtype; auto:
# the weights' dtype). Here, not in the engine, so that ``pdmesh up`` offers the same choices without
# importing the engine.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


@dataclass(frozen=True)
class KVLayout:
    model_fingerprint: str
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def fingerprint(self) -> str:
        text = (
            f"v1|{self.model_fingerprint}|{self.dtype}|bs={self.block_size}|layers={self.num_layers}"
            f"|kvh={self.num_kv_heads}|hd={self.head_dim}|block-major"
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class LayoutMismatchError(ValueError):
    """Two workers' KV layouts differ: no bytes may move between them."""


def check_compatible(local: KVLayout, remote_fingerprint: str) -> None:
    if local.fingerprint != remote_fingerprint:
        raise LayoutMismatchError(
            f"KV layout fingerprint mismatch: local {local.fingerprint} ({local}) != remote {remote_fingerprint}; "
            "both workers must serve the same model, dtype, block size and KV shape"
        )
