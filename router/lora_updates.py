"""LoRA adapters loaded and unloaded at run time on every worker of the mesh (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, behind ``--allow-runtime-lora-updating``).

A change goes to every worker of the mesh's model, prefill and decode alike (``LoadLoRAAdapter``,
``UnloadLoRAAdapter``), concurrently; it succeeds only when every worker made it. Otherwise the workers that
made it are put back (the adapter unloaded from those that loaded it, loaded again from its directory on
those that unloaded it), so that the workers do not disagree about what the mesh serves, and the error
names each worker that failed with its own message. Each reply's adapter list becomes the router's view of
that worker at once (``WorkerEndpoint.set_lora_adapters``), without waiting for the next stats poll. One
change at a time per router.

It does not choose which requests use an adapter (``router.served_model``) nor route them
(``router.orchestrator``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from protos.pdmesh.v1 import worker_pb2
from router.errors import (
    InvalidRequestError,
    NotFoundError,
    NoWorkerAvailableError,
    RouterError,
    UpstreamError,
)
from router.worker_pool import WorkerEndpoint, WorkerPool

log = logging.getLogger(__name__)

# Worker statuses that are the request's fault (a bad adapter, one in use, LoRA not enabled): a 400.
_CLIENT_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)

# An adapter's files are read on the worker's engine thread between steps: longer than a control call.
MIN_UPDATE_TIMEOUT_S = 30.0

Outcome = worker_pb2.LoRAAdaptersResponse | grpc.aio.AioRpcError


class LoRAUpdates:
    def __init__(self, pool: WorkerPool, base_names: list[str], timeout_s: float) -> None:
        self.pool = pool
        self.base_names = base_names
        self.timeout_s = max(timeout_s, MIN_UPDATE_TIMEOUT_S)
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` as ``name`` on every worker; raises a ``RouterError`` saying why not."""
        if not name or not path:
            raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_names:
            raise InvalidRequestError(
                f"'{name}' is a name of the base model; a LoRA adapter needs a name of its own", "lora_name"
            )
        async with self._lock:
            if name in self.pool.lora_adapters():
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            workers = self._workers()
            outcomes = await self._each(workers, lambda w: self._load(w, name, path))
            failed = _failures(outcomes)
            if failed:
                done = [w for w, o in outcomes.items() if not isinstance(o, grpc.aio.AioRpcError)]
                await self._each(done, lambda w: self._unload(w, name))
                raise _error(
                    f"LoRA adapter '{name}' was not loaded", failed, done, "unloaded again", "lora_path"
                )
        log.info("LoRA adapter %r loaded from %s on %d workers", name, path, len(workers))

    async def unload(self, name: str) -> None:
        """Unload the adapter from every worker (a worker that does not serve it has nothing to do)."""
        if not name:
            raise InvalidRequestError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            path = self.pool.lora_adapters().get(name)
            if path is None:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
            workers = self._workers()
            outcomes = await self._each(workers, lambda w: self._unload(w, name))
            failed = {
                w: o
                for w, o in _failures(outcomes).items()
                if o.code() != grpc.StatusCode.NOT_FOUND  # it did not serve the adapter: nothing to undo
            }
            if failed:
                done = [w for w, o in outcomes.items() if not isinstance(o, grpc.aio.AioRpcError)]
                await self._each(done, lambda w: self._load(w, name, path))
                raise _error(
                    f"LoRA adapter '{name}' was not unloaded", failed, done, "loaded again", "lora_name"
                )
        log.info("LoRA adapter %r unloaded from %d workers", name, len(workers))

    # ---- calls -----------------------------------------------------------------------------------------
    def _workers(self) -> list[WorkerEndpoint]:
        """Every worker of the mesh's model, up or not: one that cannot hear the change fails it."""
        workers = [w for w in self.pool.workers if not w.excluded_reason]
        if not workers:
            raise NoWorkerAvailableError("no worker is configured or registered to change adapters on")
        return workers

    async def _each(
        self, workers: list[WorkerEndpoint], call: Callable[[WorkerEndpoint], Awaitable[Outcome]]
    ) -> dict[WorkerEndpoint, Outcome]:
        results = await asyncio.gather(*(call(w) for w in workers))
        return dict(zip(workers, results, strict=True))

    async def _load(self, w: WorkerEndpoint, name: str, path: str) -> Outcome:
        request = worker_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        return await self._call(w, w.stub.LoadLoRAAdapter, request)

    async def _unload(self, w: WorkerEndpoint, name: str) -> Outcome:
        request = worker_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        return await self._call(w, w.stub.UnloadLoRAAdapter, request)

    async def _call(self, w: WorkerEndpoint, rpc: Any, request: Any) -> Outcome:
        try:
            reply = await rpc(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("%s on %s worker %s failed: %s: %s", type(request).__name__, w.role, w.address,
                        exc.code().name, exc.details())  # fmt: skip
            return exc
        w.set_lora_adapters(reply.lora_adapters)
        return reply


def _failures(outcomes: dict[WorkerEndpoint, Outcome]) -> dict[WorkerEndpoint, grpc.aio.AioRpcError]:
    return {w: o for w, o in outcomes.items() if isinstance(o, grpc.aio.AioRpcError)}


def _error(
    what: str,
    failed: dict[WorkerEndpoint, grpc.aio.AioRpcError],
    done: list[WorkerEndpoint],
    undo: str,
    param: str,
) -> RouterError:
    """One error naming every worker that failed and its message: a 400 when each failure was the
    request's (the adapter, or LoRA off on a worker), else a 502."""
    reasons = "; ".join(
        f"worker {w.name} ({w.address}): {exc.code().name}: {exc.details()}" for w, exc in failed.items()
    )
    message = f"{what}: {reasons}"
    if done:
        message += f" ({undo} on the {len(done)} worker(s) that had made the change)"
    if all(exc.code() in _CLIENT_ERRORS for exc in failed.values()):
        return InvalidRequestError(message, param)
    return UpstreamError(message)
