"""The listening SMTP front end: one :class:`InboundSession` per connection, admission
(``max_sessions``), TLS and AUTH settings loaded once, and the graceful drain on shutdown.

Use :func:`serve_smtp`, or ``async with SmtpServer(settings, stores):``. What a session does
with each connection is :mod:`jsqueue.frontend.session`; how a message becomes durable is
:mod:`jsqueue.frontend.ingest`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from jsqueue.config import SmtpSettings
from jsqueue.errors import ConfigError, listen_error
from jsqueue.events import NULL_OBSERVER, Observer
from jsqueue.frontend.auth import UserDB
from jsqueue.frontend.ingest import Ingest
from jsqueue.frontend.session import InboundSession
from jsqueue.frontend.transaction import IPAddress
from jsqueue.store.base import Stores

log = logging.getLogger(__name__)


def server_tls_context(settings: SmtpSettings) -> ssl.SSLContext | None:
    """The STARTTLS context (RFC 3207) from ``tls_cert``/``tls_key`` (TLS 1.2 or later).

    Returns:
        the server context, or None when neither setting is set.

    Raises:
        ConfigError: only one of the two is set, or they cannot be loaded.
    """
    if settings.tls_cert is None and settings.tls_key is None:
        return None
    if settings.tls_cert is None or settings.tls_key is None:
        raise ConfigError("smtp.tls_cert and smtp.tls_key must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"smtp.tls_cert/smtp.tls_key: {e}") from None
    return ctx


class SmtpServer:
    """The listening front end: one :class:`InboundSession` per connection on this loop.

    Attributes:
        settings: the ``smtp`` settings section.
        stores: where messages go.
        tls_context: the STARTTLS context, None without TLS settings.
        users: the AUTH users, None without ``auth_file`` (AUTH is then not offered).
        ingest: the ingest path shared by all sessions.
        draining: :meth:`close` was called; new sessions are refused.
    """

    def __init__(
        self,
        settings: SmtpSettings,
        stores: Stores,
        observer: Observer = NULL_OBSERVER,
        *,
        on_reject: Callable[[int], None] | None = None,
    ) -> None:
        """Args:
        settings: the ``smtp`` settings section.
        stores: where messages go (JetStream or memory).
        observer: receives a ``received`` event per message queued (jsqueue.events).
        on_reject: called with the reply code of every 4yz/5yz reply a session sends
            (the ``jsqueue_smtp_rejections_total`` counter); must not raise.

        Raises:
            ConfigError: unusable TLS files, ``require_tls`` without them, or a bad auth file.
        """
        self.settings = settings
        self.stores = stores
        self.tls_context = server_tls_context(settings)
        if settings.require_tls and self.tls_context is None:
            raise ConfigError("smtp.require_tls needs smtp.tls_cert and smtp.tls_key")
        self.users = UserDB.load(settings.auth_file) if settings.auth_file else None
        self.ingest = Ingest(settings, stores, observer)
        self.on_reject = on_reject
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sessions: dict[InboundSession, IPAddress | None] = {}  # -> the client's address
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        self._tasks: set[asyncio.Task[None]] = set()
        if stores.ingest is None and settings.dedupe_window_s > 0:
            log.warning("the store has no ingest log: resent messages are queued again")

    @property
    def active_sessions(self) -> int:
        """Connections currently admitted (refused ones are not counted)."""
        return len(self._sessions)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the first listening socket; the real port when configured as 0.

        Raises:
            RuntimeError: not started.
        """
        if self._server is None or not self._server.sockets:
            raise RuntimeError("SMTP server not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        """The listening port (see :attr:`address`).

        Raises:
            RuntimeError: not started.
        """
        return self.address[1]

    def admit(self, session: InboundSession, ip: IPAddress | None) -> bool:
        """Count ``session`` of the client at ``ip`` in, unless draining, ``max_sessions``
        are open, or ``max_sessions_per_client`` of that client (outside
        ``relay_networks``, as Postfix's smtpd_client_connection_count_limit, 50, exempts
        $mynetworks) are: then the session answers ``421 4.7.0`` and closes. Called by
        the session on connect."""
        if self.draining or len(self._sessions) >= self.settings.max_sessions:
            return False
        if self._over_client_limit(ip):
            return False
        self._sessions[session] = ip
        self._all_closed.clear()
        return True

    def _over_client_limit(self, ip: IPAddress | None) -> bool:
        """``ip``, outside ``relay_networks``, has ``max_sessions_per_client`` open (counted
        over the sessions held: at most ``max_sessions``)."""
        limit = self.settings.max_sessions_per_client
        if not limit or ip is None or any(ip in net for net in self.settings.relay_networks):
            return False
        open_ = sum(1 for other in self._sessions.values() if other == ip)
        if open_ >= limit:
            log.info("client %s: %d sessions open; one more refused", ip, open_)
        return open_ >= limit

    def release(self, session: InboundSession) -> None:
        """Count ``session`` out (its connection ended). Idempotent."""
        self._sessions.pop(session, None)
        if not self._sessions:
            self._all_closed.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a cleanup in the background; :meth:`stop` waits for it. Returns its task."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def start(self) -> None:
        """Listen on ``settings.host:settings.port``.

        Raises:
            ListenError: the address cannot be bound (names ``smtp.host``/``smtp.port``).
            listen_error: the ListenError above, as built by
                :func:`~jsqueue.errors.listen_error`.
        """
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: InboundSession(self),
                host=self.settings.host,
                port=self.settings.port,
                reuse_address=True,
            )
        except OSError as e:
            raise listen_error("smtp", self.settings.host, self.settings.port, e) from e
        log.info("SMTP front end listening on %s:%d", *self.address)

    def close(self) -> None:
        """Begin shutting down: stop listening, refuse new sessions, close idle sessions with
        ``421 4.3.2`` (RFC 5321 §3.8); a session in DATA gets its reply first, then 421.
        Idempotent."""
        if self._server is None or self.draining:
            return
        self.draining = True
        self._server.close()
        for session in list(self._sessions):
            session.begin_shutdown()

    async def wait_closed(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s`` seconds) for every session to end, then drop the rest
        and wait for background cleanups. Call :meth:`close` first. Idempotent."""
        if self._server is None:
            return
        with contextlib.suppress(TimeoutError):  # the bound is reached: abort the rest below
            async with asyncio.timeout(timeout_s):
                await self._all_closed.wait()
        for session in list(self._sessions):
            session.abort()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        await self._server.wait_closed()
        self._server = None

    async def stop(self, timeout_s: float = 10.0) -> None:
        """:meth:`close`, then :meth:`wait_closed` (graceful drain bounded by ``timeout_s``
        seconds). Idempotent."""
        self.close()
        await self.wait_closed(timeout_s)

    async def __aenter__(self) -> SmtpServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve_smtp(
    settings: SmtpSettings,
    stores: Stores,
    observer: Observer = NULL_OBSERVER,
    *,
    on_reject: Callable[[int], None] | None = None,
) -> SmtpServer:
    """Start the SMTP front end on the running event loop.

    Args:
        settings: the ``smtp`` settings section (listen address, limits, TLS, AUTH, relay
            networks, dedupe window, store timeout).
        stores: body store, entry store, scheduler and (optionally) ingest log.
        observer: receives a ``received`` event per message queued.
        on_reject: called with the code of every 4yz/5yz reply sent (metrics).

    Returns:
        the started server; ``await server.stop()`` to shut it down.

    Raises:
        ConfigError: bad TLS or auth file settings.
        ListenError: the listen address cannot be bound.
    """
    server = SmtpServer(settings, stores, observer, on_reject=on_reject)
    await server.start()
    return server
