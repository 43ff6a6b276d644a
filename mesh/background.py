"""Background tasks of a service (router or worker): started by name, kept alive while they run, cancelled
and awaited on close.

asyncio holds only a weak reference to a task, so a task nobody keeps may be collected before it ends;
a task whose exception nobody reads is reported only when it is collected, if ever. ``BackgroundTasks``
keeps a strong reference to each task until it ends, logs any exception one raises (cancellation is not
one), and on ``close`` cancels what is still running and awaits it, so that no task outlives its owner.

This module owns the tasks' lifetime; it does not retry, time out or order them.

A task may swallow a cancellation and go on: on Python 3.11 ``asyncio.wait_for`` does so when its inner
await completes just as the cancellation arrives (cpython#86296, fixed in 3.12), so a loop built on it
can miss the one ``cancel()`` its owner sends and be awaited forever (a router's registry discovery
once hung a test's ``close`` for its whole timeout that way). The services use ``asyncio.timeout``
instead, and ``cancel_until_done`` and ``BackgroundTasks.close`` cancel again until a task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


RECANCEL_S = 2.0  # how long a cancelled task may take to end (its cleanup) before it is cancelled again


async def cancel_until_done(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again every ``RECANCEL_S`` while it runs
    on (see the module docstring). Its exception, if any, is its owner's to read."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)


class BackgroundTasks:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # named in log lines: whose task failed
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task named ``name``; the caller may keep the task, but need not."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s: background task %s failed", self.owner, task.get_name(), exc_info=exc)

    async def close(self, grace_s: float = 0.0) -> None:
        """Give running tasks up to ``grace_s`` seconds to end, then cancel the rest and await them all.
        Tasks they spawn while being closed are closed too."""
        if self._tasks and grace_s > 0:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        while self._tasks:
            # Each task's failure is logged by _done; a task that runs on after its cancellation is
            # cancelled again (the loop comes back to it while it is still in the set).
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=RECANCEL_S)
