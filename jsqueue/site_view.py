"""One worker's view of one site of the destination limits (composition): the slots it
holds, its deliveries under way, the deliveries waiting for a session unit and how they are
woken, one at a time and in order. :class:`jsqueue.destinations.Destinations` keeps one per
site; ``docs/architecture.md`` (Destinations) tells the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

from jsqueue.limits import SiteState

__all__ = ["HOLD_GUESS_S", "SiteView"]

#: Seconds a delivery is assumed to hold its session unit before one was measured here.
HOLD_GUESS_S = 0.1


@dataclass
class SiteView:
    """A worker's view of one site."""

    name: str
    slots: dict[int, int] = field(default_factory=dict)  # slot n -> revision we wrote
    active: int = 0  # deliveries admitted and not done (each has, or will have, a session)
    unlimited: int = 0  # of those, admitted without the limits (the bucket was unreachable)
    admitting: int = 0  # admissions under way (their waits for a unit included)
    conn_paid: int = 0  # connection-rate tokens admissions took for sessions not yet opened
    waiters: int = 0
    wakers: deque[asyncio.Future[None]] = field(default_factory=deque)  # waiters, in order
    state: SiteState = field(default_factory=SiteState)
    state_rev: int = 0
    state_at: float = -1e9  # loop time of the last read
    full_until: float = 0.0  # loop time
    tats: dict[str, tuple[float | None, int]] = field(default_factory=dict)
    probe_rev: int | None = None
    used_at: float = 0.0
    deferred: dict[str, int] = field(default_factory=dict)
    hold_s: float = HOLD_GUESS_S  # mean time a delivery held its unit here
    paced_until: float = 0.0  # loop time: the last item put back as full is offered again
    scan: asyncio.Lock = field(default_factory=asyncio.Lock)  # one slot scan at a time

    def wake(self) -> None:
        """Wake the longest waiting delivery (one unit, one waiter: waking them all made
        every freed unit cost each waiter a turn of the event loop). Idempotent when
        nobody waits."""
        while self.wakers:
            woken = self.wakers.popleft()
            if not woken.done():
                woken.set_result(None)
                return

    async def wait_turn(self, timeout_s: float) -> None:
        """Wait, counted in :attr:`waiters`, until :meth:`wake` picks this delivery or
        ``timeout_s`` seconds pass (no error either way: the caller looks again).

        Raises:
            CancelledError: the delivery was cancelled (a drain), also in the turn it was
                woken (``asyncio.wait``: ``wait_for`` loses that one on Python 3.11,
                :mod:`jsqueue.tasks`).
        """
        woken = asyncio.get_running_loop().create_future()
        self.waiters += 1
        self.wakers.append(woken)
        try:
            await asyncio.wait({woken}, timeout=timeout_s)
        finally:
            self.waiters -= 1
            if not woken.done() or woken.cancelled():
                with contextlib.suppress(ValueError):
                    self.wakers.remove(woken)
