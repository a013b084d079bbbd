"""The worker's SMTP :class:`~jsqueue.delivery.base.Deliverer`: MX lookup plus one SMTP
attempt per destination domain, with the outbound sessions kept between deliveries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from jsqueue.config import WorkerSettings
from jsqueue.delivery.base import Attempt, BodySource, DeliveryEnvelope
from jsqueue.delivery.client import deliver_domain
from jsqueue.delivery.connections import ConnectionCache
from jsqueue.delivery.dkim import DkimSigner
from jsqueue.delivery.policy.decision import PolicyEngine
from jsqueue.delivery.resolver import Resolver
from jsqueue.envelope import Entry, Recipient

__all__ = ["SmtpDeliverer"]


async def _nothing(site: str) -> None:
    """No destination limits: a new session needs no room made."""


class SmtpDeliverer:
    """Delivers over SMTP: resolves the domain, tries its targets (RFC 5321 §5.1).

    Sessions kept idle between deliveries are cached per *site* (``site_of``), so that
    :meth:`idle_sessions` can tell the destination limits how many connections to a site
    stay open after their deliveries ended (each holds a session slot,
    :mod:`jsqueue.destinations`).

    Args:
        resolver: MX (or smarthost) resolution.
        settings: the ``worker`` settings section (timeouts, TLS policy, port, connection
            cache lifetimes in seconds, DKIM keys).
        engine: decides each MX's TLS policy (DANE, MTA-STS; RFC 7672, RFC 8461); the
            configured ``worker.tls`` alone when None.
        site_of: destination domain -> site name; every domain is its own site when None.

    Raises:
        ConfigError: a ``worker.dkim`` key cannot be used (one line naming the setting).
    """

    def __init__(
        self,
        resolver: Resolver,
        settings: WorkerSettings,
        engine: PolicyEngine | None = None,
        site_of: Callable[[str], str] | None = None,
    ) -> None:
        self.resolver = resolver
        self.settings = settings
        self.engine = engine
        self.site_of = site_of or (lambda domain: domain)
        self._caches: dict[str, ConnectionCache] = {}
        #: deliveries under way per site: their sessions go back into the site's cache
        self._delivering: Counter[str] = Counter()
        self.signer = DkimSigner.from_settings(settings.dkim)
        #: site -> None, called when an idle session of the site is taken for reuse (set
        #: by the composition to the destination limits', which count idle sessions).
        self.session_reused: Callable[[str], None] = lambda site: None
        #: site -> None, called when an idle session of the site being closed is gone.
        self.session_closed: Callable[[str], None] = lambda site: None
        #: site -> awaitable, awaited before a new session to the site is opened (set to
        #: the destination limits', which make room for it among the slots held).
        self.opening: Callable[[str], Awaitable[None]] = _nothing

    def _cache(self, site: str) -> ConnectionCache:
        cache = self._caches.get(site)
        if cache is None:
            if len(self._caches) > 4 * self.settings.concurrency:  # forget unused sites
                for name in [n for n, c in self._caches.items() if self._unused(n, c)]:
                    del self._caches[name]
            cache = self._caches[site] = ConnectionCache(
                idle_s=self.settings.connection_cache_s,
                max_age_s=self.settings.connection_reuse_s,
                max_idle=self.settings.concurrency,
                on_take=lambda: self.session_reused(site),
                on_closed=lambda: self.session_closed(site),
                on_connect=lambda: self.opening(site),
            )
        return cache

    def _unused(self, site: str, cache: ConnectionCache) -> bool:
        """Whether ``site``'s cache holds no session, idle, closing or out with a delivery
        under way (that one comes back into this cache object: a forgotten cache would
        keep it uncounted by the destination limits, never shed nor QUIT)."""
        return not cache.idle and not cache.closing and not self._delivering[site]

    def idle_sessions(self, site: str) -> tuple[int, int]:
        """(sessions kept idle for reuse, idle sessions being closed with QUIT) of ``site``."""
        cache = self._caches.get(site)
        return (0, 0) if cache is None else (cache.idle, cache.closing)

    def shed_idle(self, site: str, n: int) -> None:
        """QUIT up to ``n`` idle sessions of ``site`` in the background (they count as
        being closed until it completes): the destination limits give their slots to
        other workers."""
        cache = self._caches.get(site)
        if cache is not None:
            cache.shed(n)

    async def deliver(
        self, entry: Entry, domain: str, recipients: Sequence[Recipient], body: BodySource
    ) -> Attempt:
        """One attempt for ``recipients`` of ``domain``; see
        :meth:`jsqueue.delivery.base.Deliverer.deliver`.

        Returns:
            a reply per recipient address and the host tried. Never raises for remote or
            DNS trouble (they come back as 4yz/5yz replies). Not idempotent: each call may
            send the message.
        """
        # The worker passes the recipients it claimed: the same as the entry's open ones.
        envelope = replace(DeliveryEnvelope.from_entry(entry, domain), recipients=tuple(recipients))
        site = self.site_of(domain)
        self._delivering[site] += 1
        try:
            result = await deliver_domain(
                self.resolver,
                envelope,
                body,
                self.settings,
                self._cache(site),
                engine=self.engine,
                signer=self.signer,
            )
        finally:
            self._delivering[site] -= 1
            if not self._delivering[site]:
                del self._delivering[site]
        return Attempt(
            result.replies,
            result.tried_host,
            result.uncertain,
            dkim=result.dkim,
            reached=result.mx_host,
            next_hop_dsn=result.dsn_accepted,
        )

    async def close(self) -> None:
        """QUIT the cached sessions, stop the signing thread. Idempotent."""
        for cache in list(self._caches.values()):
            await cache.close()
        self.signer.close()
