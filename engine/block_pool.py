"""KV block allocator: reference counts, prefix caching by the shared block hash, LRU eviction, events.

Owns block ids only; the KV bytes live in the pool tensor (engine/kv_cache.py). Cached blocks whose
reference count drops to zero stay cached and are evicted least-recently-used first.

Free (unreferenced, uncached) blocks are handed out as contiguous runs where they can be: a NIXL READ
of scattered blocks takes several times as long as one of a run (2.3-6.9x on an H200 in the workers'
default transfer mode; docs/performance.md, "KV transfer"). A sequence that grows takes the blocks right
after its last one if they are free; a fresh allocation takes the lowest-numbered run long enough (first
fit, found in a byte map of the free blocks); only when no run fits do blocks come one by one, lowest id
first (a min-heap), then from the cached blocks by eviction. Which free blocks an allocation takes never
changes what is cached or evicted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from engine.pooling import needs_every_token
from engine.sequence import Sequence
from mesh.block_hash import block_hashes
from mesh.kv_events import BlocksRemoved, BlocksStored, KVEvent, KVEventSink, Tier


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        root_hash: int,
        enable_prefix_caching: bool = True,
        event_sink: KVEventSink | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.event_sink = event_sink
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Unreferenced and uncached blocks: a byte map (1 = free) for finding runs, and a min-heap of ids
        # whose entries may be stale (a block taken as part of a run stays in the heap until popped).
        self._free_map = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._free_heap: list[int] = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached, LRU first
        self._pending_events: list[KVEvent] = []

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached blocks)."""
        return self._num_free + len(self._evictable)

    @property
    def num_uncached_free_blocks(self) -> int:
        """Blocks an allocation can take without evicting a cached block."""
        return self._num_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its block table covers ``num_tokens`` tokens."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    # ---- hashing ------------------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its tokens."""
        start = len(seq.block_hashes)
        if start >= seq.num_tokens // self.block_size:
            return
        if start:
            prev = seq.block_hashes[-1]
        else:
            prev = self.root_hash if seq.root_hash is None else seq.root_hash
        seq.block_hashes += block_hashes(seq.all_token_ids, self.block_size, prev, start=start)

    # ---- allocation -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``; at least one token is always left to compute.
        Nothing for a sequence with prompt logprobs still to compute (vLLM's rule too), nor for an embedding
        request pooled over every prompt token (``engine.pooling``)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs or needs_every_token(seq.pooling):
            return []
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_with_prefix(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Give a new sequence its cached prefix blocks plus fresh blocks for ``num_tokens`` tokens in all."""
        assert not seq.block_table
        need = max(0, -(-num_tokens // self.block_size) - len(hits))
        # Evictable hits must not count as free blocks for this allocation.
        hits_evictable = sum(1 for b in hits if self.ref_counts[b] == 0)
        if need > self.num_free_blocks - hits_evictable:
            return False
        for b in hits:
            self._ref(b)
        seq.block_table = list(hits)
        # A prompt prefilled in chunks grows in place when its first chunk starts a run that fits it all.
        whole = -(-seq.num_tokens // self.block_size) - len(hits)
        seq.block_table += self._take(need, after=hits[-1] if hits else None, room=whole)
        seq.cache_scan_upto = len(hits)  # hits are cached already
        return True

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        seq.block_table += self._take(need, after=seq.block_table[-1] if seq.block_table else None)
        return True

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Fresh blocks not tied to a sequence (KV import); None when not enough are free."""
        if n > self.num_free_blocks:
            return None
        blocks = self._take(n)
        return blocks

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _take(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """``n`` blocks, each with one reference: the run right after block ``after`` if it is free, else
        the start of the first free run of ``room`` blocks (when ``room`` > ``n``: space to grow in place),
        else the first free run of ``n``, else free blocks lowest id first and then evicted cached ones."""
        if n == 0:
            return []
        start = self._free_run(room, after) if room > n else None
        if start is None:
            start = self._free_run(n, after)
        if start is not None:
            self._free_map[start : start + n] = bytes(n)
            self._num_free -= n
            out = list(range(start, start + n))
        else:
            out = []
            for _ in range(n):
                if self._num_free:
                    block = self._pop_free()
                else:
                    block, _ = self._evictable.popitem(last=False)
                    self._uncache(block)
                out.append(block)
        for block in out:
            self.ref_counts[block] = 1
        return out

    def _free_run(self, n: int, after: int | None) -> int | None:
        """Start of ``n`` adjacent free blocks: right after ``after`` where those are free, else the first
        such run; None when there is none."""
        if n > self._num_free:
            return None
        run = b"\x01" * n
        if after is not None and self._free_map[after + 1 : after + 1 + n] == run:
            return after + 1
        if n == 1:
            return None  # the heap's lowest id
        start = self._free_map.find(run)
        return start if start >= 0 else None

    def _pop_free(self) -> int:
        while True:
            block = heapq.heappop(self._free_heap)
            if self._free_map[block]:  # else a stale entry: the block went out in a run
                self._free_map[block] = 0
                self._num_free -= 1
                return block

    def _push_free(self, block: int) -> None:
        self._free_map[block] = 1
        self._num_free += 1
        if len(self._free_heap) >= 2 * self.num_blocks:  # stale entries pile up when runs are taken
            self._free_heap = [b for b in range(self.num_blocks) if self._free_map[b]]  # sorted: a heap
        else:
            heapq.heappush(self._free_heap, block)

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is None:
            return
        self.block_hash[block] = None
        if self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
            self._pending_events.append(BlocksRemoved((h,), Tier.GPU))

    # ---- caching ------------------------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every fully computed block of ``seq`` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.block_table))
        stored: list[int] = []
        parent: int | None = None
        start, seq.cache_scan_upto = seq.cache_scan_upto, max(seq.cache_scan_upto, n_full)
        for i in range(start, n_full):  # only blocks that became full since the last call
            block = seq.block_table[i]
            h = seq.block_hashes[i]
            if self.block_hash[block] is not None:
                continue
            if h in self.hash_to_block:
                continue  # identical content cached in another block; this one stays private
            self.block_hash[block] = h
            self.hash_to_block[h] = block
            if not stored:
                parent = seq.block_hashes[i - 1] if i > 0 else None
            stored.append(h)
        if stored:
            self._pending_events.append(BlocksStored(tuple(stored), Tier.GPU, parent))

    def cache_loaded_blocks(self, blocks: list[int], hashes: list[int], parent: int | None) -> int:
        """Register blocks whose KV was loaded from elsewhere (the KV offload store) as holding the chain
        ``hashes`` (after ``parent``), then drop the caller's reference: they stay cached, evictable, most
        recently used. A hash cached meanwhile keeps its block; the loaded copy is freed. Returns how many
        blocks were newly cached."""
        stored: list[int] = []
        new = 0
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if self.enable_prefix_caching and h not in self.hash_to_block and self.block_hash[block] is None:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
                if not stored:
                    parent = hashes[i - 1] if i > 0 else parent
                stored.append(h)
                new += 1
            elif stored:  # a gap: the chain's stored event ends here, the next starts after it
                self._pending_events.append(BlocksStored(tuple(stored), Tier.GPU, parent))
                stored = []
        if stored:
            self._pending_events.append(BlocksStored(tuple(stored), Tier.GPU, parent))
        self.free_blocks(blocks)
        return new

    def ref_cached(self, h: int) -> int | None:
        """Take a reference on the block caching hash ``h`` (None when it is not cached): it is not
        evicted or reused until ``free_blocks`` drops the reference."""
        block = self.hash_to_block.get(h)
        if block is not None:
            self._ref(block)
        return block

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no sequence holds (each a ``BlocksRemoved`` event); blocks in use stay
        cached. Returns how many were evicted."""
        evicted = list(self._evictable)
        self._evictable.clear()
        for block in evicted:
            self._uncache(block)
            self._push_free(block)
        return len(evicted)

    # ---- release --------------------------------------------------------------------------------
    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference from each block; tail blocks first so they are evicted first."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._push_free(block)

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.cache_scan_upto = 0

    # ---- events ---------------------------------------------------------------------------------
    def flush_events(self) -> None:
        if self._pending_events and self.event_sink is not None:
            self.event_sink.publish(self._pending_events)
        self._pending_events = []
