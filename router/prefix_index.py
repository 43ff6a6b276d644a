"""The KV index as routing reads it: one lookup per request, with a deadline, and Redis outages survived.

``PrefixIndex.lookup(model_fingerprint, block_hashes)`` answers ``{worker_id: PrefixMatch}``, or None when
the index cannot be asked: the caller then routes by load alone and counts it. Two homes:

- ``--redis-url``: a ``RedisKVIndex`` per model fingerprint (one Redis round trip per lookup), written by the
  workers themselves. A lookup that fails or runs past ``timeout_s`` marks the index down: one warning
  line, ``pdmesh_router_index_up`` 0, and no lookup is attempted while it is down (requests do not wait
  on a dead Redis); a probe PINGs every ``probe_interval_s`` and brings the index back by itself, with
  an info line, as soon as Redis answers.
- no Redis: an ``InProcessKVIndex`` fed by ``router.kv_event_feed``; always up.

``forget_worker`` removes a departed worker's entries (``router.discovery``'s periodic sweep calls it for the
ids it finds in the index with no worker behind them), in O(that worker's entries): the index keeps a set
of blocks per worker. ``worker_ids`` lists the ids the index holds entries for, in O(workers) (one
``HKEYS``), for that sweep. These, and ``finish_retiring``, are for the Redis index only: the in-process
index is written by this router's own feed alone, which forgets a worker as it leaves the pool, so it never
holds an id with no worker behind it (and discovery, which sweeps, runs only with Redis).

This module owns availability and timing of lookups; block hashing and scoring happen in the chooser.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from mesh.kv_index import InProcessKVIndex, PrefixMatch, RedisKVIndex
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        in_process: InProcessKVIndex | None = None,
        redis_client: aioredis.Redis | None = None,
        timeout_s: float = 0.25,
        probe_interval_s: float = 0.5,
    ) -> None:
        if (in_process is None) == (redis_client is None):
            raise ValueError("PrefixIndex needs exactly one of in_process and redis_client")
        self.metrics = metrics
        self.in_process = in_process
        self.redis = redis_client
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.up = True
        self._by_model: dict[str, RedisKVIndex] = {}
        self._probe: asyncio.Task[None] | None = None
        metrics.index_up.set(1)

    async def lookup(
        self, model_fingerprint: str, block_hashes: Sequence[int]
    ) -> dict[str, PrefixMatch] | None:
        """Cached prefixes per worker id; None while the index is unreachable (route by load alone)."""
        if not block_hashes:
            return {}
        if self.in_process is not None:
            started = time.perf_counter()
            matches = self.in_process.lookup_sync(block_hashes)
            self.metrics.index_lookup_latency.observe(time.perf_counter() - started)
            return matches
        if not self.up:
            return None
        index = self._redis_index(model_fingerprint)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: see mesh.background
                matches = await index.lookup(block_hashes)
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
            return None
        self.metrics.index_lookup_latency.observe(time.perf_counter() - started)
        return matches

    async def worker_ids(self, model_fingerprint: str) -> set[str] | None:
        """The ids of the workers the index holds entries for. None when Redis could not be read (within
        ``4 * timeout_s``): one warning and ``pdmesh_router_index_forget_errors_total``, since the sweep
        that asks cannot forget anyone this time; it asks again at its next round."""
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                return await self._redis_index(model_fingerprint).worker_ids()
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.index_forget_errors.inc()
            log.warning(
                "could not list the workers in the KV index (%s: %s); unregistered workers' entries are "
                "swept at the next round",
                type(exc).__name__,
                str(exc) or f"no answer in {self.timeout_s * 4:g}s",
            )
            return None

    async def finish_retiring(self, model_fingerprint: str) -> None:
        """Finish removals cut short (``RedisKVIndex.finish_retiring``); discovery's sweep calls it. A
        failure is one warning and ``pdmesh_router_index_forget_errors_total``; the next sweep tries again."""
        try:
            slots = await self._redis_index(model_fingerprint).finish_retiring()
        except (RedisError, OSError) as exc:
            self.metrics.index_forget_errors.inc()
            log.warning(
                "could not finish retiring KV index slots (%s: %s); the next sweep tries again",
                type(exc).__name__,
                exc,
            )
            return
        if slots:
            log.info("KV index: finished %d interrupted worker removal(s)", slots)

    async def forget_worker(self, model_fingerprint: str, worker_id: str, reason: str | None = None) -> bool:
        """Remove everything the index holds for a worker that is gone, so that no request is scored on
        its cache again (nor a later worker that reuses its id). One info line, saying ``reason`` when
        given, from the one caller (of all routers) that removed it. False when Redis could not be reached: one warning and
        ``pdmesh_router_index_forget_errors_total``; its entries then stay until a worker with that id
        starts again or discovery's next sweep, which lists it again if its slot was not yet retired and
        finishes the removal if it was (no router scores a worker that is not in its pool meanwhile)."""
        try:
            removed = await self._redis_index(model_fingerprint).remove_worker(worker_id)
        except (RedisError, OSError) as exc:
            self.metrics.index_forget_errors.inc()
            log.warning(
                "could not remove the KV index entries of departed worker %s (%s: %s); they stay until "
                "a worker with this id starts again or discovery sweeps them",
                worker_id,
                type(exc).__name__,
                exc,
            )
            return False
        if not removed:  # another router (or the worker itself) got there first and does the clearing
            log.debug("KV index: worker %s already removed", worker_id)
        elif reason is None:
            log.info("KV index: forgot departed worker %s", worker_id)
        else:
            log.info("KV index: forgot worker %s (%s)", worker_id, reason)
        return True

    def _redis_index(self, model_fingerprint: str) -> RedisKVIndex:
        index = self._by_model.get(model_fingerprint)
        if index is None:
            if self.redis is None:
                raise TypeError("the in-process KV index is not swept: only a Redis index is")
            index = self._by_model[model_fingerprint] = RedisKVIndex(self.redis, model_fingerprint)
        return index

    def _went_down(self, exc: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        self.metrics.index_up.set(0)
        log.warning(
            "KV index unreachable (%s: %s); routing by load alone until Redis answers again",
            type(exc).__name__,
            str(exc) or f"no answer in {self.timeout_s:g}s",
        )
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_up(), name="kv-index-probe")

    async def _probe_until_up(self) -> None:
        assert self.redis is not None
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                async with asyncio.timeout(self.timeout_s * 4):
                    await self.redis.ping()
            except (RedisError, OSError, TimeoutError):
                continue
            self.up = True
            self.metrics.index_up.set(1)
            log.info("KV index answers again; routing by cached prefix resumes")
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
