"""The service registry: which workers are alive, where they listen and what they serve.

Workers register a ``WorkerInfo`` with a TTL and renew it by heartbeats (``Heartbeater``); a worker that
stops renewing disappears when its TTL runs out. Two homes behind one interface: ``InProcessRegistry``
(a single-machine mesh; expiry by monotonic time) and ``RedisRegistry`` (a shared mesh). This module
must not decide routing (``router/scoring`` reads the list) and must not import any service package.

Redis layout (``<prefix>`` defaults to ``pdmesh``):

- ``<prefix>:<model fingerprint>:worker:<id>``: the ``WorkerInfo`` as JSON, with a PX TTL.
- ``<prefix>:<model fingerprint>:workers``: a set of the model's worker ids, pruned of ids whose key expired
  whenever ``list_workers`` reads it (no SCAN: the KV index shares the keyspace and would make a SCAN slow).
- ``<prefix>:models``: a set of model fingerprints that have workers, so a router can list every model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker announces. ``role``: prefill, decode, kvstore, eplb or router (others are accepted,
    for new services)."""

    worker_id: str
    role: str
    address: str  # host:port of its gRPC server
    model_fingerprint: str
    block_size: int
    num_kv_blocks: int
    http_address: str | None = None
    metrics_address: str | None = None
    draining: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        """Unknown fields are ignored, so a router can read what a newer worker announces."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class Registry(Protocol):
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Announce (or re-announce, replacing) a worker for ``ttl_s`` seconds."""
        ...

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        """Renew the TTL. False when the registration had already expired: the caller re-registers."""
        ...

    async def deregister(self, worker_id: str) -> None: ...

    async def set_draining(self, worker_id: str, draining: bool) -> bool:
        """Mark a worker draining (routers stop sending it work); False when it is not registered."""
        ...

    async def list_workers(
        self, role: str | None = None, model_fingerprint: str | None = None
    ) -> list[WorkerInfo]:
        """Live workers, sorted by worker id, optionally of one role and one model."""
        ...


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


def _select(workers: list[WorkerInfo], role: str | None, model_fingerprint: str | None) -> list[WorkerInfo]:
    out = [
        w
        for w in workers
        if (role is None or w.role == role)
        and (model_fingerprint is None or w.model_fingerprint == model_fingerprint)
    ]
    return sorted(out, key=lambda w: w.worker_id)


