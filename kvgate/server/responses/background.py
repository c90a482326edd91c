"""Background responses of this process: each an asyncio task, found by its response id
to be cancelled (``POST /v1/responses/{id}/cancel``), all cancelled when the server stops.

A cancel that reaches another process (a replica) than the one running the response marks
its row ``cancelled``; the running process sees that within ``POLL_S`` and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("kvgate.server")

#: Seconds between a background run's looks at its row (a cancel from another replica).
POLL_S = 1.0


class BackgroundRuns:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set while the server stops: a run cut then is ``failed``, not ``cancelled``.
        self.stopping = False

    def start(self, response_id: str, run: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(run, name=f"kvgate-{response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda t: self._done(response_id, t))

    def _done(self, response_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(response_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("background response %s failed", response_id, exc_info=task.exception())

    def cancel(self, response_id: str) -> bool:
        """Cancel a run of this process; False: none here by that id."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def wait(self, response_id: str) -> None:
        """Until the run (if it is this process's) has ended and written its row."""
        task = self._tasks.get(response_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(task)

    def __len__(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        """The server stops: every run is cut and writes its row (``failed``)."""
        self.stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
