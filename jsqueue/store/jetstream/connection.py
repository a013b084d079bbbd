"""Connection: :func:`connect_nats` (a client that reconnects forever across node loss),
:func:`open_jetstream` (connect, provision, and the four JetStream stores on one
connection, provisioned again after every reconnect), the read-only health probe
:func:`queue_backlog`, and :func:`close_nats`, which closes a client whatever state it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS

from jsqueue.config import NatsSettings
from jsqueue.errors import ConfigError, ProvisioningError, StoreUnavailable
from jsqueue.names import Names
from jsqueue.store.base import Lock, Stores
from jsqueue.store.jetstream.api import NATS_FAILURES, describe, translate
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.jetstream.destinations import JetStreamDestinations
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from jsqueue.store.jetstream.ingest import JetStreamIngestLog
from jsqueue.store.jetstream.lock import JetStreamLock
from jsqueue.store.jetstream.policies import JetStreamPolicyCache
from jsqueue.store.jetstream.presence import JetStreamPresence
from jsqueue.store.jetstream.provisioning import provision
from jsqueue.store.jetstream.work import JetStreamScheduler
from jsqueue.tasks import cancel_and_wait

log = logging.getLogger("jsqueue.store.jetstream")

#: nats-py reconnect pause per server, seconds.
RECONNECT_WAIT_S = 0.5
#: Longest pause between two tries of provisioning after a reconnect, seconds.
REPROVISION_PAUSE_MAX_S = 5.0


class _Reprovision:
    """Provisions a connection's streams, buckets and consumer again after each reconnect.

    A restarted nats-server comes back without what was held in memory (the ingest log's
    stream) and, after a loss of its store, without anything; a process that kept running
    would otherwise fail every request to the missing object until it is restarted itself.
    One run at a time (a reconnect during a run does not start a second), retried with a
    growing pause while JetStream is not answering yet; a ProvisioningError (settings that
    cannot be applied) is logged and not retried.
    """

    def __init__(self, settings: NatsSettings, names: Names, *, update: bool = True) -> None:
        self.settings = settings
        self.names = names
        self.update = update
        self.nc: NATS | None = None
        self._task: asyncio.Task[None] | None = None

    async def trigger(self) -> None:
        """The reconnected callback: start a run unless one is under way. Never blocks
        (nats-py awaits the callback in its reconnect path)."""
        if self.nc is None or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.create_task(self._run(self.nc))

    async def _run(self, nc: NATS) -> None:
        pause = RECONNECT_WAIT_S
        while not nc.is_closed:
            try:
                await provision(nc, self.settings, self.names, update=self.update)
            except StoreUnavailable as e:
                log.info("nats: provisioning after reconnect not possible yet: %s", e)
            except ProvisioningError as e:
                log.error("nats: provisioning after reconnect failed: %s", e)
                return
            else:
                log.info("nats: streams, buckets and consumer provisioned after reconnect")
                return
            await asyncio.sleep(pause)
            pause = min(REPROVISION_PAUSE_MAX_S, pause * 2)

    async def close(self) -> None:
        """Stop a run under way. Idempotent."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})


