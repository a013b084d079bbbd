"""The shared state of a site of the destination limits, as one worker reads and writes it
(composition): the site state ``site.<site>`` (connection failures, the dead-site cool-off,
the throttle, the workers' demand), the probe key ``probe.<site>`` and the GCRA rate buckets
``rate.<site>.msg`` / ``rate.<site>.conn``, each changed by compare-and-set; and the feedback
that turns an attempt's replies into a change of the site state. The session slots are
:class:`jsqueue.destinations.Destinations`'; ``docs/architecture.md`` (Destinations) tells
the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from jsqueue import limits
from jsqueue.config import DestinationSettings, Rate
from jsqueue.delivery.base import Attempt
from jsqueue.errors import StoreUnavailable
from jsqueue.events import NULL_OBSERVER, Event, EventKind, Observer
from jsqueue.limits import SiteState, SiteStatus
from jsqueue.names import probe_key, rate_key, site_key
from jsqueue.replies import Reply
from jsqueue.site_view import SiteView
from jsqueue.store.base import DestinationStore

__all__ = ["CAS_TRIES", "DEMAND_REFRESHES", "SharedSite"]

log = logging.getLogger("jsqueue.destinations")

#: Compare-and-set tries on a site state or rate bucket before giving up for this time.
CAS_TRIES = 5
#: A worker's demand for a site (:func:`jsqueue.limits.want`) stands this many times
#: ``state_refresh_s``: long enough that every holder reads it at its next refresh.
DEMAND_REFRESHES = 3


class SharedSite:
    """One worker's access to the shared keys of every site but its slots.

    Every method takes the worker's :class:`~jsqueue.site_view.SiteView` of the site, whose
    copy of the state (at most ``state_refresh_s`` old), revisions and last seen TATs it
    reads and updates.

    Args:
        store: the shared destinations bucket.
        settings: the ``[destinations]`` section.
        owner: this worker's name (written into its probe and its demand).
        observer: receives ``site_down`` / ``site_up`` events.
        clock: Unix seconds (the shared state's times are Unix seconds).

    Raises:
        StoreUnavailable: from every method that reads or writes, unless it says otherwise.
    """

    def __init__(
        self,
        store: DestinationStore,
        settings: DestinationSettings,
        *,
        owner: str,
        observer: Observer = NULL_OBSERVER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.owner = owner
        self.observer = observer
        self.clock = clock

    async def want(self, site: SiteView) -> None:
        """Make this worker's demand for ``site`` known (at most one write per
        ``DEMAND_REFRESHES * state_refresh_s / 2``); best effort, never raises."""
        ttl_s = DEMAND_REFRESHES * self.settings.state_refresh_s
        now = self.clock()
        with contextlib.suppress(StoreUnavailable):
            await self.change(site, lambda st: limits.want(st, self.owner, now, ttl_s))

    async def take_rate(self, site: SiteView, kind: str, rate: Rate) -> float:
        """Take one event from ``site``'s GCRA bucket ``kind`` (``msg`` or ``conn``).

        Returns:
            0 when taken, else seconds to wait (``full_delay_s`` after :data:`CAS_TRIES`
            lost compare-and-sets). A refusal by the TAT last seen costs no round trip: a
            TAT only grows. Not idempotent: each 0 is one event taken."""
        key = rate_key(site.name, kind)
        tat, rev = site.tats.get(kind, (None, -1))
        for _ in range(CAS_TRIES):
            if rev < 0:
                read = await self.store.get(key)
                rev = read.revision
                raw = (read.value or {}).get("tat")
                tat = float(raw) if isinstance(raw, int | float) else None
            now = self.clock()
            step = limits.gcra(tat, now, rate.events, rate.interval_s, self.settings.rate_burst)
            if not step.allowed:
                site.tats[kind] = (tat, rev)
                return step.wait_s
            ttl = step.tat_s - now + rate.interval_s
            new = await self.store.put(key, {"tat": step.tat_s}, revision=rev, ttl_s=ttl)
            if new is not None:
                site.tats[kind] = (step.tat_s, new)
                return 0.0
            rev = -1
        return self.settings.full_delay_s

    def _ttl_s(self, site: str) -> float:
        s = self.settings
        return 2 * s.cool_off_s + s.throttle_hold_s + s.throttle_grow_s * s.sessions_of(site)

    async def state(self, site: SiteView, *, fresh: bool = False) -> SiteState:
        """The site's state: the worker's copy, read again when older than
        ``state_refresh_s`` seconds or when ``fresh``."""
        loop = asyncio.get_running_loop()
        if fresh or loop.time() - site.state_at >= self.settings.state_refresh_s:
            read = await self.store.get(site_key(site.name))
            site.state, site.state_rev = SiteState.from_json(read.value), read.revision
            site.state_at = loop.time()
        return site.state

    async def change(
        self, site: SiteView, change: Callable[[SiteState], SiteState]
    ) -> tuple[SiteState, SiteState]:
        """Apply the pure function ``change`` to the shared state by compare-and-set (a
        state that becomes clear is deleted), reading it again after each lost one.

        Returns:
            (before, after); after equals the copy kept when :data:`CAS_TRIES` were lost."""
        before = after = site.state
        for i in range(CAS_TRIES):
            before = await self.state(site, fresh=i > 0)
            after = change(before)
            if after == before:
                return before, after
            key = site_key(site.name)
            if after.is_clear:
                ok = await self.store.delete(key, revision=site.state_rev)
                rev: int | None = site.state_rev if ok else None
            else:
                rev = await self.store.put(
                    key,
                    dict(after.to_json()),
                    revision=site.state_rev,
                    ttl_s=self._ttl_s(site.name),
                )
            if rev is not None:
                site.state, site.state_rev = after, rev
                site.state_at = asyncio.get_running_loop().time()
                if after.is_clear:
                    site.state_at = -1e9  # read the delete marker's revision next time
                return before, after
        return before, after

    async def take_probe(self, site: SiteView) -> bool:
        """Create ``probe.<site>`` (or take it over from a delete marker or an expired
        probe): True when this worker is the one to probe the site (RFC 5321 §4.5.4.1)."""
        value: dict[str, object] = {"owner": self.owner, "at": self.clock()}
        rev = await self.store.put(
            probe_key(site.name), value, revision=0, ttl_s=self.settings.probe_ttl_s
        )
        if rev is None:
            current = await self.store.get(probe_key(site.name))
            if current.value is None:
                rev = await self.store.put(
                    probe_key(site.name),
                    value,
                    revision=current.revision,
                    ttl_s=self.settings.probe_ttl_s,
                )
        if rev is None:
            return False
        site.probe_rev = rev  # (a task that lost leaves the winner's revision alone)
        return True

    async def drop_probe(self, site: SiteView, probe: bool) -> None:
        """Delete the probe this worker took, when ``probe``. Idempotent; never raises
        (a probe left behind expires within ``probe_ttl_s``)."""
        if probe and site.probe_rev is not None:
            rev, site.probe_rev = site.probe_rev, None
            with contextlib.suppress(StoreUnavailable):
                await self.store.delete(probe_key(site.name), revision=rev)

    async def feedback(self, site: SiteView, attempt: Attempt) -> None:
        """Change the site state by what ``attempt`` got back: a throttle reply
        (:func:`jsqueue.limits.is_throttle`, RFC 5321 §4.2.2 421) halves the site's sessions
        for ``throttle_hold_s``; a connection-level failure counts towards ``dead_after``,
        and a site that reaches it is down for ``cool_off_s`` (RFC 5321 §4.5.4.1; event
        ``site_down``); a session that got an answer clears the count (event ``site_up``
        when the site was down)."""
        s = self.settings
        replies = list(attempt.replies.values())
        now = self.clock()
        if any(limits.is_throttle(r) for r in replies):
            limit = s.sessions_of(site.name)

            def throttled(st: SiteState) -> SiteState:  # from the state the CAS is on
                current = limits.allowed_sessions(st, limit, now, s.throttle_grow_s)
                return limits.after_throttle(st, now, current, s.throttle_hold_s)

            before, after = await self.change(site, throttled)
            if after != before:
                log.warning(
                    "site %s: throttled by the receiver; %d session(s) for %.0f s",
                    site.name,
                    after.throttle_limit or 1,
                    s.throttle_hold_s,
                )
            return
        reached = attempt.reached is not None
        if limits.is_connection_failure(replies, reached, attempt.host is not None):
            before, after = await self.change(
                site, lambda st: limits.after_failure(st, now, s.dead_after, s.cool_off_s)
            )
            was = limits.status(before, now)
            if limits.status(after, now) is SiteStatus.DOWN and was is not SiteStatus.DOWN:
                self._event(EventKind.SITE_DOWN, site.name, after, replies[0] if replies else None)
            return
        if not reached:
            return
        # Failures another worker counted during this attempt are seen on a copy read
        # again when older than state_refresh_s (at most once a second per site and worker),
        # not on the admission's, which a long delivery left far behind.
        state = await self.state(site)
        if state.failures or state.down_until is not None or self._worn(site):
            before, after = await self.change(site, lambda st: self._cleared(site.name, st))
            if limits.status(before, now) is not SiteStatus.UP:
                self._event(EventKind.SITE_UP, site.name, after, None)

    def _worn(self, site: SiteView) -> bool:
        s = self.settings
        return limits.throttle_worn_off(
            site.state, s.sessions_of(site.name), self.clock(), s.throttle_grow_s
        )

    def _cleared(self, site: str, state: SiteState) -> SiteState:
        cleared = limits.after_success(state)
        s = self.settings
        if limits.throttle_worn_off(cleared, s.sessions_of(site), self.clock(), s.throttle_grow_s):
            cleared = replace(cleared, throttle_limit=None, throttled_until=None)
        return cleared

    def _event(self, kind: EventKind, site: str, state: SiteState, reply: Reply | None) -> None:
        until = (
            datetime.fromtimestamp(state.down_until, UTC) if state.down_until is not None else None
        )
        detail = f"site {site} " + (
            f"down until {until.isoformat()} after {state.failures} connection failure(s)"
            if kind is EventKind.SITE_DOWN and until is not None
            else "answers again"
        )
        (log.warning if kind is EventKind.SITE_DOWN else log.info)("%s", detail)
        self.observer.emit(
            Event(
                kind=kind,
                site=site,
                reply=reply,
                source=f"worker:{self.owner}",
                next_attempt_at=until,
                detail=detail,
            )
        )

    # ------------------------------------------------------------------ upkeep
