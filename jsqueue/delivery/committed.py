"""Which delivery tasks have sent a final dot (RFC 5321 §4.1.1.4): from then on the next
hop may hold the message, and only its reply to that dot says whether it does. Cancelled
then (a worker's drain on SIGTERM), the attempt records nothing and the message goes out
again although it may have been delivered (RFC 5321 §6.1), and so do the recipients that
earlier transactions of the attempt delivered. The session marks its task here
(:func:`mark_dot_sent`); the worker's drain lets a marked task finish (:func:`dot_sent`)
instead of cancelling it. Tasks are held weakly: a finished task is forgotten.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

__all__ = ["dot_sent", "mark_dot_sent"]

_MARKED: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


def mark_dot_sent() -> None:
    """Mark the current task: it sent a final dot (call right after writing it). Outside
    a task (no current task) nothing is marked."""
    task = asyncio.current_task()
    if task is not None:
        _MARKED.add(task)


def dot_sent(task: asyncio.Task[Any] | None) -> bool:
    """Whether ``task`` (None: no task, False) sent a final dot in its delivery
    (:func:`mark_dot_sent`). Pure read."""
    return task is not None and task in _MARKED
