"""Registry discovery: with ``--redis-url``, the router's worker pool follows the service registry.

Every ``interval_s`` it reads ``Registry.list_workers`` and reconciles the pool:

- a prefill or decode worker of the mesh's model that is not in the pool joins it (matched by address:
  a worker also named on the command line is the same worker) and takes requests at once;
- a registration's ``draining`` flag is copied, so a draining worker gets no new request even before
  its stats say so;
- a discovered worker missing from the registry leaves the pool at once when it is draining or does not
  answer (it deregistered on its way out, or died and its registration expired), and after ``grace_s``
  otherwise: a restarted Redis is empty until the workers' heartbeats register them again;
- workers named on the command line are never removed;
- every ``sweep_interval_s`` (30 s), once the registry has answered without a failed read for ``grace_s``
  (a restarted Redis is empty until heartbeats register the workers again), the KV index of the pool's
  model is swept, in a background task (a slow Redis delays no read; one sweep at a time): each worker id
  it holds entries for (``PrefixIndex.worker_ids``, one ``HKEYS``) that is neither registered nor in the
  pool is forgotten (``PrefixIndex.forget_worker``), with one info line. The index is listed before the
  sweep's own registry read, so that a worker which registered before storing its first block (it
  registers as it starts, before routers find it) is in the list that spares it. Each sweep also finishes
  any removal that was cut short (a router stopped or cancelled mid-way: ``RedisKVIndex.finish_retiring``).
  Every router sweeps, but a removal's work is done once: one router takes a dead worker's slot (the others
  find it gone), and clearing it is leased, so another router's sweep skips a slot being cleared and takes
  over only one whose clearer stopped.

The sweep is the only way the router removes index entries, and it may run up to ``sweep_interval_s``
after a worker died: that delay routes nothing wrongly. Only workers in the pool are scored, and a dead
worker stops being a candidate as soon as its stats poll or a call fails (``Health.DOWN``), before its
registration expires and it leaves the pool; a worker that restarts under the same id clears what its
earlier process left before it stores anything (``mesh.worker_registration``); a worker that stops cleanly
removes its own entries. What a dead worker's entries cost until the sweep is Redis memory and its slot.

While the registry cannot be read, the last known list stays in use: one warning line when it goes,
``pdmesh_router_registry_up`` 0 and ``pdmesh_router_registry_errors_total`` counting; one info line when
it answers again.

Which model: the pool's model fingerprint once a worker has announced one; before that, among the
registered models whose fingerprint starts with the served model's name, the one with most workers.
This module reads the registry and edits the pool (and sweeps the KV index of workers that are gone); it
does not poll workers or choose among them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from redis.exceptions import RedisError

from mesh.background import BackgroundTasks, cancel_until_done
from mesh.registry import Registry, WorkerInfo
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.worker_pool import DECODE, KVSTORE, PREFILL, Health, WorkerPool

log = logging.getLogger(__name__)


class RegistryDiscovery:
    def __init__(
        self,
        registry: Registry,
        pool: WorkerPool,
        metrics: RouterMetrics,
        model_name: str,
        interval_s: float = 0.5,
        grace_s: float = 5.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        index: PrefixIndex | None = None,
        sweep_interval_s: float = 30.0,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.metrics = metrics
        self.model_prefix = Path(model_name).name
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.clock = clock
        if index is not None and index.redis is None:
            raise ValueError(
                "registry discovery sweeps a Redis KV index; an in-process index forgets workers through "
                "its own event feed (router.kv_event_feed)"
            )
        self.index = index
        self.sweep_interval_s = sweep_interval_s
        self._answering_since: float | None = None  # the first read of the current run of good reads
        self._next_sweep = 0.0
        self._background = BackgroundTasks("registry discovery")
        self.sweeping: asyncio.Task[None] | None = None  # the sweep running or last run, off the read loop
        self.up = True
        self._warned_no_model = False
        self._task: asyncio.Task[None] | None = None
        metrics.registry_up.set(1)

    async def start(self) -> None:
        """Read the registry once (so the first requests see registered workers), then keep reading."""
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="registry-discovery")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_until_done(self._task)
            self._task = None
        # A sweep cut short here leaves at most a retiring slot, which the next sweep (of any router)
        # finishes once its lease expires.
        await self._background.close()
        self.sweeping = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    async def poll_once(self) -> bool:
        """One read and reconciliation; starts a sweep of the index in the background when one is due (and
        none is running). False when the registry could not be read."""
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: see cancel_until_done
                workers = await self.registry.list_workers(model_fingerprint=self.pool.model_fingerprint)
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.registry_errors.inc()
            if self.up:
                self.up = False
                self.metrics.registry_up.set(0)
                log.warning(
                    "registry unreachable (%s: %s); keeping the last known %d workers until it answers",
                    type(exc).__name__,
                    exc,
                    len(self.pool.workers),
                )
            self._answering_since = None
            return False
        if self._answering_since is None:
            self._answering_since = self.clock()
        if not self.up:
            self.up = True
            self.metrics.registry_up.set(1)
            log.info("registry answers again (%d workers registered)", len(workers))
        self.reconcile(workers)
        if self._sweep_due():
            assert self.pool.model_fingerprint is not None
            self._next_sweep = self.clock() + self.sweep_interval_s
            self.sweeping = self._background.spawn(self._sweep(self.pool.model_fingerprint), "kv-index-sweep")
        return True

    def _sweep_due(self) -> bool:
        return (
            self.index is not None
            and self.index.up
            and self.pool.model_fingerprint is not None
            and self._answering_since is not None
            and self.clock() - self._answering_since >= self.grace_s
            and self.clock() >= self._next_sweep
            and (self.sweeping is None or self.sweeping.done())
        )

    async def _sweep(self, fingerprint: str) -> None:
        """Forget the ids the index holds entries for that are neither registered nor in the pool. The index
        is listed before the registry is read (see the module docstring). O(ids) plus the removals."""
        assert self.index is not None
        indexed = await self.index.worker_ids(fingerprint)
        if indexed is None:
            return  # logged and counted by the index; the next sweep asks again
        try:
            async with asyncio.timeout(self.timeout_s):
                workers = await self.registry.list_workers(model_fingerprint=fingerprint)
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.registry_errors.inc()
            log.warning("KV index sweep skipped: registry unreachable (%s: %s)", type(exc).__name__, exc)
            return
        if self._answering_since is None:
            return  # a read failed meanwhile: the grace starts again
        known = {info.worker_id for info in workers}
        for w in self.pool.workers:
            known.add(w.name)  # its announced id once it answered, else its registration or address
            if w.registered_id:
                known.add(w.registered_id)
        await self.index.finish_retiring(fingerprint)  # removals cut short, by any router
        dead = sorted(indexed - known)
        if dead:
            reason = "swept: not registered and not in the pool"
            await asyncio.gather(*(self.index.forget_worker(fingerprint, i, reason) for i in dead))

    def reconcile(self, workers: list[WorkerInfo]) -> None:
        """Bring the pool in line with the registry's list."""
        fingerprint = self._model(workers)
        present: set[str] = set()
        self.pool.kvstore_ids = frozenset(
            info.worker_id
            for info in workers
            if info.role == KVSTORE and info.model_fingerprint == fingerprint and not info.draining
        )
        for info in workers:
            if info.model_fingerprint != fingerprint or info.role not in (PREFILL, DECODE):
                continue
            w = self.pool.add(info.address, info.role, info.worker_id)
            if w.role != info.role:
                continue  # named on the command line under the other role: the flag wins
            if info.draining and not w.registry_draining:
                log.info("%s worker %s (%s) is draining: no new requests", w.role, w.address, info.worker_id)
            w.registry_draining = info.draining
            w.missing_since = None
            present.add(w.address)
        now = self.clock()
        for w in list(self.pool.workers):
            if w.address in present:
                continue
            if w.static:
                w.registry_draining = False  # its own stats still say whether it drains
                continue
            if w.missing_since is None:
                w.missing_since = now
            if w.draining:
                self.pool.remove(w, "deregistered after draining")
            elif w.health is Health.DOWN:
                self.pool.remove(w, "no longer registered and not answering")
            elif now - w.missing_since >= self.grace_s:
                self.pool.remove(w, f"missing from the registry for {self.grace_s:g}s")

    def _model(self, workers: list[WorkerInfo]) -> str | None:
        if self.pool.model_fingerprint is not None:
            return self.pool.model_fingerprint
        counts = Counter(
            w.model_fingerprint
            for w in workers
            if w.role in (PREFILL, DECODE) and w.model_fingerprint.startswith(self.model_prefix)
        )
        if not counts:
            if workers and not self._warned_no_model:
                self._warned_no_model = True
                log.info(
                    "no registered worker serves model %s (registered: %s)",
                    self.model_prefix,
                    ", ".join(sorted({w.model_fingerprint for w in workers})),
                )
            return None
        return min(counts, key=lambda fp: (-counts[fp], fp))
