"""Destination limits across the cluster (composition): before a worker claims a work item it
asks :class:`Destinations` to *admit* the item's site; after the attempt it reports what came
back. The arithmetic is :mod:`jsqueue.limits`'s; the shared state lives in the destinations
KV bucket (:class:`~jsqueue.store.base.DestinationStore`), so the limits hold across every
worker with no other service. ``docs/architecture.md`` (Destinations) tells the whole story.

What is shared, per site (keys in :mod:`jsqueue.names`):

* session slots ``slot.<site>.<n>``, ``n`` below the site's limit: a worker takes one by
  create-if-absent before it opens a session, keeps it while the session runs *and* while
  its connection cache keeps that session idle, renews it by compare-and-set every third
  of ``slot_ttl_s`` and deletes it at such a renewal when no session of its own needs it
  any more (not per delivery: that cost two writes per message). A worker killed with
  SIGKILL renews nothing: its slots expire by TTL within ``slot_ttl_s`` seconds.
* GCRA buckets ``rate.<site>.msg`` / ``rate.<site>.conn``: one theoretical arrival time
  each, advanced by compare-and-set.
* the site state ``site.<site>``: consecutive connection failures, the dead-site cool-off
  (RFC 5321 §4.5.4.1), the throttle after a 421 (§4.2.2, §4.5.3.2), and the *demand* of
  workers that found no slot: while others want the site, a worker keeps at most its fair
  share of the slots (:func:`jsqueue.limits.fair_share`), closing idle sessions over it,
  and the wanting workers' deliveries wait for the slots given up.
* ``probe.<site>``: the one worker probing a site whose cool-off ran out.

Hot path: a delivery that reuses a slot this worker holds costs no round trip; the site
state is read at most once per ``state_refresh_s`` per site and worker; a message rate
costs one compare-and-set per message; a new session one create (more when slots are
contended) and one delete when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from jsqueue import limits
from jsqueue.admission import Admission, site_down_reply
from jsqueue.config import DestinationSettings, Rate
from jsqueue.delivery.base import Attempt
from jsqueue.errors import DeliveryError, StoreUnavailable
from jsqueue.events import NULL_OBSERVER, Observer
from jsqueue.limits import SiteSnapshot, SiteStatus
from jsqueue.names import slot_key
from jsqueue.replies import Reply
from jsqueue.site_shared import SharedSite
from jsqueue.site_view import SiteView
from jsqueue.store.base import DestinationStore

__all__ = ["Destinations"]

log = logging.getLogger("jsqueue.destinations")

#: Seconds a worker remembers that every slot of a site was taken before it scans again.
FULL_MEMO_S = 0.5
#: Weight of the newest measurement in a site's average hold time (an exponential mean).
HOLD_WEIGHT = 0.1
#: Seconds a domain's site name (from its MX hosts, for site groups) is kept.
SITE_NAME_TTL_S = 300.0
#: Seconds after its last use a site's view is forgotten (while up and nothing held).
SITE_IDLE_S = 60.0
#: Seconds a new session waits for room beyond ``slot_wait_s`` (a QUIT takes up to 5 s).
CONNECT_WAIT_S = 5.0
#: Put-back delay of an item whose site is being probed by another worker, seconds.
PROBE_WAIT_S = 2.0


class Destinations:
    """Cluster-wide per-site limits for one worker process.

    Args:
        store: the shared destinations bucket.
        settings: the ``[destinations]`` section.
        owner: this worker's name (written into the slots it holds, for ``dest show``).
        mx_hosts: async domain -> MX host names, used only when ``settings.groups`` is set
            (site by MX host pattern); None = sites are domains.
        observer: receives ``site_down`` / ``site_up`` events.
        clock: Unix seconds (the shared state's times are Unix seconds).
        rng: jitter source.
        max_per_site: deliveries of one site this worker keeps under way or waiting for a
            unit at most (:func:`jsqueue.limits.per_site_cap` of ``worker.concurrency``):
            the rest of its concurrency stays free for other sites, so a full or slow
            site's backlog never holds up theirs; None: no cap.
    """

    def __init__(
        self,
        store: DestinationStore,
        settings: DestinationSettings,
        *,
        owner: str,
        mx_hosts: Callable[[str], Awaitable[list[str]]] | None = None,
        observer: Observer = NULL_OBSERVER,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        max_per_site: int | None = None,
    ) -> None:
        self.store = store
        self.max_per_site = max_per_site
        self.settings = settings
        self.mx_hosts = mx_hosts
        self.clock = clock
        self.shared = SharedSite(store, settings, owner=owner, observer=observer, clock=clock)
        self.rng = rng or random.Random()
        #: site -> (idle sessions kept by the connection cache, sessions being closed);
        #: set by the composition to the deliverer's count, so idle sessions keep slots.
        self.idle_sessions: Callable[[str], tuple[int, int]] = lambda site: (0, 0)
        #: (site, n) -> close up to n idle sessions of the site (they count as being
        #: closed until their QUIT completes); set by the composition to the deliverer's.
        self.shed_sessions: Callable[[str, int], None] = lambda site, n: None
        self._sites: dict[str, SiteView] = {}
        self._names: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------------ sites

    @property
    def owner(self) -> str:
        """This worker's name, as written into its slots, demand and probes."""
        return self.shared.owner

    def rename(self, owner: str) -> None:
        """Use ``owner`` from now on: the worker took another name at its start (a live
        worker had its own, :func:`jsqueue.store.presence.take_name`), before any slot is
        taken. Without it two workers of one host would share one demand key, each keeping
        the whole fair share, and ``dest show`` would name the wrong one."""
        self.shared.owner = owner

    def site_known(self, domain: str) -> str:
        """The site of ``domain`` as last found by :meth:`site_for` (the domain itself when
        never looked up). Synchronous: the deliverer picks its per-site connection cache
        with it."""
        known = self._names.get(domain)
        return known[0] if known is not None else domain

    async def site_for(self, domain: str) -> str:
        """The site of ``domain`` (:func:`jsqueue.limits.site_for`): the domain, or the
        group its MX host names match. Looks MX hosts up at most once per
        :data:`SITE_NAME_TTL_S` per domain, and only when groups are configured; a failed
        lookup leaves the site the domain for this admission only, and is not kept (a
        group's member must not count as a site of its own, with a limit of its own, once
        the DNS answers again; while it fails, so does the delivery's own MX lookup)."""
        groups = self.settings.groups
        if not groups:
            return domain
        loop = asyncio.get_running_loop()
        known = self._names.get(domain)
        if known is not None and known[1] > loop.time():
            return known[0]
        site = limits.site_for(domain, (), groups)
        if site == domain and self.mx_hosts is not None:
            try:
                site = limits.site_for(domain, await self.mx_hosts(domain), groups)
            except DeliveryError as e:
                log.info("site of %s unknown for now (MX lookup: %s)", domain, e)
                return site
        self._names[domain] = (site, loop.time() + SITE_NAME_TTL_S)
        return site

    def _site(self, name: str) -> SiteView:
        site = self._sites.get(name)
        if site is None:
            site = self._sites[name] = SiteView(name)
        site.used_at = asyncio.get_running_loop().time()
        return site

    def _jitter(self, delay_s: float, spread: float = 0.5) -> float:
        return delay_s * (1 + self.rng.uniform(0, spread))

    # ------------------------------------------------------------------ admission

    async def admit(self, domain: str) -> Admission:
        """May mail for ``domain`` be delivered now? Never blocks longer than
        ``slot_wait_s`` (no head-of-line blocking: a full, throttled or dead site puts its
        item back with a delay instead of holding the fetch loop).

        Returns:
            ``go`` with a session unit reserved (pair it with :meth:`done`), or a put-back
            delay and reason; for a dead site (RFC 5321 §4.5.4.1) the ``451 4.4.1 … down
            until …`` reply and the end of its cool-off. When the bucket is unreachable
            the item is admitted (limits are best effort against an outage of NATS, which
            stops the queue anyway)."""
        site_name = await self.site_for(domain)
        site = self._site(site_name)
        if self._capped(site):  # the rest of the worker is for other sites
            return self._defer(site, "capped", self._full_delay(site))
        site.admitting += 1
        try:
            return await self._admit(site)
        except StoreUnavailable as e:
            log.warning("site %s: limits unavailable (%s); delivering unlimited", site_name, e)
            site.active += 1
            site.unlimited += 1
            return Admission(site_name, True)
        finally:
            site.admitting -= 1

    def _capped(self, site: SiteView) -> bool:
        """This worker has ``max_per_site`` deliveries of ``site`` under way or being
        admitted (waiting for a unit included)."""
        cap = self.max_per_site
        return cap is not None and site.active + site.admitting >= cap

    async def _admit(self, site: SiteView) -> Admission:
        s = self.settings
        state = await self.shared.state(site)
        now = self.clock()
        st = limits.status(state, now)
        if st is SiteStatus.DOWN and state.down_until is not None:
            until = datetime.fromtimestamp(state.down_until, UTC)
            spread = min(s.cool_off_s / 4, 30.0)
            delay = state.down_until - now + self.rng.uniform(0, spread)
            return self._defer(site, "down", delay, site_down_reply(site.name, until))
        probe = False
        if st is SiteStatus.PROBE:
            if not await self.shared.take_probe(site):
                return self._defer(site, "probing", self._jitter(min(PROBE_WAIT_S, s.cool_off_s)))
            probe = True
            # the copy may predate a probe that just failed elsewhere: read it again
            state = await self.shared.state(site, fresh=True)
            if limits.status(state, self.clock()) is SiteStatus.DOWN:
                await self.shared.drop_probe(site, probe)
                return await self._admit(site)
        limit = s.sessions_of(site.name)
        allowed = limits.allowed_sessions(state, limit, now, s.throttle_grow_s)
        share = limits.fair_share(allowed, state, self.owner, now)
        if len(site.slots) > share:
            await self._trim(site, share)
        if not await self._unit(site, allowed, share):
            await self.shared.drop_probe(site, probe)
            await self.shared.want(site)
            return self._defer(site, "full", self._full_delay(site))
        idle, _ = self.idle_sessions(site.name)
        checks: list[tuple[str, Rate | None]] = [("msg", s.message_rate_of(site.name))]
        if idle == 0:  # this delivery opens a session
            checks.insert(0, ("conn", s.connection_rate_of(site.name)))
        for kind, rate in checks:
            try:
                wait = 0.0 if rate is None else await self.shared.take_rate(site, kind, rate)
            except BaseException:  # the unit goes back (the caller may admit unlimited)
                self._free(site)
                raise
            if wait > 0:
                self._free(site)
                await self.shared.drop_probe(site, probe)
                return self._defer(site, "rate", wait + self.rng.uniform(0, max(1.0, wait)))
            if kind == "conn" and rate is not None:
                site.conn_paid += 1  # the session this delivery opens is paid for
        return Admission(site.name, True, probe=probe, at=asyncio.get_running_loop().time())

    def _full_delay(self, site: SiteView) -> float:
        """Put-back delay of an item of a full site: paced by the site's turnover here
        (:func:`jsqueue.limits.full_put_back`), at most ``full_delay_s``, jittered by
        up to a tenth."""
        now = asyncio.get_running_loop().time()
        allowed, _ = self._limits(site)
        site.paced_until = limits.full_put_back(
            now, site.paced_until, site.waiters, site.hold_s, allowed, self.settings.full_delay_s
        )
        return self._jitter(site.paced_until - now, spread=0.1)

    def full(self, domain: str) -> bool:
        """Whether :meth:`early` would refuse mail for ``domain`` now: this worker has
        ``max_per_site`` deliveries of its site, or the site was found full moments ago (a
        scan within :data:`FULL_MEMO_S`), no unit of this worker is free and its waiters
        are as many as it keeps. Synchronous, no I/O, no side
        effect: the worker asks it before it reads a fetched batch's entries."""
        site = self._sites.get(self.site_known(domain))
        if site is not None and self._capped(site):
            return True
        if site is None or asyncio.get_running_loop().time() >= site.full_until:
            return False
        allowed, share = self._limits(site)
        return not self._has_unit(site, allowed) and site.waiters >= self._max_waiters(site, share)

    def early(self, domain: str) -> Admission | None:
        """A refusal known without a round trip (no entry read, no bucket access), when
        :meth:`full`: the put-back is paced (:meth:`_full_delay`) and counted. None when
        :meth:`admit` must decide. Synchronous and cheap: called for every item."""
        if not self.full(domain):
            return None
        site = self._site(self.site_known(domain))
        reason = "capped" if self._capped(site) else "full"
        return self._defer(site, reason, self._full_delay(site))

    def _limits(self, site: SiteView) -> tuple[int, int]:
        """(sessions allowed, this worker's fair share of them) by the state last read."""
        s, now = self.settings, self.clock()
        allowed = limits.allowed_sessions(
            site.state, s.sessions_of(site.name), now, s.throttle_grow_s
        )
        return allowed, limits.fair_share(allowed, site.state, self.owner, now)

    @staticmethod
    def _max_waiters(site: SiteView, share: int) -> int:
        """Deliveries that may wait for a unit of ``site`` here: as many as the slots held,
        or the fair share when more (the slots this worker may still get); at least 1."""
        return max(1, len(site.slots), share)

    def _defer(
        self, site: SiteView, reason: str, delay_s: float, reply: Reply | None = None
    ) -> Admission:
        site.deferred[reason] = site.deferred.get(reason, 0) + 1
        return Admission(site.name, False, max(0.05, delay_s), reason, reply)

    async def _unit(self, site: SiteView, allowed: int, share: int) -> bool:
        """Reserve a session unit: a slot this worker holds and no session of its own
        uses, else a new slot. Wait up to ``slot_wait_s`` (while this site's waiters here
        are fewer than :meth:`_max_waiters`) for one of ours to free, and, while this
        worker holds less than its fair share, for a slot another worker gives up (looked
        for every :data:`FULL_MEMO_S`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.slot_wait_s
        while True:
            if self._has_unit(site, allowed) or await self._take_slot(site, allowed):
                site.active += 1
                return True
            remaining = deadline - loop.time()
            if remaining <= 0 or site.waiters >= self._max_waiters(site, share):
                return False
            if len(site.slots) < min(share, allowed):  # others hold what we may have
                await self.shared.want(site)
                remaining = min(remaining, max(0.01, site.full_until - loop.time()))
            await site.wait_turn(remaining)

    def _needed(self, site: SiteView) -> int:
        """Units this worker's own sessions of ``site`` use: deliveries under way, plus idle
        sessions its connection cache keeps and those being closed."""
        idle, closing = self.idle_sessions(site.name)
        return site.active + idle + closing

    def _has_unit(self, site: SiteView, allowed: int) -> bool:
        usable = sum(1 for n in site.slots if n < allowed)
        idle, closing = self.idle_sessions(site.name)
        # a new delivery reuses an idle session when there is one, else opens its own
        return usable >= site.active + max(idle, 1) + closing

    async def _take_slot(self, site: SiteView, allowed: int) -> bool:
        loop = asyncio.get_running_loop()
        if loop.time() < site.full_until:
            return False
        async with site.scan:  # the waiters of a site scan one after another, not at once
            return loop.time() >= site.full_until and await self._scan(site, allowed)

    async def _scan(self, site: SiteView, allowed: int) -> bool:
        """Take a slot this worker does not hold: create one number at random (one request
        uncontended); when taken, read them all in one request and compare-and-set each
        free one (absent, expired, a delete marker) until one holds (one by one, 4 workers
        sharing 80 slots made 4.5 requests per message)."""
        free = [n for n in range(allowed) if n not in site.slots]
        self.rng.shuffle(free)
        keys = {slot_key(site.name, n): n for n in free}
        revisions = dict.fromkeys(list(keys)[:1], 0)  # the first number, as if absent
        for contended in (False, True) if keys else ():
            if contended:
                reads = await self.store.get_many(list(keys))
                revisions = {k: r.revision for k, r in reads.items() if r.value is None}
            for key, revision in revisions.items():
                value: dict[str, object] = {"owner": self.owner, "at": self.clock()}
                rev = await self.store.put(
                    key, value, revision=revision, ttl_s=self.settings.slot_ttl_s
                )
                if rev is not None:
                    site.slots[keys[key]] = rev
                    return True
        site.full_until = asyncio.get_running_loop().time() + FULL_MEMO_S
        return False

    def session_reused(self, site_name: str) -> None:
        """An idle session of ``site_name`` was taken for reuse: a waiting delivery looks
        again when that frees a unit (an admitted delivery counts apart from the idle
        session it is to take until it takes it). Synchronous; never raises."""
        site = self._sites.get(site_name)
        if site is not None and site.waiters and self._has_unit(site, self._limits(site)[0]):
            site.wake()

    def session_closed(self, site_name: str) -> None:
        """A session of ``site_name`` being closed is gone: a waiting delivery looks again,
        unless this worker is over its fair share (it closed the session to give its slot
        to a worker that wants the site). Synchronous; never raises."""
        site = self._sites.get(site_name)
        if site is not None and site.waiters and len(site.slots) <= self._limits(site)[1]:
            site.wake()

    async def connecting(self, site_name: str) -> None:
        """Before a new session to ``site_name``: wait until this worker's sessions of the
        site, the new one counted, fit in its slots (an admission counts on an idle session
        the delivery may not use: docs/architecture.md, "A new session waits for room").
        Takes a free slot, else closes idle sessions and waits for a unit, at most
        ``slot_wait_s`` + :data:`CONNECT_WAIT_S` seconds; then, or when the bucket is
        unreachable, it connects and logs it. Then takes a token of the site's
        ``connection_rate`` unless its admission did (:meth:`_connection_token`). Never
        raises but for cancellation."""
        site = self._sites.get(site_name)
        if site is None or site.active == 0 or site.unlimited:
            return
        await self._room(site)
        await self._connection_token(site)

    async def _connection_token(self, site: SiteView) -> None:
        """A token of the site's connection rate for a new session: one its admission took
        (it counted on no idle session), else one taken now, waiting for it at most
        ``slot_wait_s`` + :data:`CONNECT_WAIT_S` seconds (then, or when the bucket is
        unreachable, the session opens and it is logged). An admission that counted on an
        idle session takes none, so the token of a session opened beside it is taken here."""
        rate = self.settings.connection_rate_of(site.name)
        if rate is None:
            return
        if site.conn_paid > 0:
            site.conn_paid -= 1
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.slot_wait_s + CONNECT_WAIT_S
        while True:
            try:
                wait = await self.shared.take_rate(site, "conn", rate)
            except StoreUnavailable as e:
                log.warning("site %s: a session opens without a connection token: %s", site.name, e)
                return
            remaining = deadline - loop.time()
            if wait <= 0:
                return
            if remaining <= 0:
                log.warning("site %s: a session opens over its connection rate", site.name)
                return
            await asyncio.sleep(min(wait, remaining))

    async def _room(self, site: SiteView) -> None:
        """:meth:`connecting`'s wait until the new session fits in the slots held."""
        site_name = site.name
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.slot_wait_s + CONNECT_WAIT_S
        while True:  # (the slots held: a limit lowered since admitted no one waits for)
            allowed, held = self._limits(site)[0], len(site.slots)
            idle, closing = self.idle_sessions(site_name)
            try:
                if site.active + idle + closing <= held or await self._take_slot(site, allowed):
                    return
            except StoreUnavailable as e:
                log.warning("site %s: a session over the %d held opens: %s", site_name, held, e)
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("site %s: a session over the %d held opens anyway", site_name, held)
                return
            if (over := min(idle, site.active + idle - held)) > 0:  # closing ones go anyway
                self.shed_sessions(site_name, over)
            await site.wait_turn(min(remaining, FULL_MEMO_S))

    def _free(self, site: SiteView) -> None:
        site.active = max(0, site.active - 1)
        site.conn_paid = min(site.conn_paid, site.active)  # (paid, then a session reused)
        site.wake()

    async def done(self, admission: Admission, attempt: Attempt | None) -> None:
        """The attempt admitted by ``admission`` ended (``attempt`` None: it did not run).

        Feeds back what came back: a throttle reply (:func:`jsqueue.limits.is_throttle`,
        RFC 5321 §4.2.2 421) halves the site's sessions for ``throttle_hold_s``; a
        connection-level failure counts towards ``dead_after`` and a site that reaches it
        is down for ``cool_off_s`` (RFC 5321 §4.5.4.1; event ``site_down``); a session that
        got an answer clears the count (event ``site_up`` when the site was down). Slots no
        session of this worker needs any more are kept until the next :meth:`renew` (every
        ``slot_ttl_s / 3``), not released here: the next delivery mostly needs one again,
        and a release per message cost two KV writes per message (``bench/README.md``,
        Destinations). Never raises."""
        if not admission.go:
            return
        site = self._site(admission.site)
        self._free(site)
        if admission.at == 0:  # admitted unlimited (the bucket was unreachable)
            site.unlimited = max(0, site.unlimited - 1)
        if attempt is not None and admission.at > 0:
            held = asyncio.get_running_loop().time() - admission.at
            site.hold_s += HOLD_WEIGHT * (held - site.hold_s)
        try:
            if attempt is not None:
                await self.shared.feedback(site, attempt)
        except StoreUnavailable as e:
            log.warning("site %s: could not record feedback: %s", site.name, e)
        finally:
            await self.shared.drop_probe(site, admission.probe)
            _, share = self._limits(site)
            if len(site.slots) > share:  # others want the site: give the surplus up
                await self._trim(site, share)

    async def _trim(self, site: SiteView, share: int | None = None) -> None:
        """Release slots no session of this worker needs (those at or over the allowed
        limit first); wake a waiter when one is left over. With ``share`` (others want
        the site), keep at most that many: idle sessions over it are closed first (their
        slots go at a later trim, once their QUIT completed), and waiters do not count."""
        needed = self._needed(site) + site.waiters
        if share is not None:
            in_use = self._needed(site)
            idle, closing = self.idle_sessions(site.name)
            shed = min(idle, in_use - closing - share)  # (those closing go anyway)
            if shed > 0:
                self.shed_sessions(site.name, shed)
            needed = max(min(needed, share), in_use)
        for n in sorted(site.slots)[needed:]:  # the lowest numbers are kept
            rev = site.slots.pop(n, None)
            if rev is not None:  # (else another task of ours released it meanwhile)
                await self._release(slot_key(site.name, n), rev)
        if site.waiters:
            site.wake()

    async def renew(self) -> None:
        """Renew every slot held by compare-and-set (a lost one is dropped: it expired
        under a stall longer than ``slot_ttl_s``) and release those no session needs;
        forget a site unused for :data:`SITE_IDLE_S` that holds nothing and is not down (a
        down one stays, so ``jsqueue_destination_down`` reports it for its whole cool-off).
        Call every third of ``slot_ttl_s`` (:meth:`run` does)."""
        for site in list(self._sites.values()):
            for n, rev in list(site.slots.items()):
                key = slot_key(site.name, n)
                value: dict[str, object] = {"owner": self.owner, "at": self.clock()}
                try:
                    new = await self.store.put(
                        key, value, revision=rev, ttl_s=self.settings.slot_ttl_s
                    )
                except StoreUnavailable as e:
                    log.warning("site %s: slot %d not renewed: %s", site.name, n, e)
                    continue
                if new is None:
                    log.warning("site %s: slot %d was lost (expired); dropped", site.name, n)
                    site.slots.pop(n, None)
                else:
                    site.slots[n] = new
            await self._trim(site)
            idle = asyncio.get_running_loop().time() - site.used_at > SITE_IDLE_S
            st = limits.status(site.state, self.clock())
            if (
                idle
                and st is not SiteStatus.DOWN
                and not (site.slots or site.active or site.admitting)
            ):
                self._sites.pop(site.name, None)  # (a down site stays: its metrics say so)

    async def rebalance(self) -> None:
        """Give up the slots over this worker's fair share of every site others want, also
        when no delivery reads the site's state (read at most every ``state_refresh_s``,
        for a site held with more than one slot); idle sessions over it are closed first.
        Called every :data:`FULL_MEMO_S` by :meth:`run`; never raises."""
        for site in list(self._sites.values()):
            if len(site.slots) > 1:
                try:
                    await self.shared.state(site)
                except StoreUnavailable:
                    continue
            _, share = self._limits(site)
            if len(site.slots) > share:
                await self._trim(site, share)

    async def run(self, stop: asyncio.Event) -> None:
        """Renew and trim slots (every third of ``slot_ttl_s``) and :meth:`rebalance`
        (every :data:`FULL_MEMO_S`) until ``stop`` is set, then release every slot."""
        loop = asyncio.get_running_loop()
        interval = max(0.5, self.settings.slot_ttl_s / 3)
        renew_at = loop.time() + interval
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), FULL_MEMO_S)
                if loop.time() >= renew_at:
                    renew_at = loop.time() + interval
                    await self.renew()
                else:
                    await self.rebalance()
        finally:
            await self.close()

    async def close(self) -> None:
        """Release every slot and probe held, all at once (with NATS down each one waits out
        its request timeout: one after another they held up a stop for minutes; what is not
        released expires within ``slot_ttl_s``). Idempotent; never raises."""
        releases = []
        for site in list(self._sites.values()):
            releases += [self._release(slot_key(site.name, n), r) for n, r in site.slots.items()]
            site.slots.clear()
            releases.append(self.shared.drop_probe(site, True))
        await asyncio.gather(*releases)

    async def _release(self, key: str, revision: int) -> None:
        with contextlib.suppress(StoreUnavailable):  # the key expires by its TTL
            await self.store.delete(key, revision=revision)

    def snapshot(self) -> list[SiteSnapshot]:
        """What this worker holds and knows per site (for metrics)."""
        s = self.settings
        now = self.clock()
        out = []
        for site in self._sites.values():
            limit = s.sessions_of(site.name)
            out.append(
                SiteSnapshot(
                    site.name,
                    len(site.slots),
                    site.active,
                    limit,
                    limits.allowed_sessions(site.state, limit, now, s.throttle_grow_s),
                    limits.status(site.state, now),
                    dict(site.deferred),
                )
            )
        return out
