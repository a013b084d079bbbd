"""The HTTP API for tests: tokens of every role, the API served in-process on loopback.

``api_env`` (fixture) starts the test's own nats-server stores, a tokens file with one
token per role (``read``, ``admin``, ``inject``) and the process's HTTP endpoint with the
API (:func:`jsqueue.health.telemetry`, as ``jsqueue up`` wires it) on 127.0.0.1, port 0.
Requests go over real HTTP (aiohttp's client); nothing is mocked.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jsqueue.config import Settings
from jsqueue.events import Observer
from jsqueue.health import telemetry
from jsqueue.http.app import ApiMount
from jsqueue.http.auth import Role, add_token
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import open_jetstream
from support.nats import make_settings, unique_names


def make_tokens(path: Path) -> dict[str, str]:
    """One token per role in a new tokens file at ``path``: role name → token."""
    return {role.value: add_token(path, f"t-{role.value}", role) for role in Role}


@dataclass
class ApiEnv:
    """A running API: its base URL, tokens by role, settings and the queue's stores."""

    url: str
    tokens: dict[str, str]
    settings: Settings
    stores: Stores
    session: aiohttp.ClientSession

    def auth(self, role: str) -> dict[str, str]:
        """The Authorization header of ``role``'s token."""
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    async def call(
        self, method: str, path: str, role: str | None = "admin", **kw: Any
    ) -> tuple[int, Any]:
        """(status, parsed JSON body or text) of one request."""
        headers = dict(kw.pop("headers", {}))
        if role is not None:
            headers.update(self.auth(role))
        async with self.session.request(method, self.url + path, headers=headers, **kw) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.text()


def api_settings(tmp_path: Path, url: str, **sections: Any) -> Settings:
    """Settings for an API test: the test's NATS (unique prefix), HTTP on port 0, tokens."""
    nats = make_settings(urls=[url], prefix=unique_names().prefix)
    values: dict[str, Any] = {
        "nats": nats,
        "http": {"port": 0, "probe_interval_s": 0.5, "queue_depth_interval_s": 0},
        "api": {"tokens_file": tmp_path / "tokens"},
        "smtp": {"hostname": "relay.jsqueue.example.test", "store_timeout_s": 5.0},
    }
    for k, v in sections.items():
        values[k] = {**values.get(k, {}), **v} if isinstance(v, dict) else v
    return Settings.model_validate(values)


@contextlib.asynccontextmanager
async def serve_api(settings: Settings, stores: Stores) -> AsyncIterator[str]:
    """The HTTP endpoint with the API over ``stores``; yields its base URL."""
    urls = list(settings.nats.urls)

    def api(observer: Observer) -> ApiMount:
        return ApiMount(settings, stores, urls, observer)

    async with telemetry(settings, stores, urls, api=api) as tel:
        assert tel.http is not None
        yield tel.http.url


@pytest.fixture
async def api_env(tmp_path: Path, nats_server: EmbeddedNats) -> AsyncIterator[ApiEnv]:
    """The API on the test's nats-server, with a token per role."""
    tokens = make_tokens(tmp_path / "tokens")
    settings = api_settings(tmp_path, nats_server.url)
    stores = await open_jetstream(settings.nats, list(settings.nats.urls))
    try:
        async with serve_api(settings, stores) as url, aiohttp.ClientSession() as session:
            yield ApiEnv(url, tokens, settings, stores, session)
    finally:
        await stores.close()
