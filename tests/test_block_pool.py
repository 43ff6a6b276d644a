"""The block allocator hands out contiguous runs where it can (a KV transfer READs a run several times
faster than scattered blocks), evicts cached blocks only when no free block is left, least recently used
first, and keeps its accounting exact under random traffic."""

from __future__ import annotations

import random

import pytest

from engine.block_pool import BlockPool
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BLOCK = 4


def make_seq(request_id: str, num_tokens: int, first: int = 1) -> Sequence:
    return Sequence(request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=4))


def runs(blocks: list[int]) -> int:
    """Runs of adjacent ids in ``blocks`` (the descriptors of a coalesced transfer)."""
    return sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)


def test_fresh_allocations_and_growth_are_runs() -> None:
    pool = BlockPool(64, BLOCK, root_hash=1)
    a = pool.allocate_blocks(5)
    assert a == [0, 1, 2, 3, 4]
    seq = make_seq("s", 3 * BLOCK)
    assert pool.allocate_with_prefix(seq, [], 3 * BLOCK)
    assert seq.block_table == [5, 6, 7]
    b = pool.allocate_blocks(2)
    assert b == [8, 9]
    # The sequence grows past block 9, which is taken: its next blocks are a run after that.
    assert pool.append_slots(seq, 6 * BLOCK)
    assert seq.block_table == [5, 6, 7, 10, 11, 12]
    assert pool.append_slots(seq, 7 * BLOCK)  # then right after its last block
    assert seq.block_table[-1] == 13
    assert pool.num_uncached_free_blocks == 64 - 5 - 2 - 7


def test_a_prompt_prefilled_in_chunks_starts_where_it_can_grow_in_place() -> None:
    pool = BlockPool(32, BLOCK, root_hash=1)
    first = pool.allocate_blocks(2)  # 0, 1
    pool.allocate_blocks(1)  # 2
    pool.free_blocks(first)  # a hole of two blocks at 0
    seq = make_seq("p", 6 * BLOCK)  # six blocks of prompt, prefilled two blocks at a time
    assert pool.allocate_with_prefix(seq, [], 2 * BLOCK)
    assert pool.append_slots(seq, 4 * BLOCK)
    assert pool.append_slots(seq, 6 * BLOCK)
    assert seq.block_table == [3, 4, 5, 6, 7, 8]  # one run, not the hole then a run
    assert pool.allocate_blocks(2) == [0, 1]  # the hole is still there for what fits it


def test_after_churn_an_import_takes_the_first_run_that_fits() -> None:
    pool = BlockPool(32, BLOCK, root_hash=1)
    singles = [pool.allocate_blocks(1) for _ in range(12)]
    assert [s[0] for s in singles] == list(range(12))
    for s in singles[::2]:  # free 0, 2, 4, ..., 10: holes of one block
        pool.free_blocks(s)
    got = pool.allocate_blocks(3)
    assert got == [12, 13, 14]  # the first run of three, past the holes
    assert pool.allocate_blocks(1) == [0]  # single blocks still fill holes, lowest first
    pool.free_blocks(singles[3])  # 3 joins the holes 2 and 4: a run of three at 2
    assert pool.allocate_blocks(3) == [2, 3, 4]


def test_without_a_run_blocks_come_lowest_first_then_by_eviction() -> None:
    pool = BlockPool(8, BLOCK, root_hash=1)
    cached = make_seq("c", 2 * BLOCK)
    assert pool.allocate_with_prefix(cached, [], 2 * BLOCK)  # blocks 0, 1
    cached.num_computed_tokens = 2 * BLOCK
    pool.cache_full_blocks(cached)
    pool.flush_events()
    held = pool.allocate_blocks(6)  # 2..7
    assert held == list(range(2, 8))
    pool.free(cached)  # 0 and 1 are cached: evictable, not free
    pool.free_blocks([held[1], held[3]])  # 3 and 5 free, not adjacent
    assert pool.num_uncached_free_blocks == 2 and pool.num_free_blocks == 4
    got = pool.allocate_blocks(3)
    # No run of three: the two free blocks lowest first, then the least recently used cached block (the
    # tail block of the freed sequence goes first).
    assert got == [3, 5, 1]
    assert pool.block_hash[1] is None and pool.block_hash[0] is not None


