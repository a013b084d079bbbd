"""Pacing of long background loops (a reconciler pass, a depth scan, the dashboard's depth
sample) so that, however large the queue, they leave the event loop to the mail that
shares it: :class:`Pacer` rests after every slice of work for as long as keeps the loop's
work to its ``share`` of the time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

#: Work between two rests, seconds: the longest the loop's other tasks wait on a paced loop
#: beyond their own turn (a few event-loop turns; a small queue never rests at all).
SLICE_S = 0.05


def rest_after(worked_s: float, share: float) -> float:
    """Seconds to rest after ``worked_s`` seconds of work for the work to take ``share`` of
    the time (``0 < share <= 1``; 1 never rests). Pure."""
    return worked_s * (1 / share - 1)


def cycle_rest(interval_s: float, busy_s: float, wall_s: float, share: float) -> float:
    """Seconds from the end of a loop's run to the start of its next, at least
    ``interval_s``: long enough that the run's work (``busy_s``, of ``wall_s`` seconds in
    all) is at most ``share`` of the whole cycle (run and rest). A run paced by a
    :class:`Pacer` at ``share`` needs no more than the interval; an unpaced one rests
    ``busy_s × (1 / share - 1)``. Pure."""
    return max(interval_s, busy_s / share - wall_s)


class Pacer:
    """Rests a loop of work so that it takes at most ``share`` of the time.

    Call :meth:`step` between units of work (a batch of reads, one entry); once
    :data:`SLICE_S` has passed since the last rest it sleeps :func:`rest_after` that long.
    The time counted is wall time, so the other tasks the loop ran meanwhile count as the
    paced loop's work: it errs towards resting more. :meth:`hurry` ends the rests (the
    run is wanted done soon). Not thread-safe; one per run.

    Args:
        share: the largest share of the time the work takes, ``0 < share <= 1`` (1: never
            rests, the run goes at full speed).
        slice_s: work between two rests, seconds.
        max_rest_s: the longest single rest, seconds (a lock held across the run must be
            renewed in time); None for no bound.
        clock: monotonic seconds (for tests).
        sleep: the coroutine that rests (for tests).

    Raises:
        ValueError: ``share`` outside ``(0, 1]`` or ``slice_s`` not positive.

    Attributes:
        busy_s: seconds of work so far (up to the last :meth:`step` or :meth:`finish`).
        rested_s: seconds rested so far.
        resting: whether a rest is under way.
    """

    def __init__(
        self,
        share: float,
        *,
        slice_s: float = SLICE_S,
        max_rest_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a pacer's share must be in (0, 1], not {share}")
        if slice_s <= 0:
            raise ValueError(f"a pacer's slice must be positive, not {slice_s}")
        self.share = share
        self.slice_s = slice_s
        self.max_rest_s = max_rest_s
        self._clock = clock
        self._sleep = sleep
        self.busy_s = 0.0
        self.rested_s = 0.0
        self.resting = False
        self._hurried = asyncio.Event()
        self._since = clock()

    def hurry(self) -> None:
        """End the rest under way and take no more: the run goes on at full speed (a
        recovery pass is wanted after a reconnect). Never blocks; idempotent."""
        self.share = 1.0
        self._hurried.set()

    async def step(self) -> None:
        """Rest if a slice of work has passed since the last rest; else return at once."""
        worked = self._clock() - self._since
        if worked < self.slice_s:
            return
        self.busy_s += worked
        rest = rest_after(worked, self.share)
        if self.max_rest_s is not None:
            rest = min(rest, self.max_rest_s)
        if rest > 0 and not self._hurried.is_set():
            await self._rest(rest)
        self._since = self._clock()

    async def _rest(self, seconds: float) -> None:
        began = self._clock()
        self.resting = True
        sleep = asyncio.ensure_future(self._sleep(seconds))
        woken = asyncio.ensure_future(self._hurried.wait())
        try:
            await asyncio.wait((sleep, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.resting = False
            sleep.cancel()
            woken.cancel()
            self.rested_s += self._clock() - began

    def finish(self) -> float:
        """Count the work since the last rest; returns :attr:`busy_s`. Idempotent."""
        now = self._clock()
        self.busy_s += now - self._since
        self._since = now
        return self.busy_s


def failure_backoff_s(failures: int, base_s: float, max_s: float, draw: float) -> float:
    """Seconds to wait after the ``failures``-th failure in a row of a loop's run (>= 1):
    ``base_s · 2^(failures-1)`` bounded by ``max_s``, of which a random half is taken off
    (``draw`` in [0, 1): "equal jitter", so that processes that failed together do not try
    again together). Pure.

    Returns:
        a pause in ``[bound / 2, bound]`` where ``bound = min(max_s, base_s · 2^(failures-1))``.
    """
    bound = min(max_s, base_s * 2.0 ** min(max(failures, 1) - 1, 62))
    return bound * (0.5 + 0.5 * min(max(draw, 0.0), 1.0))
