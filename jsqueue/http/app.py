"""The HTTP API of a jsqueue process, mounted on its HTTP endpoint (:mod:`jsqueue.health`)
beside ``/metrics``, ``/healthz`` and ``/readyz`` (which stay anonymous).

Routes (docs/architecture.md, "HTTP API"; every one needs a bearer token):

* ``GET /api/openapi.json`` - the OpenAPI 3.1 document, generated from the route table;
* ``GET /api/v1/whoami`` - the caller's token name and role;
* queue: ``GET /api/v1/queue``, ``GET /api/v1/queue/{id}``, ``GET /api/v1/stats``,
  ``POST /api/v1/queue/{id}/{action}``, ``POST /api/v1/actions/{action}``
  (:mod:`.routes_queue`);
* ``GET /api/v1/events`` - server-sent events (:mod:`.routes_events`);
* ``POST /api/v1/inject`` (:mod:`.routes_inject`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

from jsqueue.config import Settings
from jsqueue.events import Observer
from jsqueue.http.auth import TokenFile
from jsqueue.http.context import ApiContext
from jsqueue.http.models import WhoAmI
from jsqueue.http.openapi import openapi_document
from jsqueue.http.routes_destinations import destination_routes
from jsqueue.http.routes_events import events_routes
from jsqueue.http.routes_inject import inject_routes
from jsqueue.http.routes_queue import queue_routes
from jsqueue.http.routing import Call, Route, json_dumps, mount
from jsqueue.store.base import Stores

#: Request bodies beyond the message: the JSON envelope, base64's 4/3, escapes.
_BODY_OVERHEAD = 1024 * 1024


def api_routes(ctx: ApiContext) -> list[Route]:
    """Every API route over ``ctx``, the OpenAPI document's included."""
    routes = queue_routes(ctx) + destination_routes(ctx) + events_routes(ctx)
    routes += inject_routes(ctx)

    async def whoami(call: Call) -> BaseModel:
        return WhoAmI(name=call.token.name, role=call.token.role.value)

    routes.append(
        Route(
            "GET",
            "/api/v1/whoami",
            "whoami",
            "The caller's token: name and role.",
            None,
            whoami,
            response=WhoAmI,
            tag="auth",
        )
    )
    document: dict[str, Any] = {}

    async def openapi(call: Call) -> web.StreamResponse:
        return web.Response(text=json_dumps(document), content_type="application/json")

    routes.append(
        Route(
            "GET",
            "/api/openapi.json",
            "openapi",
            "This document (OpenAPI 3.1, generated from the code's models).",
            None,
            openapi,
            stream="application/json",
            tag="auth",
        )
    )
    document.update(openapi_document(routes))
    return routes


def client_max_size(settings: Settings) -> int:
    """Largest request body the endpoint reads, octets: a base64 message of
    ``smtp.max_message_size`` and its envelope."""
    return settings.smtp.max_message_size * 4 // 3 + _BODY_OVERHEAD


class ApiMount:
    """Mounts the API on an aiohttp application (what :func:`jsqueue.health.telemetry`
    calls before the endpoint starts).

    Attributes:
        context: what the handlers share.
        client_max_size: the largest request body to read, octets (:func:`client_max_size`).

    Args:
        settings: all settings.
        stores: the queue's stores.
        urls: NATS server URLs.
        observer: publishes the API's events.

    Raises:
        ConfigError: ``api.tokens_file`` cannot be read or parsed.
    """

    def __init__(
        self, settings: Settings, stores: Stores, urls: list[str], observer: Observer
    ) -> None:
        tokens = TokenFile(settings.api.tokens_file)
        self.context = ApiContext(settings, stores, urls, observer, tokens)
        self.client_max_size = client_max_size(settings)

    def __call__(self, app: web.Application) -> None:
        """Add the API's routes and middleware to ``app``."""
        mount(app, self.context.tokens, api_routes(self.context))
