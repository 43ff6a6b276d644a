"""The KV offload store's disk tier off the event loop (``kvstore_svc/block_store.py``): writes and reads on
the store's disk thread, in the order asked for, awaited by the caller before the slots are used; a second
Fetch of a block still being read back waits for that read; a failed read drops the block; a Fetch never
drops (and overwrites) a disk block it is reading back to make room for another."""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import wait

import torch

from kvstore_svc.block_store import BlockStore
from mesh.kv_events import Tier
from mesh.kv_layout import KVLayout

LAYOUT = KVLayout("disk-test", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def _put(store: BlockStore, hashes: list[int], seed: int) -> dict[int, bytes]:
    """Offer ``hashes``, wait for the demotions the plan asked for, fill the slots (as the READ would)."""
    plan = store.plan_put(hashes)
    wait([op.future for op in store.take_io()])
    g = torch.Generator().manual_seed(seed)
    written = {}
    for i, slot in plan.read:
        store.pool[slot] = torch.randn(LAYOUT.block_shape, generator=g)
        written[hashes[i]] = store.pool[slot].numpy().tobytes()
    store.commit_put(plan, None)
    return written


def test_blocks_go_to_disk_and_come_back_through_the_disk_thread(tmp_path) -> None:
    store = BlockStore(LAYOUT, 2, str(tmp_path / "kv.bin"), 6)
    gate = threading.Event()
    try:
        data = _put(store, [1, 2], seed=1)
        data |= _put(store, [3, 4], seed=2)  # 1 and 2 written out; their host slots then take 3 and 4
        assert store.tier_of(1) is Tier.DISK and store.tier_of(3) is Tier.CPU
        assert store.read_block(1) == data[1]  # read behind the write
        store._io.submit(gate.wait)  # the disk thread held: what follows stays in flight until the gate opens
        slots = store.pin_prefix([1, 2])  # both back: 3 and 4 written out first, into the same host slots
        ops = store.take_io()
        assert sorted(op.kind for op in ops) == ["demote", "demote", "promote", "promote"]
        # A second reader of the chain gets the reads still in flight with its answer.
        again = store.pin_prefix([1, 2])
        pending = store.take_io()
        reads = [op for op in ops if op.kind == "promote"]
        assert again == slots and pending == reads and not any(op.future.done() for op in pending)
        gate.set()
        wait([op.future for op in ops])
        for h, slot in zip([1, 2], slots, strict=True):
            assert store.pool[slot].numpy().tobytes() == data[h]
        assert store.read_block(3) == data[3] and store.read_block(4) == data[4]
        store.unpin([1, 2])
        store.unpin([1, 2])
        assert store.pin_prefix([1]) == slots[:1] and store.take_io() == []  # reads done: nothing to wait for
    finally:
        gate.set()  # a failed check must not leave the disk thread held (close waits for it)
        store.close()


def test_a_failed_read_from_disk_is_reported_and_the_block_dropped(tmp_path) -> None:
    store = BlockStore(LAYOUT, 2, str(tmp_path / "kv.bin"), 4)
    try:
        _put(store, [7, 8], seed=3)
        _put(store, [9], seed=4)  # 8 (the chain's tail) to disk
        assert store.tier_of(8) is Tier.DISK
        store.discard([9])  # a free host slot: reading 8 back needs no demotion (which would grow the file)
        os.ftruncate(store._fd, 0)  # the file loses its blocks: the read comes back short
        assert store.pin_prefix([7, 8]) != []
        ops = store.take_io()
        read = next(op for op in ops if op.kind == "promote")
        assert isinstance(read.future.exception(timeout=5), OSError)
        assert read.block_hash == 8
        store.unpin([7, 8])
        store.discard([read.block_hash])
        assert store.tier_of(8) is None and store.tier_of(7) is Tier.CPU and store.used(Tier.CPU) == 1
    finally:
        store.close()


def test_many_random_moves_keep_every_block_s_bytes(tmp_path) -> None:
    """Random offers and fetches over small tiers: whatever the store still holds reads back as written."""
    rng = random.Random(0)
    store = BlockStore(LAYOUT, 3, str(tmp_path / "kv.bin"), 5)
    data: dict[int, bytes] = {}
    try:
        for step in range(60):
            if rng.random() < 0.5:
                chain = [rng.randrange(20) for _ in range(rng.randrange(1, 3))]
                data |= {h: b for h, b in _put(store, list(dict.fromkeys(chain)), seed=step).items()}
            else:
                h = rng.randrange(20)
                slots = store.pin_prefix([h])
                wait([op.future for op in store.take_io()])
                if slots:
                    assert store.pool[slots[0]].numpy().tobytes() == data[h]
                    store.unpin([h])
        held = [h for h in data if store.tier_of(h) is not None]
        assert held and all(store.read_block(h) == data[h] for h in held)
    finally:
        store.close()


def test_a_fetch_does_not_drop_the_disk_block_it_reads_back(tmp_path) -> None:
    """Both tiers full, the fetched block the least recently used on disk: the host block demoted to make
    room finds no disk slot and is dropped, rather than overwriting the block being read back."""
    store = BlockStore(LAYOUT, 1, str(tmp_path / "kv.bin"), 1)
    try:
        data = _put(store, [1], seed=5)
        data |= _put(store, [2], seed=6)  # 1 to disk: both tiers full
        slots = store.pin_prefix([1])
        wait([op.future for op in store.take_io()])
        assert store.pool[slots[0]].numpy().tobytes() == data[1]
        assert store.tier_of(2) is None and store.blocks_dropped == 1
    finally:
        store.close()
