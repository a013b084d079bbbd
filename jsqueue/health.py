"""The HTTP endpoint of a jsqueue process: ``/metrics``, ``/healthz`` and ``/readyz``.

* ``GET /metrics`` - the process's Prometheus registry (text exposition format).
* ``GET /healthz`` - liveness: 200 while the event loop answers (STYLE.md habit 10).
* ``GET /readyz`` - readiness: 200 when every registered component is ready (NATS probe
  succeeded, front end listening, worker fetching), else 503; the JSON body says which.
  A draining process turns not-ready first, so a load balancer stops sending it work.

Served by aiohttp on ``http.host:http.port`` (settings section ``http``), on the same
event loop as the queue; nothing here touches NATS (the probe does, on its own schedule).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jsqueue.config import HttpSettings, Settings
from jsqueue.errors import listen_error
from jsqueue.events import Fanout, Observer, open_publisher
from jsqueue.metrics import Metrics, QueueProbe
from jsqueue.names import Names
from jsqueue.store.base import Stores

log = logging.getLogger("jsqueue.health")


class Health:
    """Readiness of a process's components (``nats``, ``smtp``, ``worker`` ...).

    A component is registered not ready with :meth:`require` and flips with :meth:`set`;
    the process is ready when every registered component is. Not thread-safe (one loop).
    """

    def __init__(self) -> None:
        self._ready: dict[str, bool] = {}
        self._stopping = False

    def require(self, *components: str) -> None:
        """Register components, not ready yet. Idempotent for known components."""
        for name in components:
            self._ready.setdefault(name, False)

    def set(self, component: str, ready: bool) -> None:
        """Mark ``component`` ready or not (registering it if new)."""
        self._ready[component] = ready

    @property
    def components(self) -> dict[str, bool]:
        """A copy of every component's readiness."""
        return dict(self._ready)

    def stopping(self) -> None:
        """The process is shutting down: not ready from now on, whatever the components say."""
        self._stopping = True

    @property
    def ready(self) -> bool:
        """True when at least one component is registered, all are ready, and the process is
        not shutting down."""
        return not self._stopping and bool(self._ready) and all(self._ready.values())


class Extension(Protocol):
    """Adds routes to the endpoint's application before it starts (the HTTP API,
    :class:`jsqueue.http.app.ApiMount`)."""

    client_max_size: int

    def __call__(self, app: web.Application) -> None:
        """Add routes and middleware to ``app``."""
        ...


class HttpServer:
    """aiohttp server for ``/metrics``, ``/healthz`` and ``/readyz``, and what ``extension``
    adds (the HTTP API under ``/api/``).

    Args:
        settings: the ``http`` settings section (listen host and port; port 0 = any).
        metrics: the registry to expose.
        health: readiness of the process.
        extension: more routes, or None.
    """

    def __init__(
        self,
        settings: HttpSettings,
        metrics: Metrics,
        health: Health,
        extension: Extension | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.health = health
        app = web.Application(client_max_size=extension.client_max_size if extension else 1024**2)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if extension is not None:
            extension(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._site: web.TCPSite | None = None

    async def start(self) -> None:
        """Listen on ``settings.host:settings.port``.

        Raises:
            ListenError: the address cannot be bound (names ``http.host``/``http.port``).
            listen_error: the ListenError above, as built by
                :func:`~jsqueue.errors.listen_error`.
        """
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        try:
            await self._site.start()
        except OSError as e:
            raise listen_error("http", self.settings.host, self.settings.port, e) from e
        log.info("HTTP endpoint on http://%s:%d/metrics", *self.address)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound (the real port when configured as 0).

        Raises:
            RuntimeError: not started.
        """
        addresses = self._runner.addresses if self._site is not None else []
        if not addresses:
            raise RuntimeError("HTTP server not started")
        host, port = addresses[0][:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:9125``."""
        host, port = self.address
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    async def stop(self) -> None:
        """Stop listening and close open connections. Idempotent."""
        await self._runner.cleanup()
        self._site = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = self.health.ready
        components = self.health.components
        body = json.dumps({"ready": ready, "components": components})
        return web.Response(
            text=body + "\n", status=200 if ready else 503, content_type="application/json"
        )


async def serve_http(
    settings: HttpSettings,
    metrics: Metrics,
    health: Health,
    extension: Extension | None = None,
) -> HttpServer:
    """Start the HTTP endpoint on the running loop; ``await server.stop()`` to end it.

    Raises:
        OSError: the listen address cannot be bound.
    """
    server = HttpServer(settings, metrics, health, extension)
    await server.start()
    return server


@dataclass(frozen=True)
class Telemetry:
    """What :func:`telemetry` wires up for one process.

    Attributes:
        observer: hand it to the front end and workers (events stream + metrics).
        metrics: the process's registry.
        health: mark components ready (``smtp``, ``worker``); ``nats`` is kept by the probe.
        http: the running HTTP endpoint, None when ``http.enabled`` is off.
    """

    observer: Observer
    metrics: Metrics
    health: Health
    http: HttpServer | None


@contextlib.asynccontextmanager
async def telemetry(
    settings: Settings,
    stores: Stores,
    urls: list[str],
    *,
    api: Callable[[Observer], Extension] | None = None,
) -> AsyncIterator[Telemetry]:
    """Events publisher, metrics, NATS probe and HTTP endpoint for one process; ``api``
    makes the HTTP API's routes from the process's observer (events stream + metrics).

    On exit: not ready, probe stopped, HTTP endpoint closed, buffered events published
    (bounded by ``nats.request_timeout_s``), events connection closed.

    Raises:
        StoreUnavailable: NATS unreachable (the events connection).
        ConfigError: the API's tokens file cannot be read or parsed.
        OSError: the HTTP listen address cannot be bound.
    """
    metrics = Metrics()
    health = Health()
    async with (
        open_publisher(settings.nats, urls) as publisher,
        contextlib.AsyncExitStack() as stack,
    ):
        metrics.watch_publisher(publisher)
        observer = Fanout(publisher, metrics)
        http: HttpServer | None = None
        if settings.http.enabled:
            health.require("nats")
            interval_s = settings.http.probe_interval_s
            exporter = None
            if stores.lock is not None:  # a dead exporter is replaced within 3 probes
                exporter = await stores.lock(
                    Names(settings.nats.prefix).gauges_lock_key, 3 * interval_s
                )
            probe = QueueProbe(
                stores,
                metrics,
                probe_interval_s=interval_s,
                depth_interval_s=settings.http.queue_depth_interval_s,
                on_health=lambda ok: health.set("nats", ok),
                exporter=exporter,
            )
            stop_probe = asyncio.Event()
            probe_task = asyncio.create_task(probe.run(stop_probe), name="jsqueue-probe")

            async def end_probe() -> None:
                stop_probe.set()
                await probe_task

            stack.push_async_callback(end_probe)
            extension = api(observer) if api is not None else None
            http = await serve_http(settings.http, metrics, health, extension)
            stack.push_async_callback(http.stop)
        try:
            yield Telemetry(observer, metrics, health, http)
        finally:
            health.stopping()
