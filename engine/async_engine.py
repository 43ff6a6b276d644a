"""Runs an ``LLMEngine`` on its own thread and serves it to asyncio code.

All engine mutation happens on the engine thread: requests, aborts and arbitrary calls are queued
and run between steps. Outputs are handed back to each request's asyncio queue. A caller that stops
iterating (client gone, task cancelled) aborts its request, so no KV blocks leak.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.data_parallel import Lockstep
from engine.llm_engine import LLMEngine, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from mesh.kv_events import KVEventSink

log = logging.getLogger(__name__)
T = TypeVar("T")
# With several expert-parallel ranks an idle loop asks the others for work this often: a new request on
# any rank waits at most about this long for its first step, and an idle rank spends a few percent of a
# core on the asking (each is an all-reduce over gloo).
_LOCKSTEP_IDLE_S = 0.005


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class AsyncEngine:
    def __init__(
        self, config: EngineConfig, event_sink: KVEventSink | None = None, engine: LLMEngine | None = None
    ) -> None:
        self.engine = engine or LLMEngine(config, event_sink)
        # With several expert-parallel ranks the engine steps together with the other ranks' engines.
        self._lockstep = Lockstep.for_engine(self.engine)
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]
        ] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._error: BaseException | None = None
        self.on_step: Callable[[LLMEngine], None] | None = None  # runs on the engine thread after each step

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine thread, waiting up to ``timeout`` for it. With several expert-parallel ranks it
        stops only once every rank's loop has been asked to (their steps must match): wait longer there."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ---- asyncio side ----------------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the engine thread between steps and return its result (or raise its error)."""
        if not self.alive:
            raise EngineDeadError(f"engine thread is not running ({self._error!r})")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._calls.put((fn, fut, loop))
        self._wake.set()
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream_outputs(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; aborts it if the consumer stops early."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.close_stream(request_id)
            if not finished and self.alive:
                await asyncio.shield(self.call(lambda: self.engine.abort(request_id)))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        before_add: Callable[[], Any] | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``before_add`` runs on the engine thread in the same call, right before the request is added
        (blocks loaded from the KV offload store enter the prefix cache there, so the request finds them).
        ``pooling``: an embedding request (``LLMEngine.add_request``)."""
        q = self.open_stream(request_id)

        def add() -> None:
            if before_add is not None:
                before_add()
            self.engine.add_request(
                request_id,
                prompt_token_ids,
                params,
                hold_kv,
                cache_salt,
                lora_name=lora_name,
                pooling=pooling,
            )

        try:
            await self.call(add)
        except BaseException:
            self.close_stream(request_id)
            raise
        async for out in self.stream_outputs(request_id, q):
            yield out

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self.engine.abort(request_id))

    # LoRA adapters (vLLM's load_lora_adapter / unload_lora_adapter): registered between steps, so that no
    # step sees the slots change under it. Loading reads the adapter's files on the engine thread.
    async def add_lora(self, name: str, path: str) -> None:
        await self.call(lambda: self.engine.add_lora(name, path))

    async def remove_lora(self, name: str) -> None:
        await self.call(lambda: self.engine.remove_lora(name))

    async def list_loras(self) -> list[str]:
        return await self.call(self.engine.list_loras)

    async def lora_adapters(self) -> dict[str, str]:
        """The registered adapters' names and the PEFT directories they were loaded from."""
        return await self.call(self._lora_paths)

    def _lora_paths(self) -> dict[str, str]:
        lora = self.engine.lora
        return {name: str(lora.adapters[name].path) for name in self.engine.list_loras()} if lora else {}

    # ---- engine thread ---------------------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut, loop = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting caller
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

    def _run(self) -> None:
        try:
            while self._lockstep is not None or not self._stop.is_set():
                # With a step in flight, admit what arrives until it reaches its last graph piece.
                self.engine.wait_for_lookahead_point()
                self._run_calls()
                if self._lockstep is not None:
                    self._lockstep_step()
                    if self._lockstep.stopped:  # every rank asked to stop, in this same step
                        break
                elif self.engine.has_unfinished():
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:
                        log.exception("engine step failed; aborting the running requests")
                        self._fail_running(exc)
                        continue
                    for out in outputs:
                        self._deliver(out, out.request_id)
                    if self.on_step is not None:
                        self.on_step(self.engine)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:
            self._error = exc
            log.exception("engine thread died")
            for rid in list(self._streams):
                self._deliver(EngineDeadError(f"engine thread died: {exc!r}"), rid)
            raise
        finally:
            self._drain_calls_with_error()

    def _lockstep_step(self) -> None:
        """One step of the expert-parallel group (every rank's loop calls it each turn, with work or
        without); a short wait when the group ran no pass (no rank has work, or none admitted any: waiting
        for KV imports, say), or this loop would keep the GIL from the threads that bring the work. A failed
        step ends the thread: the other ranks' collectives could not be matched any more."""
        outputs = self._lockstep.step(stopping=self._stop.is_set())
        if not outputs and not self._lockstep.passed:  # None: no rank has work (no pass either)
            self._wake.wait(_LOCKSTEP_IDLE_S)
            self._wake.clear()
            return
        for out in outputs:
            self._deliver(out, out.request_id)
        if self.on_step is not None:
            self.on_step(self.engine)

    def _fail_running(self, exc: Exception) -> None:
        for rid in [
            s.request_id for s in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting)
        ]:
            self.engine.abort(rid)
            self._deliver(RuntimeError(f"engine step failed: {exc}"), rid)
        self.engine.step()  # flush the abort outputs (their streams already got the error)

    def _drain_calls_with_error(self) -> None:
        while True:
            try:
                _fn, fut, loop = self._calls.get_nowait()
            except queue.Empty:
                return
            loop.call_soon_threadsafe(_set_exception, fut, EngineDeadError("engine stopped"))


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
