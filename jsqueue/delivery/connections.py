"""Outbound SMTP connections kept open between deliveries to the same target
(:class:`ConnectionCache`, RFC 5321 §4.1.1.4), and the bounded QUIT that ends the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import aiosmtplib

from jsqueue.config import TlsPolicy
from jsqueue.errors import reason
from jsqueue.replies import TlsNote

__all__ = ["QUIT_TIMEOUT_S", "CacheKey", "ConnectionCache", "IdleSession", "quit_smtp"]

log = logging.getLogger(__name__)

QUIT_TIMEOUT_S = 5.0
"""Longest wait for the reply to QUIT, seconds."""


async def quit_smtp(smtp: aiosmtplib.SMTP, where: str) -> None:
    """QUIT (RFC 5321 §4.1.1.10, the reply awaited at most :data:`QUIT_TIMEOUT_S` seconds)
    and close; ``where`` names the peer in the debug line of a failed QUIT. Never raises;
    idempotent (a closed session is only closed again)."""
    try:
        if smtp.is_connected:
            await smtp.execute_command(b"QUIT", timeout=QUIT_TIMEOUT_S)
    except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as e:
        log.debug("%s: QUIT failed: %s", where, reason(e))
    finally:
        smtp.close()


class CacheKey(NamedTuple):
    """What a cached session must match to be reused: the same MX host name (the name
    in replies, SNI and certificate checks), address and port, the same hop kind (relay
    sessions are authenticated) and the same TLS policy and fallback state; ``plan`` is
    the published policy that decided it (``dane``, ``mta-sts enforce`` ...; ``""`` for
    the configured one), so a session checked under one is not reused under another."""

    host: str
    address: str
    port: int
    relay: bool
    policy: TlsPolicy
    allow_tls: bool
    plan: str = ""


@dataclass
class IdleSession:
    """A connected session between transactions, as the cache keeps it."""

    smtp: aiosmtplib.SMTP
    extensions: dict[str, str]
    tls: bool
    tls_version: str | None
    opened_at: float
    timer: asyncio.TimerHandle | None = None
    #: the TLS policy note of the session when it was opened (a reuse repeats it)
    tls_note: TlsNote | None = None


class ConnectionCache:
    """Outbound SMTP sessions kept open between deliveries to the same target.

    A session whose transaction completed (the reply to the final ``.`` was read, and it
    was not 421) is kept idle for ``idle_s`` seconds instead of being closed with QUIT; the
    next delivery to the same target (MX host name, address, port, TLS policy) within that
    time starts at MAIL, without TCP connect, greeting, EHLO, STARTTLS or AUTH (RFC 5321
    §4.1.1.4: the end of mail data resets the server's transaction state). A session is
    not reused once ``max_age_s`` seconds passed since its connect. The roles of Postfix's
    ``smtp_connection_cache_time_limit`` and ``smtp_connection_reuse_time_limit``.

    Idle sessions past ``idle_s`` get QUIT in the background; :meth:`close` QUITs every
    idle session and waits for that. Not thread-safe (one event loop).

    Args:
        idle_s: seconds an idle session is kept; 0 keeps none (every session ends in QUIT).
        max_age_s: seconds from connect after which a session is no longer reused.
        max_idle: idle sessions kept per target at most (more are closed).
        on_take: called when an idle session is taken for reuse (the destination limits
            count an admitted delivery until then; one waiting for a unit looks again).
        on_closed: called when the QUIT of an idle session being closed has ended.
        on_connect: awaited before a new session to the cache's site is opened
            (:meth:`opening`): the destination limits make room for it.
    """

    def __init__(
        self,
        idle_s: float = 2.0,
        max_age_s: float = 300.0,
        max_idle: int = 20,
        on_take: Callable[[], None] | None = None,
        on_closed: Callable[[], None] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_idle = max_idle
        self.on_take = on_take
        self.on_closed = on_closed
        self.on_connect = on_connect
        self._idle: dict[CacheKey, list[IdleSession]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        """Idle sessions held right now."""
        return sum(len(v) for v in self._idle.values())

    @property
    def closing(self) -> int:
        """Idle sessions whose QUIT is under way (still connected, until it completes)."""
        return len(self._closing)

    def take(self, key: CacheKey) -> IdleSession | None:
        """The most recently used idle session for ``key`` still fit for reuse (connected,
        younger than ``max_age_s`` seconds), or None; unfit ones found on the way are
        QUIT in the background. The session taken is the caller's until :meth:`put`."""
        pool = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        found: IdleSession | None = None
        while pool and found is None:
            idle = pool.pop()
            if idle.timer is not None:
                idle.timer.cancel()
            if now - idle.opened_at < self.max_age_s and idle.smtp.is_connected:
                found = idle
            else:
                self._close(key, idle)
        if pool is not None and not pool:
            del self._idle[key]  # no empty pool per target ever seen
        if found is not None and self.on_take is not None:
            self.on_take()
        return found

    def put(self, key: CacheKey, idle: IdleSession) -> bool:
        """Keep ``idle`` for reuse for ``idle_s`` seconds (then QUIT in the background).

        Returns:
            True when kept; False (and nothing kept: the caller QUITs it) when the cache is
            closed or disabled, the target has ``max_idle`` idle sessions already, or the
            session is older than ``max_age_s``.
        """
        loop = asyncio.get_running_loop()
        if (
            self._closed
            or self.idle_s <= 0
            or len(self._idle.get(key, ())) >= self.max_idle
            or loop.time() - idle.opened_at >= self.max_age_s
        ):
            return False
        idle.timer = loop.call_later(self.idle_s, self._expire, key, idle)
        self._idle.setdefault(key, []).append(idle)
        return True

    def shed(self, n: int) -> int:
        """QUIT up to ``n`` idle sessions in the background, those idle longest first.

        Returns:
            how many were closed (they count in :attr:`closing` until their QUIT ends).
        """
        idle = sorted(
            (
                (s.timer.when() if s.timer else 0.0, key, s)
                for key, pool in self._idle.items()
                for s in pool
            ),
            key=lambda t: t[0],
        )
        for _, key, session in idle[: max(0, n)]:
            if session.timer is not None:
                session.timer.cancel()
            self._expire(key, session)
        return min(len(idle), max(0, n))

    def _expire(self, key: CacheKey, idle: IdleSession) -> None:
        pool = self._idle.get(key)
        if pool is not None and idle in pool:
            pool.remove(idle)
            if not pool:
                del self._idle[key]
            self._close(key, idle)

    async def opening(self) -> None:
        """Before a new session (not one taken from here) is opened: awaits ``on_connect``.
        Raises what it raises (cancellation)."""
        if self.on_connect is not None:
            await self.on_connect()

    def _close(self, key: CacheKey, idle: IdleSession) -> None:
        task = asyncio.get_running_loop().create_task(
            quit_smtp(idle.smtp, f"{key.host} [{key.address}] (idle)")
        )
        self._closing.add(task)
        task.add_done_callback(self._quit_ended)

    def _quit_ended(self, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        if self.on_closed is not None:
            self.on_closed()

    async def close(self) -> None:
        """QUIT every idle session and keep no more. Idempotent."""
        self._closed = True
        for key, pool in list(self._idle.items()):
            for idle in pool:
                if idle.timer is not None:
                    idle.timer.cancel()
                self._close(key, idle)
        self._idle.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def abort_connection(smtp: aiosmtplib.SMTP | None) -> None:
    """Drop the connection at once, without the DATA terminator or QUIT: the server discards
    a message whose final dot it never got (RFC 5321 §4.1.1.4). Idempotent; never raises."""
    if smtp is None:
        return
    transport = smtp.transport
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()
    smtp.close()
