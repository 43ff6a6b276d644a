"""Background Responses API responses (``"background": true``, OpenAI's and vLLM's background mode): the
generation runs on in the router after ``POST /v1/responses`` has answered, and the client reads its
stored record (``GET /v1/responses/{id}``) or cancels it (``POST /v1/responses/{id}/cancel``).

The record (``router.response_store``) goes queued, in_progress, then completed (or incomplete), failed
(with its ``error``) or cancelled. Every change is written with ``replace_active`` (only while the record
is still queued or in progress), so a cancellation written by any router wins over the owner's later
writes and the owner's completion wins over a later cancellation. The owning router polls the record every
``poll_s`` while it generates: a record cancelled (by another router) or deleted stops the generation
there, which closes the chat stream and so aborts the request on the workers, as a client disconnect
does. A streaming client (``"stream": true``) only listens: it may go away and the run goes on.

The owner also appends each event to the record's event log (``router.response_store``) while the record
is active, so a client that lost its stream picks it up through any router (``events``: OpenAI's
``GET /v1/responses/{id}?stream=true&starting_after=N``): the logged events, then the live ones, until
the final event (``response.completed``, ``.incomplete``, ``.failed``) or, for a run cancelled or
deleted (no final event), until its record has ended and the log stays quiet for one ``poll_s``.

This module owns the runs' lifetime (``BackgroundTasks``: kept referenced, cancelled and awaited on
``close``, when a run's record becomes failed); it does not parse requests or write HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from mesh.background import BackgroundTasks, cancel_until_done
from router.choices import ChoiceRequest, merged_chunks
from router.errors import InvalidRequestError, RouterError
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.reply_writer import ReplyWriter
from router.response_store import ACTIVE, LoggedEvent, ResponseStore, StoredResponse
from router.responses import ResponseStream

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a running response's owner reads its record (a cancellation from elsewhere)
# How often a run's new events go to its log at most (one store write each, a Redis round trip, rather than
# one a token); its first and last events go at once.
LOG_EVERY_S = 0.1
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class BackgroundRun:
    out: ResponseStream  # its status starts "queued"
    record: Callable[[dict[str, Any]], StoredResponse]  # the record of a Response object
    choices: list[ChoiceRequest]
    writer: ReplyWriter
    # A streaming client's events (None: the run ended); the client may leave (listener set to None).
    listener: asyncio.Queue[dict[str, Any] | None] | None = None
    cancelled: bool = False  # its record was cancelled or deleted: it ends without another write
    # Events not yet in its log, and when the log was last written (``BackgroundResponses._log``).
    unlogged: list[dict[str, Any]] = field(default_factory=list)
    logged_at: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def response_id(self) -> str:
        return self.out.response_id


class BackgroundResponses:
    def __init__(
        self,
        store: ResponseStore,
        orchestrator: Orchestrator,
        metrics: RouterMetrics,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.poll_s = poll_s
        self._tasks = BackgroundTasks("background responses")
        self._runs: dict[str, BackgroundRun] = {}  # those this router runs, by response id

    async def start(self, run: BackgroundRun) -> dict[str, Any]:
        """Store ``run``'s queued record and start it; the queued Response object. A store that fails
        raises (RedisError): nothing was started."""
        queued = self._snapshot(run)
        await self.store.put(run.record(queued))
        self._runs[run.response_id] = run
        run.task = self._tasks.spawn(self._run(run), f"response-{run.response_id}")
        return queued

    async def cancel(self, record: StoredResponse) -> dict[str, Any]:
        """OpenAI's ``responses.cancel``: a queued or in-progress background response becomes cancelled and
        its generation stops (here, or on the owning router within ``poll_s``); one that has ended is
        returned as it is (cancelling twice returns the same object: OpenAI's rule). A response that was
        not run in the background is a 400 (only background responses can be cancelled)."""
        response = record.response
        if not response.get("background"):
            raise InvalidRequestError(
                f"Cannot cancel response '{response['id']}': only responses created with "
                "background true can be cancelled"
            )
        if response.get("status") not in ACTIVE:
            return response
        cancelled = StoredResponse(
            response={**response, "status": "cancelled"},
            messages=record.messages,
            input_items=record.input_items,
        )
        if not await self.store.replace_active(cancelled):
            # It ended (or was cancelled) in between: what it is now.
            now = await self.store.get(response["id"])
            return now.response if now is not None else cancelled.response
        run = self._runs.get(response["id"])
        if run is not None and run.task is not None:
            run.cancelled = True
            await cancel_until_done(run.task)  # the chat stream closed: Abort sent to the workers
        return cancelled.response

    def events(self, record: StoredResponse, starting_after: str | None) -> AsyncIterator[LoggedEvent]:
        """OpenAI's ``responses.retrieve`` with ``stream``: the response's events after sequence number
        ``starting_after`` (all without), then the live ones until the run ends. A response not run in
        the background, or a ``starting_after`` that is not an integer, is a 400 (raised here, before
        anything is streamed); the iterator raises RedisError when the store fails."""
        response = record.response
        if not response.get("background"):
            raise InvalidRequestError(
                f"Cannot stream response '{response['id']}': only responses created with background true "
                "can be streamed again",
                param="stream",
            )
        after = -1
        if starting_after is not None:
            try:
                after = int(starting_after)
            except ValueError:
                after = -2
            if after < -1:
                raise InvalidRequestError(
                    f"starting_after must be a sequence number (an integer >= 0), got '{starting_after}'",
                    param="starting_after",
                )
        return self._follow(response["id"], after)

    async def _follow(self, response_id: str, after: int) -> AsyncIterator[LoggedEvent]:
        ended = False  # the record was seen ended (or gone) with nothing more logged
        while True:
            events = await self.store.read_events(response_id, after, self.poll_s)
            for event in events:
                yield event
                after = event.sequence
            if events and events[-1].type in FINAL_EVENTS:
                return
            if events:
                ended = False
                continue
            if ended:
                return  # cancelled or deleted: it has no final event
            record = await self.store.get(response_id)
            # Ended: the owner logs the final events just after its last write, so read once more.
            ended = record is None or record.response.get("status") not in ACTIVE

    async def close(self) -> None:
        """Cancel every run and await it (the router is stopping): their records become failed."""
        await self._tasks.close()

    # ---- a run ---------------------------------------------------------------------------------------
    async def _run(self, run: BackgroundRun) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(run, task), name=f"watch-{run.response_id}")
        try:
            await self._generate(run)
        except asyncio.CancelledError:
            if run.cancelled:  # what it had produced stays in its log (a cancelled record keeps its log)
                with contextlib.suppress(asyncio.CancelledError):
                    await self._flush(run)
            else:  # the router is stopping: the record says so, not in_progress forever
                events = run.out.fail("server_error", "the router stopped before the response finished")
                with contextlib.suppress(asyncio.CancelledError):
                    await self._save(run)
                self._listen(run, events)
                with contextlib.suppress(asyncio.CancelledError):
                    await self._log(run, events, flush=True)
            raise
        finally:
            watcher.cancel()
            self._runs.pop(run.response_id, None)
            self._listen(run, None)

    async def _generate(self, run: BackgroundRun) -> None:
        out, writer = run.out, run.writer
        await self._publish(run, out.start(), flush=True)  # now in_progress
        if not await self._save(run):
            return
        try:
            async with contextlib.aclosing(merged_chunks(self.orchestrator, run.choices)) as chunks:
                async for index, chunk in chunks:
                    for event in writer.add(index, chunk):
                        await self._publish(run, out.add(event))
            events = out.finish(writer.usage())
        except RouterError as exc:
            log.warning("background response %s failed: %s", run.response_id, exc.message)
            events = out.fail("server_error", exc.message)
        except Exception as exc:
            log.exception("background response %s failed", run.response_id)
            events = out.fail("server_error", f"internal error: {type(exc).__name__}")
        # Stored before a streaming client hears it ended; a run cancelled meanwhile tells it nothing more.
        if await self._save(run):
            await self._publish(run, events, flush=True)

    async def _save(self, run: BackgroundRun) -> bool:
        """Write the run's state if its record is still active; False (and the run marked cancelled) when
        it was cancelled or deleted. A store that fails loses only this write (logged and counted)."""
        try:
            if await self.store.replace_active(run.record(self._snapshot(run))):
                return True
        except RedisError as exc:
            self.metrics.response_store_errors.inc()
            log.warning("background response %s: record not updated: %s", run.response_id, exc)
            return True
        run.cancelled = True
        return False

    async def _watch(self, run: BackgroundRun, task: asyncio.Task[None]) -> None:
        """Stop ``task`` once the run's record is cancelled or deleted (by any router)."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                record = await self.store.get(run.response_id)
            except RedisError as exc:
                log.warning("background response %s: record not read: %s", run.response_id, exc)
                continue
            if record is None or record.response.get("status") == "cancelled":
                log.info("background response %s cancelled: stopping it", run.response_id)
                run.cancelled = True
                task.cancel()
                return

    @staticmethod
    def _snapshot(run: BackgroundRun) -> dict[str, Any]:
        return copy.deepcopy(run.out.response())  # the stream goes on changing its items

    async def _publish(self, run: BackgroundRun, events: list[dict[str, Any]], flush: bool = False) -> None:
        await self._log(run, events, flush)
        self._listen(run, events)

    async def _log(self, run: BackgroundRun, events: list[dict[str, Any]], flush: bool) -> None:
        """``events`` to the run's log, unless it was cancelled (its log stops where ``_flush`` left it):
        gathered, and written together once ``LOG_EVERY_S`` has passed since the last write, or at once
        with ``flush``."""
        if run.cancelled:
            return
        run.unlogged += events
        if flush or time.monotonic() - run.logged_at >= LOG_EVERY_S:
            await self._flush(run)

    async def _flush(self, run: BackgroundRun) -> None:
        """The run's gathered events to its log (the store writes nothing once the record is gone). A store
        that fails loses only these events from the log (logged and counted)."""
        events, run.unlogged, run.logged_at = run.unlogged, [], time.monotonic()
        if events:
            try:
                await self.store.append_events(run.response_id, events)
            except RedisError as exc:
                self.metrics.response_store_errors.inc()
                log.warning("background response %s: events not logged: %s", run.response_id, exc)

    @staticmethod
    def _listen(run: BackgroundRun, events: list[dict[str, Any]] | None) -> None:
        if run.listener is None:
            return
        if events is None:
            run.listener.put_nowait(None)
        else:
            for event in events:
                run.listener.put_nowait(event)
