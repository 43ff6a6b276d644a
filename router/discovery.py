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
- a worker id that left the registry and whose worker is gone (its process left the pool as drained or
  not answering, or another process answers at its address now) is removed from the KV index
  (``PrefixIndex.forget_worker``), so that its cached blocks score no request again. A worker that left the
  pool only because it stayed unregistered past ``grace_s`` while it still answers keeps its entries: it
  is alive and its own KV events keep them true. Workers that died while this router was not running are
  not known to it and are not removed.

While the registry cannot be read, the last known list stays in use: one warning line when it goes,
``pdmesh_router_registry_up`` 0 and ``pdmesh_router_registry_errors_total`` counting; one info line when
it answers again.

Which model: the pool's model fingerprint once a worker has announced one; before that, among the
registered models whose fingerprint starts with the served model's name, the one with most workers.
This module reads the registry and edits the pool (and tells the KV index who is gone); it does not poll
workers or choose among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from redis.exceptions import RedisError

from mesh.registry import Registry, WorkerInfo
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.worker_pool import DECODE, PREFILL, Health, WorkerEndpoint, WorkerPool

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
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.metrics = metrics
        self.model_prefix = Path(model_name).name
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.index = index
        # Worker id -> (model, endpoint): the ids of the last read, plus ids that left the registry whose
        # worker is still in the pool (it may register again within the grace).
        self._ids: dict[str, tuple[str, WorkerEndpoint]] = {}
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
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    async def poll_once(self) -> bool:
        """One read and reconciliation; False when the registry could not be read."""
        try:
            workers = await asyncio.wait_for(
                self.registry.list_workers(model_fingerprint=self.pool.model_fingerprint), self.timeout_s
            )
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
            return False
        if not self.up:
            self.up = True
            self.metrics.registry_up.set(1)
            log.info("registry answers again (%d workers registered)", len(workers))
        gone = self.reconcile(workers)
        if self.index is not None and gone:
            await asyncio.gather(*(self.index.forget_worker(fp, worker_id) for fp, worker_id in gone))
        return True

    def reconcile(self, workers: list[WorkerInfo]) -> list[tuple[str, str]]:
        """Bring the pool in line with the registry's list. Returns the (model fingerprint, worker id) of
        the registered workers found gone, whose KV index entries must go."""
        fingerprint = self._model(workers)
        present: set[str] = set()
        ids: dict[str, tuple[str, WorkerEndpoint]] = {}
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
            ids[info.worker_id] = (info.model_fingerprint, w)
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
        return self._departed(ids)

    def _departed(self, ids: dict[str, tuple[str, WorkerEndpoint]]) -> list[tuple[str, str]]:
        """The ids of the last read missing from this one (``ids``) whose worker is gone. O(ids)."""
        in_pool = set(self.pool.workers)
        gone: list[tuple[str, str]] = []
        for worker_id, (fp, w) in self._ids.items():
            if worker_id in ids:
                continue
            same_process = w.registered_id == worker_id  # else another process answers at its address
            if same_process and w in in_pool and w.health is not Health.DOWN:
                ids[worker_id] = (fp, w)  # it may register again within the grace: decide later
            elif same_process and w.health is Health.UP and not w.draining:
                log.info(
                    "worker %s left the pool but still answers: its KV index entries stay (its own "
                    "events keep them true)",
                    worker_id,
                )
            else:
                gone.append((fp, worker_id))
        self._ids = ids
        return gone

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
