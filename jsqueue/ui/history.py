"""What the dashboard's overview shows over time, kept in memory so that a page view reads
no entry at all:

* :class:`DepthHistory` - queue depth by state and by destination domain, the oldest
  entry: a background task takes a sample with one pass over the entries through
  :meth:`jsqueue.admin.Admin.scan` (the entries ``queue stats`` counts, counted the same
  way) at most every ``ui.sample_interval_s`` and never sooner than ten times the last
  pass worked (so the passes cost at most a tenth of one process's time, whatever the
  queue's size); a pass pauses as long as it worked after every 50 ms of work, so the
  pages the process serves meanwhile stay quick. The last ``ui.history_samples`` samples
  are kept in a ring;
* :class:`OutcomeCounter` - recipient outcomes (delivered, deferred, bounced, expired)
  per minute, cluster-wide: a background task follows the events stream
  (:func:`jsqueue.events.tail`, from ``ui.outcome_minutes`` back at start) and counts
  the events into per-minute buckets.

Both are best effort: a failed pass or a lost events connection is logged and retried
after a pause, and the overview shows how old its newest sample is.

:class:`Sampling` runs the two only while somebody looks: the first page view starts them,
and ``ui.idle_s`` seconds after the last one they stop. Every process with an HTTP endpoint
serves the dashboard (each pod of a deployment), and a sampler that ran regardless would
read every entry every few seconds and every event in each of them, whether the dashboard
is open or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from jsqueue.admin import OPEN_STATES, Admin, EntryFilter
from jsqueue.config import NatsSettings
from jsqueue.envelope import EntryState, RecipientState, utcnow
from jsqueue.errors import JsqueueError
from jsqueue.events import Event, EventKind, tail
from jsqueue.names import Names
from jsqueue.pacing import Pacer
from jsqueue.tasks import cancel_and_wait

log = logging.getLogger("jsqueue.ui")

#: A pass is repeated after at least this many times its own duration (cost bound: 10 %).
COST_FACTOR = 10.0
#: Destination domains kept per sample (the ones with most open recipients).
TOP_DOMAINS = 10
#: Pause after a failed pass or a lost events connection, seconds.
RETRY_PAUSE_S = 5.0
#: The share of the time a depth pass works while it runs (it rests as long as it worked).
PASS_SHARE = 0.5
#: The recipient outcomes counted per minute, in the order the overview shows them.
OUTCOMES = (EventKind.DELIVERED, EventKind.DEFERRED, EventKind.BOUNCED, EventKind.EXPIRED)


@dataclass(frozen=True)
class Sample:
    """One depth sample.

    Attributes:
        at: when the pass ended, aware UTC.
        entries: queued messages (what ``queue ls`` lists).
        by_state: queued messages by derived state.
        by_domain: open recipients of the :data:`TOP_DOMAINS` busiest destination domains.
        deferred_by_domain: of those, how many are deferred.
        domains: destination domains with an open recipient.
        oldest_id: the oldest queued message, or None.
        oldest_age_s: its age at ``at``, seconds.
        backlog: work items not settled, None if unknown.
        took_s: how long the pass worked, seconds (its pauses left out).
        wall_s: how long the pass took from start to end, seconds.
    """

    at: datetime
    entries: int
    by_state: dict[EntryState, int]
    by_domain: dict[str, int]
    deferred_by_domain: dict[str, int]
    domains: int
    oldest_id: str | None
    oldest_age_s: float | None
    backlog: int | None
    took_s: float
    wall_s: float


class DepthHistory:
    """A ring of :class:`Sample`, refreshed by :meth:`run`.

    Args:
        admin: the queue operations to read with (only :meth:`Admin.stats` is used).
        interval_s: shortest time between two passes, seconds.
        keep: samples kept.
    """

    def __init__(self, admin: Admin, *, interval_s: float, keep: int) -> None:
        self.admin = admin
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=keep)
        self.sampled = asyncio.Event()
        self.last_error: str | None = None

    @property
    def latest(self) -> Sample | None:
        """The newest sample, or None before the first pass ended."""
        return self.samples[-1] if self.samples else None

    async def sample(self) -> Sample:
        """Take one sample now and keep it: one pass over every entry in arrival order
        (``Admin.scan``, the entries ``queue stats`` counts), resting as long as it worked
        after every slice of work (:class:`~jsqueue.pacing.Pacer` at :data:`PASS_SHARE`),
        so pages served by the same process meanwhile wait at most about a slice (the pass
        takes about twice its work time; its cost bound counts the work only).

        Raises:
            StoreUnavailable: reading the entries failed.
        """
        started = time.monotonic()
        pacer = Pacer(PASS_SHARE)
        by_state: dict[EntryState, int] = {}
        by_domain: dict[str, list[int]] = {}
        oldest: tuple[datetime, str] | None = None
        entries = 0
        # store pages of SCAN_PAGE (10 000): each store page lists every key again
        scan = self.admin.scan(EntryFilter(states=OPEN_STATES))
        async with contextlib.aclosing(scan):
            async for v in scan:
                e = v.entry
                entries += 1
                by_state[e.state] = by_state.get(e.state, 0) + 1
                if oldest is None or (e.created_at, e.id) < oldest:
                    oldest = (e.created_at, e.id)
                for r in e.recipients:
                    if not r.state.is_final:
                        counts = by_domain.setdefault(r.domain, [0, 0])
                        counts[0] += 1
                        counts[1] += r.state is RecipientState.DEFERRED
                await pacer.step()
        busy = pacer.finish()
        try:
            backlog: int | None = await self.admin.stores.scheduler.backlog()
        except JsqueueError:
            backlog = None
        now = utcnow()
        top = sorted(by_domain.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_DOMAINS]
        s = Sample(
            at=now,
            entries=entries,
            by_state=by_state,
            by_domain={d: c[0] for d, c in top},
            deferred_by_domain={d: c[1] for d, c in top},
            domains=len(by_domain),
            oldest_id=oldest[1] if oldest else None,
            oldest_age_s=(now - oldest[0]).total_seconds() if oldest else None,
            backlog=backlog,
            took_s=busy,
            wall_s=time.monotonic() - started,
        )
        self.samples.append(s)
        self.last_error = None
        self.sampled.set()
        return s

    def next_after_s(self, took_s: float) -> float:
        """Seconds from the start of a pass that took ``took_s`` to the next one."""
        return max(self.interval_s, COST_FACTOR * took_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set. Never raises (failures are logged and retried)."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                s = await self.sample()
                pause = self.next_after_s(s.took_s)
            except JsqueueError as e:
                if self.last_error is None:
                    log.warning("dashboard depth sample failed: %s", e)
                self.last_error = str(e)
                pause = max(self.interval_s, RETRY_PAUSE_S)
            remaining = pause - (time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, remaining))


@dataclass
class OutcomeCounter:
    """Recipient outcomes per minute (UTC minute → kind → count), the last ``minutes``.

    Attributes:
        minutes: minutes kept.
        buckets: minute start → outcome → events.
        seen: events counted in all.
        following: True while the events stream is followed.
    """

    minutes: int
    buckets: dict[datetime, dict[EventKind, int]] = field(default_factory=dict)
    seen: int = 0
    following: bool = False
    _ids: deque[str] = field(default_factory=lambda: deque(maxlen=10_000))
    _recent: set[str] = field(default_factory=set)

    def reset(self) -> None:
        """Forget every count (a new run of :class:`Sampling` reads them again)."""
        self.buckets.clear()
        self.seen = 0
        self._ids.clear()
        self._recent.clear()

    def count(self, event: Event) -> None:
        """Count one event (outcomes only; an event id seen lately is not counted twice,
        as after a reconnect that starts again a little earlier)."""
        if event.kind not in OUTCOMES or event.id in self._recent:
            return
        if len(self._ids) == self._ids.maxlen:
            self._recent.discard(self._ids[0])
        self._ids.append(event.id)
        self._recent.add(event.id)
        minute = event.at.replace(second=0, microsecond=0)
        bucket = self.buckets.setdefault(minute, {})
        bucket[event.kind] = bucket.get(event.kind, 0) + 1
        self.seen += 1
        self._trim(utcnow())

    def _trim(self, now: datetime) -> None:
        oldest = now.replace(second=0, microsecond=0) - timedelta(minutes=self.minutes - 1)
        for minute in [m for m in self.buckets if m < oldest]:
            del self.buckets[minute]

    def series(self, now: datetime | None = None) -> list[tuple[datetime, dict[EventKind, int]]]:
        """Every minute of the window, oldest first, with its counts (empty minutes too)."""
        now = now or utcnow()
        self._trim(now)
        last = now.replace(second=0, microsecond=0)
        return [
            (m, dict(self.buckets.get(m, {})))
            for m in (last - timedelta(minutes=i) for i in range(self.minutes - 1, -1, -1))
        ]

    def totals(self, last_minutes: int = 1, now: datetime | None = None) -> dict[EventKind, int]:
        """Outcomes of the last ``last_minutes`` minutes (the current one included)."""
        out = dict.fromkeys(OUTCOMES, 0)
        for _, counts in self.series(now)[-last_minutes:]:
            for kind, n in counts.items():
                out[kind] += n
        return out

    async def follow(
        self,
        settings: NatsSettings,
        urls: list[str],
        *,
        names: Names | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """Count the events stream's outcomes forever (stop by cancelling the task),
        reconnecting after a pause when NATS fails. Raises nothing but CancelledError."""
        since = clock() - timedelta(minutes=self.minutes)
        while True:
            events = tail(settings, urls, names=names, kinds=OUTCOMES, since=since)
            try:
                async with contextlib.aclosing(events):
                    self.following = True
                    async for event in events:
                        self.count(event)
                        since = event.at
            except JsqueueError as e:
                log.warning("dashboard: events stream lost (%s); again in %.0f s", e, RETRY_PAUSE_S)
            finally:
                self.following = False
            await asyncio.sleep(RETRY_PAUSE_S)


class Sampling:
    """The overview's background work (:meth:`DepthHistory.run` and ``follow``), running
    only while the dashboard is viewed: :meth:`viewed` starts it when stopped, and it stops
    ``idle_s`` seconds after the last :meth:`viewed`. A start begins afresh: the depth ring
    and the outcome counts are emptied and the outcomes are read again from the events
    stream (``outcome_minutes`` back), so the charts never join two periods across a gap.

    Args:
        history: the depth ring to fill.
        outcomes: the outcome counter to fill.
        follow: makes the coroutine that follows the events stream into ``outcomes``
            (:meth:`OutcomeCounter.follow` with its settings).
        idle_s: seconds without a view after which the work stops.
    """

    def __init__(
        self,
        history: DepthHistory,
        outcomes: OutcomeCounter,
        follow: Callable[[], Coroutine[None, None, None]],
        *,
        idle_s: float,
    ) -> None:
        self.history = history
        self.outcomes = outcomes
        self._follow = follow
        self.idle_s = idle_s
        self._seen = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ending: list[asyncio.Task[None]] = []  # stopped, perhaps not ended yet
        self._stop = asyncio.Event()
        self.starts = 0

    @property
    def running(self) -> bool:
        """Whether any of the work's tasks (sampler, follower, idle timer) has not ended,
        a stopped run's included until its last task ended."""
        return any(not t.done() for t in (*self._tasks, *self._ending))

    def viewed(self) -> None:
        """A page was viewed: keep the work running ``idle_s`` more, or start it.
        Idempotent within a run.

        Raises:
            RuntimeError: no running event loop (the tasks are created on it).
        """
        self._seen.set()
        if self._tasks:
            return
        self.history.samples.clear()
        self.history.sampled.clear()
        self.outcomes.reset()
        self._stop = asyncio.Event()
        self.starts += 1
        log.info("dashboard viewed: sampling until %.0f s after the last view", self.idle_s)
        self._tasks = [
            asyncio.create_task(self.history.run(self._stop), name="jsqueue-ui-depth"),
            asyncio.create_task(self._follow(), name="jsqueue-ui-outcomes"),
            asyncio.create_task(self._idle(), name="jsqueue-ui-idle"),
        ]

    async def _idle(self) -> None:
        """Wait until ``idle_s`` passed since the last view, then stop the others."""
        while True:
            self._seen.clear()
            try:
                await asyncio.wait_for(self._seen.wait(), self.idle_s)
            except TimeoutError:
                break
        log.info("dashboard not viewed for %.0f s: sampling stopped", self.idle_s)
        tasks, self._tasks = self._tasks, []
        self._ending = tasks  # this task among them: running until it returned
        await _cancel(self._stop, [t for t in tasks if t is not asyncio.current_task()])

    async def close(self) -> None:
        """Stop the work now (the endpoint shuts down). Idempotent."""
        tasks, self._tasks = self._tasks, []
        tasks += [t for t in self._ending if t not in tasks]
        self._ending = tasks
        await _cancel(self._stop, tasks)


async def _cancel(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Set ``stop`` and cancel ``tasks`` (a pass over a large queue takes long: it is not
    waited for), then wait for them to end."""
    stop.set()
    await cancel_and_wait(*tasks)
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
