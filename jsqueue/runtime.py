"""Composition, thin by design (STYLE.md): wires settings, NATS, stores, the front end, the
worker and the operators' queue operations into running services, and runs them until a
stop event is set (SIGTERM/SIGINT in the CLI); no delivery or queue logic lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from jsqueue import limits
from jsqueue.admin import Admin
from jsqueue.config import Settings
from jsqueue.delivery.deliverer import SmtpDeliverer
from jsqueue.delivery.dkim import load_keys
from jsqueue.delivery.policy.certs import check_ca_files
from jsqueue.delivery.policy.decision import PolicyEngine
from jsqueue.delivery.policy.reporting import TlsReporter, report_loop
from jsqueue.delivery.resolver import Resolver, resolver_from_settings
from jsqueue.delivery.signals import telling_names
from jsqueue.destination_metrics import DestinationCollector
from jsqueue.destinations import Destinations
from jsqueue.dsn.notifier import DsnNotifier
from jsqueue.errors import ConfigError, JsqueueError
from jsqueue.events import NULL_OBSERVER, Observer, open_publisher
from jsqueue.frontend.server import serve_smtp
from jsqueue.health import telemetry
from jsqueue.http.app import ApiMount
from jsqueue.http.inject import Injector
from jsqueue.nats_server import EmbeddedNats
from jsqueue.reconciler import open_reconciler
from jsqueue.retry import RetryPolicy
from jsqueue.store.base import Stores
from jsqueue.store.cache import CachedBodyStore
from jsqueue.store.jetstream import open_jetstream
from jsqueue.tasks import cancel_and_wait
from jsqueue.ui.app import DashboardMount
from jsqueue.ui.pages import destination_rows
from jsqueue.worker import Worker

log = logging.getLogger("jsqueue")


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
        ConfigError: ``nats.store_dir`` cannot be made or written (one line naming it).
    """
    if settings.nats.urls:
        yield list(settings.nats.urls)
        return
    server = EmbeddedNats(
        settings.nats.store_dir, port=settings.nats.port, config_file=settings.nats.config_file
    )
    try:
        await server.start()
    except OSError as e:  # the directory (or its log, its config) cannot be made or written
        raise ConfigError(f"nats.store_dir {settings.nats.store_dir}: {e.strerror or e}") from e
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
        await cancel_and_wait(watcher)
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

    Raises:
        ConfigError: ``worker.body_cache_dir`` cannot be made or used (one line naming it).
    """
    try:
        cache = CachedBodyStore(
            stores.bodies, settings.worker.body_cache_bytes, settings.worker.body_cache_dir
        )
    except OSError as e:
        where = settings.worker.body_cache_dir
        raise ConfigError(f"worker.body_cache_dir {where}: {e.strerror or e}") from e
    cached = replace(stores, bodies=cache)
    policy = RetryPolicy.from_settings(settings.retry)
    resolver = resolver or resolver_from_settings(settings.worker)
    sites = destination_limits(settings, stores, resolver, observer)
    # The front end's name is one of ours too: an MX pointing at it loops back.
    worker = settings.worker.model_copy(
        update={"own_names": [*settings.worker.own_names, settings.smtp.hostname]}
    )
    if not telling_names([worker.ehlo_name, *worker.own_names]) and not worker.own_addresses:
        log.warning(
            "worker.ehlo_name and smtp.hostname are %r and %r: an MX that points back at "
            "this queue is found only after smtp.max_received hops; set them to this "
            "host's name (or worker.own_addresses to its addresses)",
            worker.ehlo_name,
            settings.smtp.hostname,
        )
    deliverer = SmtpDeliverer(
        resolver,
        worker,
        PolicyEngine(settings.outbound_tls, settings.worker, stores.policies),
        sites.site_known if sites else None,
    )
    if sites is not None:
        sites.idle_sessions = deliverer.idle_sessions
        sites.shed_sessions = deliverer.shed_idle
        deliverer.session_reused = sites.session_reused
        deliverer.session_closed = sites.session_closed
        deliverer.opening = sites.connecting
    return Worker(
        cached,
        deliverer,
        DsnNotifier(cached, settings.dsn, policy),
        settings.worker,
        policy,
        RetryPolicy.from_settings(settings.retry, dsn=True),
        ack_wait_s=settings.nats.ack_wait_s,
        observer=observer,
        sites=sites,
    )


def destination_limits(
    settings: Settings, stores: Stores, resolver: Resolver, observer: Observer
) -> Destinations | None:
    """The cluster-wide destination limits of one worker (:mod:`jsqueue.destinations`);
    None when ``destinations.enabled`` is false or the stores share no destinations
    bucket."""
    if not settings.destinations.enabled or stores.destinations is None:
        return None

    async def mx_hosts(domain: str) -> list[str]:
        return [target.host for target in await resolver.resolve(domain)]

    owner = settings.worker.lease_owner or socket.gethostname()
    return Destinations(
        stores.destinations,
        settings.destinations,
        owner=owner,
        mx_hosts=mx_hosts,
        observer=observer,
        max_per_site=limits.per_site_cap(settings.worker.concurrency),
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
        ConfigError: no NATS URL, unusable front-end TLS or auth file settings, or an
            unusable ``worker.dkim`` key or CA bundle (``worker.tls_ca_file``,
            ``outbound_tls.mta_sts_ca_file``).
        ProvisioningError: a stream, bucket or consumer cannot be brought in line.
        OSError: the SMTP or HTTP listen address cannot be bound (a :class:`ListenError`).
        JsqueueError: the embedded nats-server is missing or cannot start (port taken), or
            it died while running (after the orderly shutdown).
    """
    if worker:
        load_keys(settings.worker.dkim)  # a bad DKIM key stops the start before anything runs
        check_ca_files(settings)  # so does a CA bundle that cannot be read
    nats_died = False

    def on_nats_exit() -> None:
        nonlocal nats_died
        if not stop.is_set():  # Ctrl-C reaches the child too; that is not a death
            nats_died = True
            stop.set()

    failure: BaseException | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if embedded:
                urls = await stack.enter_async_context(embedded_nats(settings, on_nats_exit))
            else:
                urls = nats_urls(settings)
            stores = await open_jetstream(settings.nats, urls)
            stack.push_async_callback(stores.close)
            tasks: list[asyncio.Task[None]] = []
            stack.push_async_callback(_ended, tasks)  # before the stores close
            api = None
            if settings.api.enabled:

                def api(observer: Observer) -> ApiMount | DashboardMount:
                    mount = ApiMount(settings, stores, urls, observer)
                    if not settings.ui.enabled:
                        return mount
                    return DashboardMount(mount, destination_rows(settings, stores))

            tel = await stack.enter_async_context(telemetry(settings, stores, urls, api=api))
            if smtp:
                server = await serve_smtp(
                    settings.front_end(), stores, tel.observer, on_reject=tel.metrics.rejected
                )
                stack.push_async_callback(server.stop)
                tel.health.set("smtp", True)
            if worker:
                w = build_worker(settings, stores, observer=tel.observer)
                if w.sites is not None:
                    top = settings.destinations.metrics_sites
                    tel.metrics.registry.register(DestinationCollector(w.sites.snapshot, top))
                tasks.append(asyncio.create_task(w.run(stop)))
                tel.health.set("worker", True)
            if worker and settings.outbound_tls.report.enabled:
                reporter = TlsReporter(settings, urls, stores)
                tasks.append(asyncio.create_task(report_loop(reporter, stores, stop)))
            if worker and settings.reconciler.enabled:
                reconciler = await open_reconciler(settings, urls)
                stack.push_async_callback(reconciler.close)
                tel.metrics.watch_reconciler(lambda: reconciler.failed_passes)
                tasks.append(asyncio.create_task(reconciler.run(stop)))
            # The worker logs its lease owner name once taken (another may have it).
            log.info("jsqueue running (smtp=%s, worker=%s)", smtp, worker)
            failure = await _supervise(tasks, stop)
            tel.health.stopping()
    except (JsqueueError, OSError) as e:
        if not nats_died:
            raise
        failure = e
    if nats_died:
        # The root cause, whatever a role raised while its server was gone.
        raise JsqueueError(
            "the embedded nats-server died; stopped (start again to recover)"
        ) from failure
    if failure is not None:
        raise failure


