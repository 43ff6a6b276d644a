"""Host staging of KV blocks between a worker's GPU pool and the KV offload store.

NIXL over UCX has no direct path between one process's device memory and another process's host memory on
the same machine: UCX answers a READ of the store's host blocks into a GPU pool (and the store's READ of GPU
blocks into its host pool) by software emulation over TCP loopback, ~0.7 GB/s on an H100 (performance.md,
"KV offload store on the GPU"), so loading a 2048-token prefix of a Llama-3.1-8B shape took 7.5 times as long as
computing it. Host memory to host memory goes over ``cma`` (zero-copy) and device to host inside one process
over the copy engines. So a worker whose pool is on a GPU moves the store's blocks through page-locked host
blocks of its own, registered with a second transfer agent (``<agent>-staging``): an offer copies its blocks
device -> host and the store READs the host copies; a load READs the store's blocks into host blocks and
copies them host -> device before the request is added. vLLM's CPU offloading, LMCache and Dynamo's KVBM
keep their host tier in the worker process for the same reason.

The copies run on a stream of their own and are awaited off the event loop (``asyncio.to_thread``); the
device blocks they read or write are held (an offer's references) or reserved (a load), so the engine's
stream never touches them meanwhile. Host blocks are handed out first come first served; a request that
needs more than are free waits (offers) or loads fewer (loads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from mesh.host_memory import HostBlocks
from mesh.kv_layout import KVLayout
from mesh.kv_transfer import KVTransferAgent, coalesce_runs, create_transfer_agent

__all__ = ["KVStaging", "staging_blocks"]

# Default size of the staging pool: the held-blocks limit, at most this many bytes.
DEFAULT_STAGING_BYTES = 1 << 30


def staging_blocks(setting: int, max_held_blocks: int, block_nbytes: int) -> int:
    """The staging pool's size in blocks: ``setting`` when positive, else the held-blocks limit capped at
    ``DEFAULT_STAGING_BYTES`` (at least 16 blocks)."""
    if setting > 0:
        return setting
    return max(1, min(max_held_blocks, max(16, DEFAULT_STAGING_BYTES // block_nbytes)))


class KVStaging:
    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        num_blocks: int,
        kind: str,
        agent_name: str,
        **agent_kwargs: Any,
    ) -> None:
        """``pool``: the engine's KV pool (block-major); ``kind``/``agent_kwargs``: the transfer agent's."""
        if num_blocks < 1:
            raise ValueError(f"a staging pool needs at least one block, not {num_blocks}")
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        # Huge pages (the store's cma READs of an offer ran 1.2-1.7x faster from them on the CPU machine:
        # mesh.host_memory), page-locked next to a GPU (copies at the copy engines' rate).
        self._host = HostBlocks((num_blocks, *pool.shape[1:]), pool.dtype, pin=self.cuda)
        self.host = self._host.tensor
        self.agent: KVTransferAgent = create_transfer_agent(
            kind, agent_name, self.host, layout, **agent_kwargs
        )
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._space = asyncio.Condition()
        self._stream = torch.cuda.Stream(pool.device) if self.cuda else None

    # ---- host blocks --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free host blocks, now (fewer when fewer are free)."""
        n = min(n, len(self._free))
        taken = [self._free.pop() for _ in range(n)]
        return taken

    async def take_all(self, n: int) -> list[int]:
        """Exactly ``n`` host blocks (at most the pool's size), waiting until that many are free."""
        if n > self.num_blocks:
            raise ValueError(f"{n} host blocks asked of a staging pool of {self.num_blocks}")
        async with self._space:
            await self._space.wait_for(lambda: len(self._free) >= n)
            return self.take(n)

    async def give_back(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        async with self._space:
            self._free.extend(slots)
            self._space.notify_all()

    # ---- copies -------------------------------------------------------------------------------------
    async def to_host(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device ``blocks`` into host ``slots`` and wait for the copy (off the event loop)."""
        await self._copy(self.pool, blocks, self.host, slots)

    async def to_device(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host ``slots`` into device ``blocks`` and wait for the copy (off the event loop)."""
        await self._copy(self.host, slots, self.pool, blocks)

    async def _copy(
        self, src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]
    ) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
        runs = coalesce_runs(list(dst_ids), list(src_ids))  # (dst start, src start, length)
        if not runs:
            return

        def copy() -> None:
            if self._stream is None:
                for d, s, n in runs:
                    dst[d : d + n].copy_(src[s : s + n])
                return
            with torch.cuda.stream(self._stream):
                for d, s, n in runs:
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            self._stream.synchronize()

        # A cancelled caller still waits for the copy: the blocks it reads or writes must not be given back
        # (and taken by another transfer or request) while it runs.
        running = asyncio.ensure_future(asyncio.to_thread(copy))
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            await running
            raise

    def close(self) -> None:
        self.agent.close()
        self._host.close()
