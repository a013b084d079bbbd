"""Composition: wire settings, NATS, stores, front end and worker into running services.

Thin by design (STYLE.md): everything here only builds objects from settings and runs them
until a stop event is set (SIGTERM/SIGINT in the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from jsqueue.bounce import DsnNotifier
from jsqueue.config import Settings, WorkerSettings
from jsqueue.delivery import (
    BodySource,
    ConnectionCache,
    DeliveryEnvelope,
    Resolver,
    deliver_domain,
)
from jsqueue.delivery import resolver_from_settings as _resolver_from_settings
from jsqueue.envelope import Entry, Recipient
from jsqueue.errors import JsqueueError
from jsqueue.events import NULL_OBSERVER, Observer
from jsqueue.frontend.server import serve_smtp
from jsqueue.health import telemetry
from jsqueue.nats_server import EmbeddedNats
from jsqueue.reconciler import open_reconciler
from jsqueue.retry import RetryPolicy
from jsqueue.store.base import Stores
from jsqueue.store.cache import CachedBodyStore
from jsqueue.store.jetstream import open_jetstream
from jsqueue.worker import Attempt, Worker
from jsqueue.worker import BodySource as WorkerBody

log = logging.getLogger("jsqueue")


class SmtpDeliverer:
    """The worker's :class:`~jsqueue.worker.Deliverer`: MX lookup plus one SMTP attempt.

    Args:
        resolver: MX (or smarthost) resolution.
        settings: the ``worker`` settings section (timeouts, TLS policy, port).
    """

    def __init__(self, resolver: Resolver, settings: WorkerSettings) -> None:
        self.resolver = resolver
        self.settings = settings
        self.connections = ConnectionCache(
            idle_s=settings.connection_cache_s,
            max_age_s=settings.connection_reuse_s,
            max_idle=settings.concurrency,
        )

    async def deliver(
        self, entry: Entry, domain: str, recipients: Sequence[Recipient], body: WorkerBody
    ) -> Attempt:
        """See :meth:`jsqueue.worker.Deliverer.deliver`."""
        envelope = DeliveryEnvelope(
            domain=domain,
            reverse_path=entry.reverse_path,
            recipients=tuple(recipients),
            smtputf8=entry.smtputf8,
            body_8bit=entry.body_8bit,
            envid=entry.envid,
            ret=entry.ret,
        )
        result = await deliver_domain(
            self.resolver,
            envelope,
            BodySource(open=body, size=entry.size),
            self.settings,
            self.connections,
        )
        return Attempt(result.replies, result.tried_host)

    async def close(self) -> None:
        """See :meth:`jsqueue.worker.Deliverer.close`: QUIT the cached sessions."""
        await self.connections.close()


def nats_urls(settings: Settings) -> list[str]:
    """Configured NATS URLs, else the local server on ``nats.port``."""
    return list(settings.nats.urls) or [f"nats://127.0.0.1:{settings.nats.port}"]


@contextlib.asynccontextmanager
async def embedded_nats(
    settings: Settings, on_exit: Callable[[], None] | None = None
) -> AsyncIterator[list[str]]:
    """Start the embedded nats-server unless NATS URLs are configured; yield the URLs.

    Args:
        settings: all settings (``nats.store_dir``, ``nats.port``, ``nats.config_file``).
        on_exit: called once if the server process dies while in use (checked every
            second), so the caller can shut down instead of running without its queue.

    Raises:
        JsqueueError: the binary is missing or the port is taken.
    """
    if settings.nats.urls:
        yield list(settings.nats.urls)
        return
    server = EmbeddedNats(
        settings.nats.store_dir, port=settings.nats.port, config_file=settings.nats.config_file
    )
    await server.start()
    log.info("embedded nats-server on %s (store %s)", server.url, settings.nats.store_dir)

    async def watch() -> None:
        pid = server.pid  # None once it has exited
        # The child is a Popen; polling it once a second is the cheapest watch.
        while server.running:  # noqa: ASYNC110
            await asyncio.sleep(1.0)
        log.error("embedded nats-server (pid %s) exited unexpectedly", pid)
        if on_exit is not None:
            on_exit()

    watcher = asyncio.create_task(watch())
    try:
        yield [server.url]
    finally:
        watcher.cancel()
        await server.stop()


def build_worker(
    settings: Settings,
    stores: Stores,
    resolver: Resolver | None = None,
    observer: Observer = NULL_OBSERVER,
) -> Worker:
    """A worker over ``stores`` with a bounded body cache, DSNs and the retry policies.

    Args:
        settings: all settings.
        stores: the queue's stores.
        resolver: MX resolution; from ``settings.worker`` when None.
        observer: receives the worker's events (events stream, metrics).
    """
    cached = replace(
        stores,
        bodies=CachedBodyStore(
            stores.bodies,
            settings.worker.body_cache_bytes,
            settings.worker.body_cache_dir,
        ),
    )
    policy = RetryPolicy.from_settings(settings.retry)
    return Worker(
        cached,
        SmtpDeliverer(resolver or _resolver_from_settings(settings.worker), settings.worker),
        DsnNotifier(cached, settings.dsn, policy),
        settings.worker,
        policy,
        RetryPolicy.from_settings(settings.retry, dsn=True),
        ack_wait_s=settings.nats.ack_wait_s,
        observer=observer,
    )


async def run_services(
    settings: Settings,
    stop: asyncio.Event,
    *,
    smtp: bool,
    worker: bool,
    embedded: bool,
) -> None:
    """Run the front end and/or a worker until ``stop`` is set, then shut down in order.

    Args:
        settings: all settings.
        stop: set to shut down (front end stops accepting, worker drains).
        smtp: run the SMTP front end.
        worker: run a delivery worker, and the reconciler (:mod:`jsqueue.reconciler`;
            one pass at a time cluster-wide) unless ``reconciler.enabled`` is false.
        embedded: start the embedded nats-server when no NATS URL is configured.

    Raises:
        StoreUnavailable: NATS unreachable at start.
        ConfigError, ProvisioningError, OSError (listen address taken).
    """
    nats_died = False

    def on_nats_exit() -> None:
        nonlocal nats_died
        if not stop.is_set():  # Ctrl-C reaches the child too; that is not a death
            nats_died = True
            stop.set()

    async with contextlib.AsyncExitStack() as stack:
        if embedded:
            urls = await stack.enter_async_context(embedded_nats(settings, on_nats_exit))
        else:
            urls = nats_urls(settings)
        stores = await open_jetstream(settings.nats, urls)
        stack.push_async_callback(stores.close)
        tel = await stack.enter_async_context(telemetry(settings, stores, urls))
        tasks: list[asyncio.Task[None]] = []
        owner = "-"
        if smtp:
            server = await serve_smtp(settings.smtp, stores, tel.observer)
            stack.push_async_callback(server.stop)
            tel.health.set("smtp", True)
        if worker:
            w = build_worker(settings, stores, observer=tel.observer)
            owner = w.owner
            tasks.append(asyncio.create_task(w.run(stop)))
            tel.health.set("worker", True)
        if worker and settings.reconciler.enabled:
            reconciler = await open_reconciler(settings, urls)
            stack.push_async_callback(reconciler.close)
            tasks.append(asyncio.create_task(reconciler.run(stop)))
        # The worker's name is the owner of its leases (``queue show``, ``queue flush``).
        log.info("jsqueue running (smtp=%s, worker=%s, lease owner=%s)", smtp, worker, owner)
        await stop.wait()
        log.info("jsqueue shutting down")
        tel.health.stopping()
        if tasks:
            await asyncio.gather(*tasks)
    if nats_died:
        raise JsqueueError("the embedded nats-server died; stopped (start again to recover)")