class InProcessRegistry:
    """The registry in this process's memory. ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._entries: dict[str, tuple[WorkerInfo, float]] = {}  # worker id -> (info, expires at)

    def _live(self, worker_id: str) -> WorkerInfo | None:
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._entries[worker_id]
            return None
        return entry[0]

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._entries[info.worker_id] = (info, self._clock() + _ttl_ms(ttl_s) / 1000)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        info = self._live(worker_id)
        if info is None:
            return False
        self._entries[worker_id] = (info, self._clock() + _ttl_ms(ttl_s) / 1000)
        return True

    async def deregister(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)

    async def set_draining(self, worker_id: str, draining: bool) -> bool:
        info = self._live(worker_id)
        if info is None:
            return False
        self._entries[worker_id] = (replace(info, draining=draining), self._entries[worker_id][1])
        return True

    async def list_workers(
        self, role: str | None = None, model_fingerprint: str | None = None
    ) -> list[WorkerInfo]:
        live = [info for wid in list(self._entries) if (info := self._live(wid)) is not None]
        return _select(live, role, model_fingerprint)


# KEYS: worker key, the model's worker set. ARGV: ttl ms, worker id.
_HEARTBEAT_LUA = """
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 1 then
  redis.call('SADD', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# Drops ids whose key is gone from the model's set, then the model from the model set if it has no worker.
# KEYS: the model's worker set, the model set, worker keys... ARGV: fingerprint, worker ids (aligned).
_PRUNE_LUA = """
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[1], ARGV[i - 1]) end
end
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRegistry:
    """The registry in Redis. ``url_or_client``: a ``redis://`` URL (closed by ``aclose``) or a client."""

    def __init__(self, url_or_client: str | aioredis.Redis, prefix: str = "pdmesh"):
        if isinstance(url_or_client, str):
            self._redis: aioredis.Redis = aioredis.from_url(url_or_client)
            self._owns_client = True
        else:
            self._redis = url_or_client
            self._owns_client = False
        self.prefix = prefix
        self._models_key = f"{prefix}:models"
        self._fingerprint_of: dict[str, str] = {}  # worker id -> model fingerprint, as last seen
        self._heartbeat = self._redis.register_script(_HEARTBEAT_LUA)
        self._prune = self._redis.register_script(_PRUNE_LUA)

    def worker_key(self, model_fingerprint: str, worker_id: str) -> str:
        return f"{self.prefix}:{model_fingerprint}:worker:{worker_id}"

    def workers_key(self, model_fingerprint: str) -> str:
        return f"{self.prefix}:{model_fingerprint}:workers"

    async def aclose(self) -> None:
        if self._owns_client:
            await self._redis.aclose()

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        fp = info.model_fingerprint
        previous = self._fingerprint_of.get(info.worker_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            if previous is not None and previous != fp:  # the worker now serves another model
                pipe.delete(self.worker_key(previous, info.worker_id))
                pipe.srem(self.workers_key(previous), info.worker_id)
            pipe.set(self.worker_key(fp, info.worker_id), info.to_json(), px=_ttl_ms(ttl_s))
            pipe.sadd(self.workers_key(fp), info.worker_id)
            pipe.sadd(self._models_key, fp)
            await pipe.execute()
        self._fingerprint_of[info.worker_id] = fp

    async def _fingerprint(self, worker_id: str) -> str | None:
        """The worker's model: remembered from register or list_workers, else the model under which it
        has a live registration."""
        fp = self._fingerprint_of.get(worker_id)
        if fp is not None:
            return fp
        models = sorted(_text(m) for m in await self._redis.smembers(self._models_key))
        async with self._redis.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.exists(self.worker_key(m, worker_id))  # the sets may still list expired ids
            found = await pipe.execute()
        for m, hit in zip(models, found, strict=True):
            if hit:
                self._fingerprint_of[worker_id] = m
                return m
        return None

    async def _on_worker(self, worker_id: str, action: Callable[[str], Awaitable[bool]]) -> bool:
        """Run ``action(model fingerprint)`` for the worker. When it finds nothing under a remembered
        model, the worker may have re-registered under another one (through another process): look it
        up afresh and try once more."""
        cached = worker_id in self._fingerprint_of
        fp = await self._fingerprint(worker_id)
        if fp is None:
            return False
        if await action(fp):
            return True
        if not cached:
            return False
        self._fingerprint_of.pop(worker_id, None)
        fresh = await self._fingerprint(worker_id)
        return fresh is not None and fresh != fp and await action(fresh)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        async def renew(fp: str) -> bool:
            keys = [self.worker_key(fp, worker_id), self.workers_key(fp)]
            return bool(await self._heartbeat(keys=keys, args=[_ttl_ms(ttl_s), worker_id]))

        return await self._on_worker(worker_id, renew)

    async def deregister(self, worker_id: str) -> None:
        async def delete(fp: str) -> bool:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.worker_key(fp, worker_id))
                pipe.srem(self.workers_key(fp), worker_id)
                deleted, _ = await pipe.execute()
            await self._prune(keys=[self.workers_key(fp), self._models_key], args=[fp])
            return bool(deleted)

        await self._on_worker(worker_id, delete)
        self._fingerprint_of.pop(worker_id, None)

    async def set_draining(self, worker_id: str, draining: bool) -> bool:
        async def mark(fp: str) -> bool:
            key = self.worker_key(fp, worker_id)
            async with self._redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.get(key)
                        if raw is None:
                            return False
                        info = replace(WorkerInfo.from_json(raw), draining=draining)
                        pipe.multi()
                        pipe.set(key, info.to_json(), keepttl=True, xx=True)
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue  # renewed or changed meanwhile: read again

        return await self._on_worker(worker_id, mark)

    async def list_workers(
        self, role: str | None = None, model_fingerprint: str | None = None
    ) -> list[WorkerInfo]:
        if model_fingerprint is not None:
            models = [model_fingerprint]
        else:
            models = sorted(_text(m) for m in await self._redis.smembers(self._models_key))
        if not models:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.smembers(self.workers_key(m))
            id_sets = await pipe.execute()
        ids_by_model = {m: sorted(_text(i) for i in ids) for m, ids in zip(models, id_sets, strict=True)}
        async with self._redis.pipeline(transaction=False) as pipe:
            for m, ids in ids_by_model.items():
                if ids:
                    pipe.mget([self.worker_key(m, i) for i in ids])
            values = iter(await pipe.execute())
        workers: list[WorkerInfo] = []
        for m, ids in ids_by_model.items():
            raws = next(values) if ids else []
            dead = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            for raw in raws:
                if raw is not None:
                    info = WorkerInfo.from_json(raw)
                    self._fingerprint_of[info.worker_id] = m
                    workers.append(info)
            if dead or not ids:
                keys = [self.workers_key(m), self._models_key, *(self.worker_key(m, i) for i in dead)]
                await self._prune(keys=keys, args=[m, *dead])
                for i in dead:
                    self._fingerprint_of.pop(i, None)
        return _select(workers, role, model_fingerprint)


class Heartbeater:
    """Keeps one worker registered: registers on ``start``, renews every ``ttl_s / 3`` (re-registering when
    the registration had expired, then calling ``on_reregistered``), and deregisters on ``stop``. A failed
    renewal (registry unreachable) is logged and counted in ``failures``; the loop keeps trying.

    Use as ``async with Heartbeater(registry, info, ttl_s=10):`` or call ``start``/``stop``.
    """

    def __init__(
        self,
        registry: Registry,
        info: WorkerInfo,
        ttl_s: float = 10.0,
        interval_s: float | None = None,
        on_reregistered: Callable[[], None] | None = None,
    ):
        _ttl_ms(ttl_s)
        self.registry = registry
        self.info = info
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else ttl_s / 3
        # While a worker was unregistered, routers may have swept its KV index entries as a dead worker's.
        self.on_reregistered = on_reregistered
        self.renewals = 0
        self.reregistrations = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register, then renew in the background. A registry that cannot be reached now does not stop
        the worker: the failure is logged and counted, and the first renewal registers it."""
        try:
            await self.registry.register(self.info, self.ttl_s)
        except (RedisError, OSError) as exc:
            self.failures += 1
            log.warning(
                "registering %s failed (%s); retrying in %.1fs", self.info.worker_id, exc, self.interval_s
            )
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.info.worker_id}")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister:
            await self.registry.deregister(self.info.worker_id)

    async def set_draining(self, draining: bool) -> None:
        """Draining is part of what re-registration announces, so it is kept here as well."""
        self.info = replace(self.info, draining=draining)
        if not await self.registry.set_draining(self.info.worker_id, draining):
            await self.registry.register(self.info, self.ttl_s)

    async def __aenter__(self) -> Heartbeater:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if await self.registry.heartbeat(self.info.worker_id, self.ttl_s):
                    self.renewals += 1
                else:
                    log.warning("registration of %s had expired; registering again", self.info.worker_id)
                    await self.registry.register(self.info, self.ttl_s)
                    self.reregistrations += 1
                    if self.on_reregistered is not None:
                        self.on_reregistered()
            except (RedisError, OSError) as exc:
                self.failures += 1
                log.warning(
                    "heartbeat of %s failed (%s); retrying in %.1fs",
                    self.info.worker_id,
                    exc,
                    self.interval_s,
                )
