"""Host staging between a worker's KV pool and the KV offload store (``mesh/kv_staging.py``): its size, its
host blocks handed out and waited for, and the copies both ways (on the CPU: the copy path without a
stream; the end-to-end tests run workers with ``--kvstore-staging on``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mesh.kv_layout import KVLayout
from mesh.kv_staging import DEFAULT_STAGING_BYTES, KVStaging, staging_blocks

LAYOUT = KVLayout("staging-test", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def _pool(n: int) -> torch.Tensor:
    return torch.randn(n, *LAYOUT.block_shape)


def test_the_staging_pool_size() -> None:
    assert staging_blocks(12, 1000, 2 << 20) == 12  # asked for
    assert staging_blocks(0, 100, 2 << 20) == 100  # the held-blocks limit
    assert staging_blocks(0, 10_000, 2 << 20) == DEFAULT_STAGING_BYTES // (2 << 20)  # at most 1 GiB
    assert staging_blocks(0, 10_000, 1 << 30) == 16  # at least 16 blocks
    assert staging_blocks(0, 3, 1 << 30) == 3  # never more than may be held


def test_copies_both_ways_and_host_blocks_waited_for() -> None:
    pool = _pool(10)
    staging = KVStaging(pool, LAYOUT, 4, "local", "t-staging")
    try:

        async def run() -> None:
            slots = staging.take(3)
            assert len(slots) == 3 and staging.num_free == 1
            await staging.to_host([7, 2, 3], slots)  # two runs on the device side
            for block, slot in zip([7, 2, 3], slots, strict=True):
                assert torch.equal(staging.host[slot], pool[block])
            before = pool.clone()
            await staging.to_device(slots, [0, 1, 9])
            assert torch.equal(pool[[0, 1, 9]], before[[7, 2, 3]])
            assert torch.equal(pool[2:9], before[2:9])  # nothing else written
            rest = staging.take(5)  # fewer than asked: the one still free
            assert len(rest) == 1 and rest[0] not in slots and staging.num_free == 0
            # All four taken now; an offer of two waits until two come back.
            waiting = asyncio.create_task(staging.take_all(2))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            await staging.give_back(slots[:2])
            assert sorted(await asyncio.wait_for(waiting, 1)) == sorted(slots[:2])
            with pytest.raises(ValueError, match="staging pool of 4"):
                await staging.take_all(5)
            with pytest.raises(ValueError, match="2 source blocks for 1"):
                await staging.to_device([0, 1], [3])

        asyncio.run(run())
    finally:
        staging.close()


def test_a_cancelled_copy_is_waited_for() -> None:
    """The caller's cancellation does not return before the copy has written its blocks (they are given
    back and reused right after)."""
    big = KVLayout("staging-big", "float32", block_size=16, num_layers=8, num_kv_heads=4, head_dim=128)
    pool = torch.randn(128, *big.block_shape)  # 64 MiB: the copy outlasts the cancellation
    staging = KVStaging(pool, big, 128, "local", "t-staging-cancel")
    try:

        async def run() -> None:
            slots = staging.take(128)
            slots.reverse()  # one run a block
            task = asyncio.create_task(staging.to_host(list(range(128)), slots))
            await asyncio.sleep(0)  # the copy's thread has started
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for block, slot in zip(range(128), slots, strict=True):
                assert torch.equal(staging.host[slot], pool[block])

        asyncio.run(run())
    finally:
        staging.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_next_to_a_gpu_pool_is_page_locked_and_copies_both_ways() -> None:
    """A GPU pool: the staging blocks are page-locked huge-page memory, and copies through a stream of their
    own land before the call returns (the engine's stream never waits for them)."""
    big = KVLayout("staging-gpu", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128)
    pool = torch.randn(64, *big.block_shape, device="cuda").to(torch.bfloat16)
    staging = KVStaging(pool, big, 32, "local", "t-staging-gpu")
    try:
        assert staging.host.device.type == "cpu" and staging._host.pinned

        async def run() -> None:
            slots = staging.take(32)
            await staging.to_host(list(range(10, 42)), slots)
            assert torch.equal(staging.host[slots].cuda(), pool[10:42])
            before = pool.clone()
            await staging.to_device(slots, list(range(32)))
            assert torch.equal(pool[:32], before[10:42]) and torch.equal(pool[42:], before[42:])

        asyncio.run(run())
    finally:
        staging.close()


def test_the_store_pool_and_the_staging_blocks_are_advised_huge_pages(tmp_path) -> None:
    """Both sides of a store transfer on the host (the side a cma READ reads decides its speed)."""
    import mmap

    from kvstore_svc.block_store import BlockStore

    store = BlockStore(LAYOUT, 4)
    staging = KVStaging(_pool(4), LAYOUT, 4, "local", "t-staging-huge")
    try:
        expected = hasattr(mmap, "MADV_HUGEPAGE")
        assert store._host.huge == expected and staging._host.huge == expected
        assert not staging._host.pinned  # no GPU pool: nothing to page-lock for
        assert torch.count_nonzero(store.pool) == 0 and store.pool.shape == (4, *LAYOUT.block_shape)
    finally:
        staging.close()
        store.close()
