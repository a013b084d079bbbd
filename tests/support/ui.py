"""The dashboard for tests: a whole queue (front end, worker, scripted MXes, DNS on
loopback) with the HTTP endpoint serving the API and ``/ui/`` in-process on 127.0.0.1.

``ui_env`` (fixture) gives a :class:`UiEnv`: the dashboard's base URL, a token per role,
the harness (submit mail through the real SMTP front end) and the MXes of three
destinations, all started; a worker runs in the background. Nothing is mocked: the pages
are served by aiohttp on a real port, read a real nats-server, the worker speaks SMTP to
the scripted MXes, and every event goes through the real events stream.

Destinations: ``ok.example.test`` accepts, ``slow.example.test`` answers RCPT with
``450 4.2.0`` until :attr:`UiEnv.slow` is told otherwise, ``bad.example.test`` answers
``550 5.1.1``; ``example.test`` (the senders' domain) accepts the DSNs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jsqueue.config import ApiSettings, HttpSettings, UiSettings
from jsqueue.events import Observer
from jsqueue.frontend.server import SmtpServer
from jsqueue.health import telemetry
from jsqueue.http.app import ApiMount
from jsqueue.nats_server import EmbeddedNats
from jsqueue.runtime import build_worker
from jsqueue.ui.app import DashboardMount
from jsqueue.ui.pages import destination_rows
from support.api import make_tokens
from support.mx import ScriptedMx, SmtpdMx
from support.queue import Harness

ZONE = """
example.test.          300 IN MX 10 mx.example.test.
mx.example.test.       300 IN A  127.0.2.1
ok.example.test.       300 IN MX 10 mx.ok.example.test.
mx.ok.example.test.    300 IN A  127.0.2.30
slow.example.test.     300 IN MX 10 mx.slow.example.test.
mx.slow.example.test.  300 IN A  127.0.2.31
bad.example.test.      300 IN MX 10 mx.bad.example.test.
mx.bad.example.test.   300 IN A  127.0.2.32
"""

MESSAGE = (
    b"From: Alice <alice@example.test>\r\n"
    b"Subject: dashboard test\r\n"
    b"Message-ID: <ui-{n}@example.test>\r\n"
    b"\r\n"
    b"Hello.\r\n"
)

DEFER = "450 4.2.0 mailbox busy, try later"


@dataclass
class UiEnv:
    """A running dashboard over a running queue."""

    url: str
    tokens: dict[str, str]
    harness: Harness
    ok: SmtpdMx
    slow: ScriptedMx
    bad: SmtpdMx
    sender_mx: SmtpdMx

    async def submit(self, recipient: str, n: int = 0) -> str:
        """Send one message to ``recipient`` through the SMTP front end; its queue id."""
        return await self.harness.submit(MESSAGE.replace(b"{n}", str(n).encode()), [recipient])


@contextlib.asynccontextmanager
async def running_dashboard(h: Harness, nats_url: str, tokens_file: Path) -> AsyncIterator[str]:
    """The HTTP endpoint with API and dashboard over ``h``'s stores, the front end and
    one worker publishing to the events stream; yields the base URL."""
    settings = h.settings.model_copy(
        update={
            "nats": h.settings.nats.model_copy(update={"urls": [nats_url]}),
            "http": HttpSettings(port=0, probe_interval_s=0.5, queue_depth_interval_s=0),
            "api": ApiSettings(tokens_file=tokens_file),
            "ui": UiSettings(sample_interval_s=0.3, history_budget_s=5.0),
        }
    )
    h.settings = settings
    urls = list(settings.nats.urls)

    def api(observer: Observer) -> DashboardMount:
        mount = ApiMount(settings, h.stores, urls, observer)
        return DashboardMount(mount, destination_rows(settings, h.stores))  # as runtime does

    async with telemetry(settings, h.stores, urls, api=api) as tel:
        assert tel.http is not None
        h.frontend = SmtpServer(settings.smtp, h.stores, tel.observer)
        await h.frontend.start()
        worker = build_worker(settings, h.stores, observer=tel.observer)
        async with h.running(worker):
            yield tel.http.url


@pytest.fixture
async def ui_env(
    queue_harness: Harness, nats_server: EmbeddedNats, tmp_path: Path
) -> AsyncIterator[UiEnv]:
    """The dashboard over a queue with three destinations (see the module docstring);
    retries an hour apart, so a deferred message stays deferred until flushed."""
    h = queue_harness
    h.dns.add(ZONE)
    h.configure(retry={"base_s": 3600.0, "factor": 1.0, "jitter": 0.0})
    tokens = make_tokens(tmp_path / "tokens")
    async with (
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
        SmtpdMx("127.0.2.30", h.mx_port) as ok,
        ScriptedMx("127.0.2.31", h.mx_port, rcpt=DEFER) as slow,
        SmtpdMx(
            "127.0.2.32", h.mx_port, rcpt_replies={"x@bad.example.test": "550 5.1.1 no"}
        ) as bad,
        running_dashboard(h, nats_server.url, tmp_path / "tokens") as url,
    ):
        yield UiEnv(url, tokens, h, ok, slow, bad, sender_mx)
