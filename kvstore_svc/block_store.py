"""The KV offload store's two-tier block pool: host memory in the workers' KV layout, and a disk file.

Owns which block hash sits where (``cpu``: a slot of the host pool, ``disk``: a slot of the disk file), the
least-recently-used order of each tier, pins (blocks a reader is about to READ, never moved or dropped
while pinned) and the KV events every change makes. Host blocks are evicted to disk least recently used
first (only unpinned ones); disk blocks are dropped least recently used first. ``Fetch`` promotes disk
blocks back into host slots, since NIXL READs only the registered host pool.

The servicer calls it from its event loop only. No gRPC and no NIXL here. Disk I/O is ``pwrite``/``preadv``
of whole blocks (one block, all layers, is one contiguous byte range) on one thread of its own, in the order
the store decides it: the state changes at once, and the caller awaits ``take_io()``'s futures before it
lets anything touch the slots they concern (the servicer: before a Put's READ into host slots a demotion
freed, before a Fetch answers promoted blocks). One thread in order keeps every other case right: a disk
slot written and then read, or freed and written again, and a host slot written out and then read into, see
the operations in the order they were asked for.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mesh.host_memory import HostBlocks
from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, Tier
from mesh.kv_layout import KVLayout

__all__ = ["BlockStore", "DiskIO", "PutPlan"]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass
class _Entry:
    tier: Tier
    slot: int
    pins: int = 0


@dataclass
class PutPlan:
    """One Put's decisions: ``read[i] = (index in the offer, host slot)`` to READ into, hashes held
    already, and how many were declined (no free or evictable slot)."""

    hashes: list[int]
    read: list[tuple[int, int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    declined: int = 0


@dataclass
class DiskIO:
    """A disk operation in flight: a block written out of host slot (``demote``) or read into one
    (``promote``)."""

    future: Future
    kind: str
    block_hash: int


class BlockStore:
    def __init__(
        self,
        layout: KVLayout,
        host_blocks: int,
        disk_path: str | None = None,
        disk_blocks: int = 0,
        publish: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        if host_blocks < 1:
            raise ValueError(f"the store needs at least one host block, got {host_blocks}")
        if disk_blocks < 0 or (disk_blocks and not disk_path):
            raise ValueError("a disk tier needs disk_path and a positive number of disk blocks")
        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks if disk_path else 0
        # Huge pages: the workers' READs of this memory (cma) ran 1.2-1.7x faster from them on the CPU
        # machine (mesh.host_memory).
        self._host = HostBlocks((host_blocks, *layout.block_shape), _TORCH_DTYPES[layout.dtype])
        self.pool = self._host.tensor
        # The same memory as bytes, one row per block (float8 tensors have no numpy view of their own).
        self._host_bytes = self.pool.view(torch.uint8).reshape(host_blocks, self.block_nbytes).numpy()
        self._fd: int | None = None
        self._io: ThreadPoolExecutor | None = None
        self._pending: list[DiskIO] = []
        self._reading: dict[int, DiskIO] = {}  # promotions whose read may still run
        if self.disk_blocks:
            self._fd = os.open(disk_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            size = self.disk_blocks * self.block_nbytes
            try:
                os.posix_fallocate(self._fd, 0, size)  # fail now, not on the first eviction, if it cannot fit
            except OSError as exc:
                os.close(self._fd)
                raise OSError(
                    f"cannot preallocate {size} bytes for the disk tier at {disk_path}: {exc}"
                ) from exc
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk")
        self.publish = publish
        self._entries: dict[int, _Entry] = {}
        self._lru: dict[Tier, OrderedDict[int, None]] = {Tier.CPU: OrderedDict(), Tier.DISK: OrderedDict()}
        self._free: dict[Tier, list[int]] = {
            Tier.CPU: list(range(host_blocks - 1, -1, -1)),  # pop() hands out the lowest slot first
            Tier.DISK: list(range(self.disk_blocks - 1, -1, -1)),
        }
        self._incoming: set[int] = set()  # hashes a Put is reading now
        self._events: list[KVEvent] = []
        # Counters (read them; only this class writes them).
        self.blocks_put = 0
        self.blocks_declined = 0
        self.blocks_demoted = 0
        self.blocks_dropped = 0
        self.blocks_promoted = 0

    # ---- queries ------------------------------------------------------------------------------------
    def tier_of(self, h: int) -> Tier | None:
        e = self._entries.get(h)
        return e.tier if e is not None else None

    def prefix_tiers(self, hashes: Sequence[int]) -> list[Tier]:
        """Tiers of the longest held prefix of the chain (no LRU change: a lookup is not a use)."""
        out = []
        for h in hashes:
            e = self._entries.get(h)
            if e is None:
                break
            out.append(e.tier)
        return out

    def used(self, tier: Tier) -> int:
        total = self.host_blocks if tier is Tier.CPU else self.disk_blocks
        return total - len(self._free[tier])

    def pins(self, h: int) -> int:
        e = self._entries.get(h)
        return e.pins if e is not None else 0

    def read_block(self, h: int) -> bytes:
        """A held block's bytes, from whichever tier holds it (tests, debugging)."""
        e = self._entries[h]
        if e.tier is Tier.CPU:
            return self._host_bytes[e.slot].tobytes()
        assert self._fd is not None and self._io is not None
        # Behind the writes asked for before it.
        return self._io.submit(os.pread, self._fd, self.block_nbytes, e.slot * self.block_nbytes).result()

    def take_io(self) -> list[DiskIO]:
        """The disk operations asked for since the last call (await them before the slots they concern are
        used: see the module's docstring)."""
        pending, self._pending = self._pending, []
        return pending

    def discard(self, hashes: Sequence[int]) -> None:
        """Forget blocks whose bytes cannot be trusted (a disk operation failed); their slots are free."""
        for h in hashes:
            e = self._entries.pop(h, None)
            self._reading.pop(h, None)
            if e is None:
                continue
            self._lru[e.tier].pop(h, None)
            self._free[e.tier].append(e.slot)
            self._events.append(BlocksRemoved((h,), e.tier))
            self.blocks_dropped += 1
        self._flush()

    def snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild what the store holds from nothing (an index resync)."""
        out: list[KVEvent] = [AllBlocksCleared(Tier.CPU), AllBlocksCleared(Tier.DISK)]
        for tier in (Tier.CPU, Tier.DISK):
            hashes = tuple(h for h, e in self._entries.items() if e.tier is tier)
            if hashes:
                out.append(BlocksStored(hashes, tier))
        return out

    # ---- put ----------------------------------------------------------------------------------------
    def plan_put(self, hashes: Sequence[int]) -> PutPlan:
        """Host slots for the offered blocks not held yet, in chain order; the rest of the chain is declined
        from the first block that finds no slot. Blocks held already count as used."""
        plan = PutPlan(list(hashes))
        for i, h in enumerate(hashes):
            if h in self._entries:
                plan.held.append(h)
                continue
            if h in self._incoming:  # another Put reads it now: not this call's to answer
                continue
            slot = self._alloc_host()
            if slot is None:
                plan.declined = len(hashes) - i
                break
            self._incoming.add(h)
            plan.read.append((i, slot))
        for h in reversed(plan.held):  # used again: the chain's tail stays the first to go
            self._touch(h, self._entries[h])
        self.blocks_declined += plan.declined
        self._flush()
        return plan

    def commit_put(self, plan: PutPlan, parent: int | None) -> list[int]:
        """The READ landed: index the new blocks (host tier). Returns every hash now held, in chain order."""
        new = {plan.hashes[i] for i, _ in plan.read}
        run: list[int] = []
        run_parent = parent
        prev = parent
        for i, slot in plan.read:
            h = plan.hashes[i]
            self._incoming.discard(h)
            self._entries[h] = _Entry(Tier.CPU, slot)
            chain_prev = plan.hashes[i - 1] if i > 0 else parent
            if run and chain_prev != prev:
                self._events.append(BlocksStored(tuple(run), Tier.CPU, run_parent))
                run = []
            if not run:
                run_parent = chain_prev
            run.append(h)
            prev = h
        if run:
            self._events.append(BlocksStored(tuple(run), Tier.CPU, run_parent))
        # Most recently used, the chain's tail first to go: a prefix without its head is worth nothing.
        for i, _ in reversed(plan.read):
            self._lru[Tier.CPU][plan.hashes[i]] = None
        self.blocks_put += len(plan.read)
        self._flush()
        held = set(plan.held) | new
        return [h for h in plan.hashes if h in held]

    def abort_put(self, plan: PutPlan) -> None:
        """The READ failed: give the reserved slots back."""
        for i, slot in plan.read:
            self._incoming.discard(plan.hashes[i])
            self._free[Tier.CPU].append(slot)
        plan.read = []

    # ---- fetch --------------------------------------------------------------------------------------
    def pin_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Pin the longest held prefix in host memory, promoting disk blocks (stopping at the first one no
        host slot can take); returns the host slots of the pinned blocks, in chain order. Blocks an earlier
        call is still reading back from disk come with that read among ``take_io()``'s operations."""
        n = len(self.prefix_tiers(hashes))
        chain = list(hashes[:n])
        # Host blocks of the prefix first, so that promoting the disk ones cannot evict them.
        for h in chain:
            e = self._entries[h]
            if e.tier is Tier.CPU:
                self._pin(h, e)
                reading = self._reading.get(h)
                if reading is not None:
                    if reading.future.done():
                        del self._reading[h]
                    else:
                        self._pending.append(reading)
        # The chain's disk blocks out of the disk LRU while host slots are made: a demotion that needs a disk
        # slot must not drop (and overwrite) a block this call is about to read back.
        on_disk = [h for h in chain if self._entries[h].tier is Tier.DISK]
        for h in on_disk:
            self._lru[Tier.DISK].pop(h, None)
        slots: list[int] = []
        for i, h in enumerate(chain):
            e = self._entries[h]
            if e.tier is Tier.DISK:
                slot = self._alloc_host()
                if slot is None:
                    for later in chain[i:]:
                        le = self._entries.get(later)
                        if le is not None and le.tier is Tier.CPU and le.pins:
                            self._unpin(later, le)
                        elif le is not None and le.tier is Tier.DISK:
                            self._lru[Tier.DISK][later] = None  # back, most recently used
                    break
                self._promote(h, e, slot)
                self._pin(h, e)
            slots.append(e.slot)
        self._flush()
        return slots

    def unpin(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):  # the chain's tail becomes the least recently used
            e = self._entries.get(h)
            if e is not None and e.pins:
                self._unpin(h, e)

    # ---- tiers --------------------------------------------------------------------------------------
    def _touch(self, h: int, e: _Entry) -> None:
        lru = self._lru[e.tier]
        if h in lru:
            lru.move_to_end(h)

    def _pin(self, h: int, e: _Entry) -> None:
        e.pins += 1
        self._lru[Tier.CPU].pop(h, None)

    def _unpin(self, h: int, e: _Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            self._lru[Tier.CPU][h] = None  # most recently used

    def _alloc_host(self) -> int | None:
        """A free host slot, making one by evicting the least recently used unpinned host block to disk."""
        free = self._free[Tier.CPU]
        if free:
            return free.pop()
        lru = self._lru[Tier.CPU]
        if not lru:
            return None  # every host block is pinned or being read
        h, _ = lru.popitem(last=False)
        e = self._entries[h]
        slot = e.slot
        self._events.append(BlocksRemoved((h,), Tier.CPU))
        disk_slot = self._alloc_disk()
        if disk_slot is None:
            del self._entries[h]
            self.blocks_dropped += 1
        else:
            assert self._fd is not None and self._io is not None
            write = self._io.submit(_write, self._fd, self._host_bytes[slot], disk_slot * self.block_nbytes)
            self._pending.append(DiskIO(write, "demote", h))
            e.tier, e.slot = Tier.DISK, disk_slot
            self._lru[Tier.DISK][h] = None
            self._events.append(BlocksStored((h,), Tier.DISK))
            self.blocks_demoted += 1
        return slot

    def _alloc_disk(self) -> int | None:
        if not self.disk_blocks:
            return None
        free = self._free[Tier.DISK]
        if free:
            return free.pop()
        if not self._lru[Tier.DISK]:
            return None  # every disk block is being read back
        h, _ = self._lru[Tier.DISK].popitem(last=False)
        e = self._entries.pop(h)
        self._events.append(BlocksRemoved((h,), Tier.DISK))
        self.blocks_dropped += 1
        return e.slot

    def _promote(self, h: int, e: _Entry, slot: int) -> None:
        assert self._fd is not None and self._io is not None
        read = DiskIO(self._io.submit(_read, self._fd, self._host_bytes[slot], e.slot * self.block_nbytes, h),
                      "promote", h)  # fmt: skip
        self._pending.append(read)
        self._reading[h] = read
        self._lru[Tier.DISK].pop(h, None)
        self._free[Tier.DISK].append(e.slot)
        e.tier, e.slot = Tier.CPU, slot
        self._events.append(BlocksRemoved((h,), Tier.DISK))
        self._events.append(BlocksStored((h,), Tier.CPU))
        self.blocks_promoted += 1

    def _flush(self) -> None:
        if self._events and self.publish is not None:
            self.publish(self._events)
        self._events = []

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write(fd: int, block, offset: int) -> None:
    n = os.pwrite(fd, block.data, offset)
    if n != block.nbytes:
        raise OSError(f"short write to the disk tier: {n} of {block.nbytes} bytes")


def _read(fd: int, block, offset: int, h: int) -> None:
    n = os.preadv(fd, [block.data], offset)
    if n != block.nbytes:
        raise OSError(f"short read of block {h:016x} from the disk tier: {n} of {block.nbytes} bytes")