def test_random_traffic_keeps_the_accounting_and_hands_no_block_out_twice() -> None:
    rng = random.Random(7)
    pool = BlockPool(96, BLOCK, root_hash=1)
    live: dict[str, Sequence] = {}
    imports: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.3 and len(live) < 12:
            seq = make_seq(f"r{step}", rng.randrange(1, 9 * BLOCK), first=rng.randrange(1, 4))
            hits = pool.match_prefix(seq)
            if pool.allocate_with_prefix(seq, hits, seq.num_tokens):
                live[seq.request_id] = seq
        elif op < 0.5 and live:
            seq = rng.choice(list(live.values()))
            if pool.append_slots(seq, seq.num_tokens + rng.randrange(1, 3 * BLOCK)):
                seq.prompt_token_ids += [rng.randrange(1, 50) for _ in range(BLOCK)]
                seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * BLOCK)
                pool.cache_full_blocks(seq)
        elif op < 0.65:
            got = pool.allocate_blocks(rng.randrange(1, 10))
            if got is not None:
                imports.append(got)
        elif op < 0.8 and live:
            pool.free(live.pop(rng.choice(list(live))))
        elif imports:
            pool.free_blocks(imports.pop(rng.randrange(len(imports))))
        pool.flush_events()
        held = [b for s in live.values() for b in s.block_table] + [b for i in imports for b in i]
        refs = [0] * pool.num_blocks
        for b in held:
            refs[b] += 1
        assert refs == pool.ref_counts
        private = [b for s in live.values() for b in s.block_table[s.cache_scan_upto :]] + [
            b for i in imports for b in i
        ]
        assert len(private) == len(set(private)), "a block handed out twice"
        free = [b for b in range(pool.num_blocks) if refs[b] == 0 and pool.block_hash[b] is None]
        assert pool.num_uncached_free_blocks == len(free)
        assert pool.num_free_blocks == sum(1 for b in range(pool.num_blocks) if refs[b] == 0)


def decode_worker_descriptors(pool: BlockPool, seed: int) -> tuple[int, int]:
    """A decode worker's pool: prompts imported as runs, each growing one block at a time while it
    decodes, freed when done. Returns (descriptors the imports needed, blocks imported)."""
    rng = random.Random(seed)
    live: list[tuple[list[int], list[int]]] = []  # (blocks, [growth left])
    descriptors = imported = 0
    for _ in range(3000):
        if rng.random() < 0.3:
            got = pool.allocate_blocks(rng.randrange(4, 40))
            if got is not None:
                descriptors += runs(got)
                imported += len(got)
                live.append((got, [rng.randrange(0, 12)]))
        for blocks, left in list(live):
            if left[0] and rng.random() < 0.3:
                grown = pool.allocate_blocks(1)
                if grown:
                    blocks += grown
                    left[0] -= 1
            elif not left[0] and rng.random() < 0.2:
                pool.free_blocks(blocks)
                live.remove((blocks, left))
    return descriptors, imported


def test_a_decode_worker_imports_in_far_fewer_descriptors_than_lowest_id_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same traffic with runs (the allocator) and with every block lowest id first (the min-heap alone,
    as before runs): the imports need over four times fewer descriptors."""
    runs_first = decode_worker_descriptors(BlockPool(512, 16, root_hash=1), seed=3)
    monkeypatch.setattr(BlockPool, "_free_run", lambda self, n, after: None)
    lowest_first = decode_worker_descriptors(BlockPool(512, 16, root_hash=1), seed=3)
    assert runs_first[1] == lowest_first[1] > 10_000  # the same blocks imported
    assert runs_first[0] * 4 < lowest_first[0], (runs_first, lowest_first)
