"""The one definition of a KV block's identity.

Used by the engine's prefix cache, the router, the KV index and the KV store alike:

    h_i = xxh3_64(h_{i-1} as u64 LE || token ids of block i as u32 LE || salt)

with ``h_{-1}`` the root hash of the model fingerprint (and cache salt, LoRA id where those exist).
Only full blocks are hashed. This module must stay free of torch and of any service code.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

_U64 = struct.Struct("<Q")


def root_hash(model_fingerprint: str, cache_salt: str | None = None, lora_id: str | None = None) -> int:
    """h_{-1}: the chain's starting point for one model (and optional cache salt and LoRA adapter)."""
    parts = [model_fingerprint, cache_salt or "", lora_id or ""]
    return xxhash.xxh3_64_intdigest("\x1f".join(parts).encode())


def salted_fingerprint(model_fingerprint: str, cache_salt: str | None) -> str:
    """The fingerprint a worker with an engine-wide cache salt publishes: its own cache domain. Routers
    and indexes key everything by the published fingerprint, so a request's own ``cache_salt`` combines
    with the engine's through ``root_hash(salted_fingerprint(...), request_salt)``, and the router,
    which only knows the published fingerprint, computes the same chain. The salt itself is not shown."""
    if not cache_salt:
        return model_fingerprint
    return f"{model_fingerprint}:salt-{xxhash.xxh3_64_hexdigest(cache_salt.encode())[:12]}"


def hash_block(prev_hash: int, token_ids: Sequence[int], salt: bytes = b"") -> int:
    """Hash one full block chained to the hash of the block before it."""
    tokens = np.asarray(token_ids, dtype="<u4").tobytes()
    return xxhash.xxh3_64_intdigest(_U64.pack(prev_hash) + tokens + salt)


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: int, salt: bytes = b"", start: int = 0
) -> list[int]:
    """Hashes of every full block of ``token_ids``; ``start`` full blocks may be skipped by passing
    the hash of block ``start - 1`` as ``root``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    if n_full <= start:
        return []
    # One conversion for the whole prompt, then byte slices: same bytes as hash_block, far fewer calls.
    tokens = array("I", token_ids[start * block_size : n_full * block_size])
    if sys.byteorder != "little":
        tokens.byteswap()
    data = tokens.tobytes()
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    pack = _U64.pack
    out: list[int] = []
    prev = root
    for off in range(0, len(data), step):
        prev = digest(pack(prev) + data[off : off + step] + salt)
        out.append(prev)
    return out