async def _ended(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the role tasks still running (a later part of the start failed) and wait
    for all of them; their errors are the first failure's consequences, not reported."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _supervise(tasks: list[asyncio.Task[None]], stop: asyncio.Event) -> BaseException | None:
    """Wait until ``stop`` is set or a role task (worker, reconciler, TLS reports) ends by
    itself, which sets ``stop``: the process then shuts down instead of running on without
    that role (a supervisor restarts it). Every task is awaited to its end.

    Returns:
        The first error a task ended with (None when all ended cleanly), for the caller to
        raise after the orderly shutdown.
    """
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
    ended = [t for t in tasks if t.done()]
    if ended and not stop.is_set():
        error = next((t.exception() for t in ended if not t.cancelled()), None)
        log.error("a jsqueue role stopped by itself (%s); shutting down", error or "no error")
        stop.set()
    await stopping
    log.info("jsqueue shutting down")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return next((r for r in results if isinstance(r, BaseException)), None)


def operator_name() -> str:
    """``admin:<user>@<host>``: who acted, for the events' ``source`` (``unknown`` when the
    user name cannot be found)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"admin:{user}@{socket.gethostname()}"


@contextlib.asynccontextmanager
async def open_admin(settings: Settings, *, events: bool = True) -> AsyncIterator[Admin]:
    """An :class:`~jsqueue.admin.Admin` connected to the configured NATS (``nats.urls``,
    else ``127.0.0.1:nats.port``), acting as :func:`operator_name`, publishing its events
    to the events stream when ``events`` is set.

    On exit, buffered events are published (bounded by ``nats.request_timeout_s``) and the
    connections close.

    Args:
        settings: all settings (the ``nats`` section is used).
        events: publish an event for every change (off for read-only commands).

    Raises:
        StoreUnavailable: NATS unreachable.
        ProvisioningError: see :func:`jsqueue.store.jetstream.provision`.
    """
    urls = nats_urls(settings)
    stores = await open_jetstream(settings.nats, urls, update=False)  # a tool: see provision
    try:
        if not events:
            yield Admin(stores, source=operator_name())
            return
        async with open_publisher(settings.nats, urls) as publisher:
            yield Admin(stores, publisher, source=operator_name())
    finally:
        await stores.close()


@contextlib.asynccontextmanager
async def open_injector(settings: Settings) -> AsyncIterator[Injector]:
    """An :class:`~jsqueue.http.inject.Injector` on the configured NATS, its ``received``
    events published to the events stream (``jsqueue inject``).

    Raises:
        StoreUnavailable: NATS unreachable.
        ProvisioningError: see :func:`jsqueue.store.jetstream.provision`.
    """
    urls = nats_urls(settings)
    stores = await open_jetstream(settings.nats, urls, update=False)  # a tool: see provision
    try:
        async with open_publisher(settings.nats, urls) as publisher:
            yield Injector(settings, stores, publisher)
    finally:
        await stores.close()
