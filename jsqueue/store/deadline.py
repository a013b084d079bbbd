"""How long the store retries: a deadline a caller sets for the writes and reads it makes.

A node loss in a cluster stalls JetStream for a Raft election (~4–9 s measured, DESIGN.md
§6); a write sent meanwhile times out or finds no stream leader. The SMTP front end has
``smtp.store_timeout_s`` to store a message before it must answer ``451``: it runs its
ingest under :func:`retry_store_for`, and every store operation made in it (and in the
tasks started in it, which inherit the context) retries temporary failures until that
deadline instead of for the adapter's own shorter budget. Outside such a block each
adapter keeps its own budget. Pure: no I/O (a context variable and the monotonic clock).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["retry_budget_s", "retry_store_for"]

_deadline: ContextVar[float | None] = ContextVar("jsqueue_store_deadline", default=None)


@contextlib.contextmanager
def retry_store_for(seconds: float) -> Iterator[None]:
    """Within the block (and tasks created in it), store operations retry temporary
    failures (timeouts, no stream leader) until ``seconds`` from now. Nested blocks: the
    inner one's deadline holds within it. Idempotent in effect; never raises."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def retry_budget_s(default_s: float) -> float:
    """Seconds a store operation may go on retrying from now: what is left to the deadline
    of the enclosing :func:`retry_store_for` block (0 once it passed), else ``default_s``.
    """
    deadline = _deadline.get()
    if deadline is None:
        return default_s
    return max(0.0, deadline - time.monotonic())
