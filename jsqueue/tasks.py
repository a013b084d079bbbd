"""Ending a background task for good.

One ``Task.cancel()`` does not always end a task on Python 3.11: ``asyncio.wait_for`` (ours,
and the one under every nats-py request) returns the result of an operation that completed
in the same event-loop turn as the cancellation, which is then lost (CPython gh-86296; the
3.12 ``wait_for`` is built on ``asyncio.timeout`` and keeps it). A loop cancelled that way
goes on: a presence heartbeat keeps a stopped worker from returning, a lease heartbeat
renews a lease after its delivery ended. :func:`cancel_and_wait` cancels again at the
task's next await until it has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Seconds between two cancellations of a task still running.
RECANCEL_S = 0.1


async def cancel_and_wait(*tasks: asyncio.Future[Any], again_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling each one still
    running again every ``again_s`` seconds. Their outcomes are left to the caller (await
    a task afterwards for its result or error). Idempotent; ended tasks are left as they
    are.

    Only for tasks with nothing to finish on cancellation: a task that catches
    ``CancelledError`` to clean up is cancelled again during a clean-up that outlasts
    ``again_s``.

    Raises:
        CancelledError: the caller was cancelled (the tasks have been cancelled at least
            once).
    """
    running = {t for t in tasks if not t.done()}
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=again_s)
