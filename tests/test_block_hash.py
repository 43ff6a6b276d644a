"""The one block-hash definition: chained xxh3_64 over u32 LE token ids, full blocks only."""

from __future__ import annotations

import struct

import xxhash

from mesh.block_hash import block_hashes, hash_block, root_hash


def test_hash_matches_the_documented_formula() -> None:
    root = root_hash("model-x:float32")
    tokens = list(range(100, 116))
    expected = xxhash.xxh3_64_intdigest(struct.pack("<Q", root) + struct.pack("<16I", *tokens))
    assert hash_block(root, tokens) == expected
    assert block_hashes(tokens, 16, root) == [expected]


def test_only_full_blocks_chain_and_resume() -> None:
    root = root_hash("m")
    tokens = list(range(70))
    hashes = block_hashes(tokens, 16, root)
    assert len(hashes) == 4  # 70 tokens: 4 full blocks, the partial one is not hashed
    prev, manual = root, []
    for i in range(4):
        prev = hash_block(prev, tokens[i * 16 : (i + 1) * 16])
        manual.append(prev)
    assert hashes == manual
    assert block_hashes(tokens, 16, hashes[1], start=2) == hashes[2:]
    # A different earlier block changes every later hash (chaining), and so do the model and the salt.
    other = block_hashes([999, *tokens[1:]], 16, root)
    assert all(a != b for a, b in zip(hashes, other, strict=True))
    assert block_hashes(tokens, 16, root_hash("m", cache_salt="tenant-a"))[0] != hashes[0]
    assert block_hashes(tokens, 16, root, salt=b"lora")[0] != hashes[0]
