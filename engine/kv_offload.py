"""The engine's side of KV offloading: which blocks go to the KV offload store, and blocks loaded back.

Owns two block lifecycles on top of ``BlockPool``, both run on the engine thread (through
``AsyncEngine.call``):

- **Offload.** When a request finishes (a prefill worker's held request: when its lease ends), ``collect``
  takes the chain of its full blocks that are cached here, leaves out the leading ones the store is known
  to hold, takes a reference on the rest (so that nothing reuses them while the store READs them) and
  queues them as an ``OffloadBatch``. The worker ``take``s the batches, offers them to the store, and
  ``finish``es each with the hashes the store answered it holds: the references are dropped, the blocks
  stay in the local prefix cache.
- **Load.** ``reserve_load`` takes fresh blocks for a chain of hashes the store holds (the KV-import
  machinery: ``LLMEngine.take_transfer_blocks``), the worker READs the store's blocks into them, and
  ``commit_load`` enters them into the prefix cache (with their KV "stored" events), most recently used,
  so the request added right after, in the same engine call, hits them; ``cancel_load`` gives them back.

It also builds the KV layout of a model without loading its weights (``layout_for_model``), for the store.
No gRPC and no transfers here: ``mesh.kv_offload_client`` does those.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh.kv_layout import KVLayout

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sequence import Sequence

__all__ = ["KVOffload", "OffloadBatch", "layout_for_model"]

# Hashes remembered as held by the store (offered and stored, or loaded from it): LRU, this many at most.
KNOWN_STORED_CAPACITY = 1 << 16


@dataclass(frozen=True)
class OffloadBatch:
    """Blocks of one chain offered to the store: ``block_ids[i]`` holds ``block_hashes[i]``; each holds one
    reference until ``KVOffload.finish``."""

    batch_id: int
    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    parent_hash: int | None


@dataclass(frozen=True)
class _Load:
    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    parent_hash: int | None


class KVOffload:
    """Offload candidates and loads of one engine. Every method runs on the engine thread.

    ``max_held_blocks``: most blocks referenced for offloading at once (the rest of a finished request's
    chain is not offered: counted in ``blocks_dropped``). ``on_ready`` runs (on the engine thread) when a
    batch was queued: the worker's hook to wake its offloading task.
    """

    def __init__(
        self, engine: LLMEngine, max_held_blocks: int, on_ready: Callable[[], None] | None = None
    ) -> None:
        if max_held_blocks < 1:
            raise ValueError(f"max_held_blocks must be >= 1, got {max_held_blocks}")
        self.engine = engine
        self.pool = engine.block_pool
        self.max_held_blocks = max_held_blocks
        self.on_ready = on_ready
        self.at_prefill = (
            False  # also offer a prompt's blocks at its first token (LLMEngine.enable_kv_offload)
        )
        self._ids = itertools.count(1)
        self._queued: list[OffloadBatch] = []  # collected, not taken yet
        self._offering: dict[int, OffloadBatch] = {}  # taken, the store has not answered
        self._offered_hashes: set[int] = set()  # hashes of queued and offering batches
        self._loads: dict[str, _Load] = {}
        self._known: OrderedDict[int, None] = OrderedDict()
        self.num_held_blocks = 0
        # Counters (read them; only this class writes them).
        self.blocks_offered = 0
        self.blocks_dropped = 0
        self.blocks_stored = 0
        self.blocks_loaded = 0

    # ---- offload ------------------------------------------------------------------------------------
    def collect(self, seq: Sequence) -> None:
        """Queue the cached full blocks of ``seq`` the store is not known to hold: a finished one's (called
        by the engine after it freed them: they are cached, unreferenced, and nothing ran in between), or a
        running one's prompt at its first token (its blocks then have the sequence's references too)."""
        pool = self.pool
        chain: list[int] = []
        for h in seq.block_hashes:
            if h not in pool.hash_to_block:
                break
            chain.append(h)
        start = 0
        while start < len(chain) and (chain[start] in self._known or chain[start] in self._offered_hashes):
            start += 1
        end = start
        while end < len(chain) and chain[end] not in self._known and chain[end] not in self._offered_hashes:
            end += 1
        room = self.max_held_blocks - self.num_held_blocks
        if end - start > room:
            self.blocks_dropped += end - start - max(0, room)
            end = start + max(0, room)
        if end <= start:
            return
        hashes = tuple(chain[start:end])
        blocks = []
        for h in hashes:
            block = pool.ref_cached(h)
            assert block is not None
            blocks.append(block)
        batch = OffloadBatch(next(self._ids), hashes, tuple(blocks), chain[start - 1] if start else None)
        self._queued.append(batch)
        self._offered_hashes.update(hashes)
        self.num_held_blocks += len(blocks)
        self.blocks_offered += len(blocks)
        if self.on_ready is not None:
            self.on_ready()

    def take(self) -> list[OffloadBatch]:
        """The queued batches, now being offered; each must be ``finish``ed."""
        batches, self._queued = self._queued, []
        if batches:
            # A block's last KV slot may still be written by a lookahead step that is in flight.
            self.engine.wait_freed_kv_writes()
        for b in batches:
            self._offering[b.batch_id] = b
        return batches

    def finish(self, batch_id: int, stored_hashes: list[int] | tuple[int, ...] = ()) -> None:
        """The store answered (or failed: ``stored_hashes`` empty): drop the batch's references."""
        batch = self._offering.pop(batch_id, None)
        if batch is None:
            return
        stored = set(stored_hashes)
        self.blocks_stored += sum(1 for h in batch.block_hashes if h in stored)
        self._remember(h for h in batch.block_hashes if h in stored)

        def free() -> None:  # in the synchronous engine's order, without reading out a step in flight
            self.pool.free_blocks(list(batch.block_ids))
            self.num_held_blocks -= len(batch.block_ids)
            self._offered_hashes.difference_update(batch.block_hashes)

        self.engine.after_inflight(free)

    def drop_queued(self) -> int:
        """Give back every queued batch without offering it (the worker has no store); returns blocks freed."""
        batches = self.take()
        for b in batches:
            self.finish(b.batch_id)
        return sum(len(b.block_ids) for b in batches)

    def forget_stored(self) -> None:
        """The store may have lost what it held (it restarted): offer everything again."""
        self._known.clear()

    def _remember(self, hashes) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_STORED_CAPACITY:
            self._known.popitem(last=False)

    # ---- load ---------------------------------------------------------------------------------------
    def local_prefix(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the chain this engine's prefix cache holds."""
        n = 0
        for h in block_hashes:
            if h not in self.pool.hash_to_block:
                break
            n += 1
        return n

    def reserve_load(self, load_id: str, block_hashes: list[int], parent_hash: int | None) -> list[int]:
        """Fresh blocks to READ the chain ``block_hashes`` into; [] when they do not fit (load nothing)."""
        if load_id in self._loads:
            raise ValueError(f"load {load_id!r} is already reserved")
        if not block_hashes:
            return []
        blocks = self.engine.take_transfer_blocks(len(block_hashes))
        if blocks is None:
            return []
        self._loads[load_id] = _Load(tuple(block_hashes), tuple(blocks), parent_hash)
        return blocks

    def commit_load(self, load_id: str) -> int:
        """The READ landed: enter the blocks into the prefix cache; returns how many were newly cached."""
        load = self._loads.pop(load_id)
        self.engine._drain_inflight()  # the prefix cache and its LRU order change as the synchronous engine's
        new = self.pool.cache_loaded_blocks(list(load.block_ids), list(load.block_hashes), load.parent_hash)
        self.pool.flush_events()
        self._remember(load.block_hashes)
        self.blocks_loaded += new
        return new

    def cancel_load(self, load_id: str) -> bool:
        """Give a reservation's blocks back (the READ failed or was abandoned)."""
        load = self._loads.pop(load_id, None)
        if load is None:
            return False
        self.engine.after_inflight(lambda: self.pool.free_blocks(list(load.block_ids)))
        return True

    @property
    def num_loads(self) -> int:
        return len(self._loads)


def layout_for_model(
    model: str,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    quantization: str = "auto",
    load_format: str = "auto",
    speculative_config: str | None = None,
) -> KVLayout:
    """The KV layout (and so the fingerprints) an engine of these settings has, read from the model's
    config without loading weights: ``model_fingerprint`` is the engine's unsalted fingerprint."""
    from engine.kv_cache import draft_layers, kv_dtype_name, make_layout
    from engine.loader import fp8_layout, model_fingerprint, resolve_dtype, resolve_model_config

    dtype = resolve_dtype(model, dtype)
    cfg, path = resolve_model_config(model)
    fp8 = fp8_layout(cfg, path, quantization, load_format)
    fingerprint = model_fingerprint(model, path, dtype, load_format, fp8)
    return make_layout(
        cfg, fingerprint, kv_dtype_name(kv_cache_dtype, dtype), block_size, draft_layers(speculative_config)
    )