async def connect_nats(
    settings: NatsSettings,
    urls: list[str],
    *,
    on_reconnected: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect to NATS; the connection then reconnects forever (node loss, restarts), and
    to another server of ``urls`` when the one it is connected to falls silent: no answer
    to ``settings.max_outstanding_pings`` PINGs sent every ``settings.ping_interval_s``
    seconds (a paused or cut-off node keeps its TCP connections open; without the PINGs
    every request would time out on it until it resumed). Logs the server it connected to.

    Args:
        settings: credentials and timeouts.
        urls: server URLs (several for a cluster).
        on_reconnected: awaited after each reconnect; must not block (start a task).

    Raises:
        StoreUnavailable: no server accepted a connection within ``connect_timeout_s``
            seconds per URL.
    """
    nc = NATS()
    errors: list[BaseException] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)
        log.warning("nats: %s", describe(e))

    async def on_disconnected() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected")

    async def reconnected() -> None:
        log.warning("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        if on_reconnected is not None:
            await on_reconnected()

    options: dict[str, Any] = {
        "servers": urls,
        "name": "jsqueue",
        "connect_timeout": settings.connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        # nats-py's defaults (a PING every 120 s, 2 unanswered) let a server that is alive
        # but silent (SIGSTOP: measured, a front end answered 451 to every message for a
        # whole 12 s pause) hold its clients for minutes; these notice it within seconds.
        "ping_interval": settings.ping_interval_s,
        "max_outstanding_pings": settings.max_outstanding_pings,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": reconnected,
    }
    if settings.user:
        options["user"] = settings.user
    if settings.password:
        options["password"] = settings.password.get_secret_value()
    if settings.creds_file:
        options["user_credentials"] = str(settings.creds_file)
    budget_s = settings.connect_timeout_s * max(1, len(urls))
    try:
        await asyncio.wait_for(nc.connect(**options), timeout=budget_s)
    except (TimeoutError, *NATS_FAILURES) as e:
        await close_nats(nc)
        cause = describe(errors[-1]) if errors else describe(e)
        raise StoreUnavailable(
            f"cannot connect to NATS at {', '.join(urls)} within {budget_s:g} s: {cause}"
        ) from e
    log.info("nats: connected to %s", nc.connected_url.netloc if nc.connected_url else "?")
    return nc


async def open_jetstream(
    settings: NatsSettings,
    urls: list[str] | None = None,
    *,
    names: Names | None = None,
    update: bool = True,
) -> Stores:
    """Connect, provision and return the JetStream body store, entry store, scheduler and
    ingest log, all on one new connection. Provisioning is idempotent, and runs again after
    every reconnect (a restarted server may have lost what it held in memory: the ingest
    log); every call opens its own connection.

    Args:
        settings: the ``nats`` settings section.
        urls: server URLs; ``settings.urls`` when None (e.g. the embedded server's URL).
        names: object names; ``Names(settings.prefix)`` when None.
        update: bring existing streams and the consumer in line with ``settings`` (the
            queue's own processes); False for tools, which only create what is missing
            (:func:`~jsqueue.store.jetstream.provisioning.provision`).

    Returns:
        the stores; ``close()`` flushes buffered acks and closes the connection.

    Raises:
        ConfigError: no URL given.
        StoreUnavailable: NATS unreachable (within the connect timeout) or JetStream off.
        ProvisioningError: see :func:`~jsqueue.store.jetstream.provisioning.provision`.
    """
    names = names or Names(settings.prefix)
    servers = list(urls or settings.urls)
    if not servers:
        raise ConfigError("nats.urls: no NATS server URL given")
    again = _Reprovision(settings, names, update=update)
    nc = await connect_nats(settings, servers, on_reconnected=again.trigger)
    try:
        await provision(nc, settings, names, update=update)
    except BaseException:
        await _close(nc)
        raise
    again.nc = nc
    timeout_s = settings.request_timeout_s
    bodies = JetStreamBodyStore(nc, names, timeout_s=timeout_s)
    entries = JetStreamEntryStore(nc, names, timeout_s=timeout_s)
    scheduler = JetStreamScheduler(nc, names, timeout_s=timeout_s)
    ingest = JetStreamIngestLog(nc, names, timeout_s=timeout_s)

    async def close() -> None:
        await again.close()
        await _close(nc)

    async def lock(key: str, ttl_s: float) -> Lock:
        held = JetStreamLock(
            nc, names, ttl_s=ttl_s, replicas=settings.replicas, timeout_s=timeout_s, key=key
        )
        await held.provision()
        return held

    presence = JetStreamPresence(nc, names, replicas=settings.replicas, timeout_s=timeout_s)
    policies = JetStreamPolicyCache(nc, names, replicas=settings.replicas, timeout_s=timeout_s)
    destinations = JetStreamDestinations(nc, names, replicas=settings.replicas, timeout_s=timeout_s)
    return Stores(
        bodies,
        entries,
        scheduler,
        close,
        ingest,
        lock=lock,
        presence=presence,
        policies=policies,
        destinations=destinations,
    )


async def queue_backlog(
    settings: NatsSettings, urls: list[str] | None = None, *, names: Names | None = None
) -> int:
    """The health probe: read the work consumer without creating or changing anything.

    Args:
        settings: the ``nats`` settings section.
        urls: server URLs; ``settings.urls`` when None.
        names: object names; ``Names(settings.prefix)`` when None.

    Returns:
        the work backlog (consumer num_pending + num_ack_pending).

    Raises:
        ConfigError: no URL given.
        StoreUnavailable: NATS unreachable or not answering.
        ProvisioningError: the work stream or its consumer does not exist (the queue was
            never set up on this NATS, or under another ``nats.prefix``).
    """
    names = names or Names(settings.prefix)
    servers = list(urls or settings.urls)
    if not servers:
        raise ConfigError("nats.urls: no NATS server URL given")
    nc = await connect_nats(settings, servers)
    try:
        js = nc.jetstream(timeout=settings.request_timeout_s)
        with translate("work consumer: info"):
            try:
                info = await js.consumer_info(names.work_stream, names.work_consumer)
            except nats.js.errors.NotFoundError as e:
                raise ProvisioningError(
                    f"queue not set up on NATS: {names.work_stream}/{names.work_consumer} "
                    "does not exist (start a worker or front end first, or check nats.prefix)"
                ) from e
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    finally:
        await _close(nc)


async def _close(nc: NATS) -> None:
    """Flush what is buffered (acks, NAKs) with a server round trip, then close.

    Not ``drain()``: it waits for pull-subscription inboxes that nobody reads any more.
    """
    if nc.is_closed:
        return
    try:
        await nc.flush(timeout=2)
    except (TimeoutError, *NATS_FAILURES) as e:
        log.warning("nats: final flush failed (%s); closing anyway", describe(e))
    await close_nats(nc)


async def close_nats(nc: NATS) -> None:
    """Close ``nc``, whatever state its connection is in, and make sure nats-py's reconnect
    task has ended (nats-py 2.16 can lose the cancellation ``close()`` sends it, and a task
    left running keeps a process from ending on SIGTERM; docs/architecture.md, "Closing a
    connection"). Idempotent. Never raises (cancellation aside): nats-py's own close errors
    on a dead connection (lost connection; on uvloop a RuntimeError) are swallowed.
    """
    with contextlib.suppress(*NATS_FAILURES, RuntimeError):
        await nc.close()
    task: asyncio.Task[None] | None = getattr(nc, "_reconnection_task", None)
    if task is not None:
        await cancel_and_wait(task, again_s=RECONNECT_WAIT_S / 5)
